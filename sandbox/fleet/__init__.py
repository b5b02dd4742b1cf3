"""Fleet: sandboxes for many concurrent trajectories, placed over a set of hosts.

A host (`SandboxHost`) runs sandboxes of one backend (local or Docker) up to a cap, keeps
a warm pool per image, knows the images it holds (pulls or builds ahead of need, removes
the least recently used under a disk budget) and reaps what a crashed run left behind.
The fleet places each new sandbox on a healthy host with a free slot (one with a warm
sandbox for the image first, then one holding the image, then the least loaded) and
hands out a `FleetSandbox`, which implements the `Sandbox` protocol by calling the host.

Failure rules (DESIGN.md invariant 5):
- a failed start is retried on another host, with backoff: nothing of the trajectory ran;
- a command, a file transfer or a liveness check is never retried: its effects are
  unknown, so the SandboxError goes to the caller, which ends the trajectory with status
  sandbox_error and the reason; the sandbox is not used again after it died;
- every call to a host has a deadline (a command's: its timeout plus a margin); past it
  the call raises FleetDeadlineError and is abandoned, so a paused container, a hung
  daemon or a stopped host cannot hold a trajectory; a start that finishes late is closed;
- each host has a circuit breaker: after `breaker_failures` infrastructure failures in a
  row no new sandbox goes there for `breaker_cooldown_s`, then one start may probe it.

On one machine hosts run in this process (`InProcessHost`); across machines each host is
a Ray actor on its node (`sandbox.fleet.ray_hosts.RayHost`, imported by its own path: it
imports ray).

Limits, stated plainly:
- Leftovers are reaped by the host that made them (containers by label, local sandboxes
  by their uid range), when it opens or shuts down; a host that cannot be reached (its
  daemon down, its actor dead on another node) keeps them until a host with its name and
  owner opens there again.
- A daemon may itself hang on a container: with cgroup v1, a `docker pause` that lands
  while runc is starting an exec leaves `runc init` frozen and the container locked in
  the daemon (even unpause hangs) until its freezer cgroup is thawed by hand. Deadlines
  still hold; reaping cannot remove that container.
- The disk budget counts docker's per-image size, shared layers once per image.

The package: `hosts` (what passes between the fleet and a host: `HostConfig`,
`HostStatus`, `Created`, the `SandboxHost` protocol, container labels), `in_process`
(`InProcessHost`, `reap_local`), `images` (docker image presence, pull, build), `breaker`
(`CircuitBreaker`), `placement` (the fleet's view of a host and its rank), `metrics`
(latency samples), `fleet` (`FleetConfig`, `Fleet`, `FleetSandbox`), `ray_hosts` (`RayHost`).
"""

from sandbox.fleet.breaker import CircuitBreaker
from sandbox.fleet.fleet import Fleet, FleetConfig, FleetDeadlineError, FleetSandbox
from sandbox.fleet.hosts import (
    HOST_LABEL,
    LOCAL_IMAGE,
    SANDBOX_ID_LABEL,
    Created,
    HostConfig,
    HostStatus,
    ImageBuild,
    SandboxHost,
)
from sandbox.fleet.in_process import InProcessHost, reap_local

__all__ = [
    "HOST_LABEL",
    "LOCAL_IMAGE",
    "SANDBOX_ID_LABEL",
    "CircuitBreaker",
    "Created",
    "Fleet",
    "FleetConfig",
    "FleetDeadlineError",
    "FleetSandbox",
    "HostConfig",
    "HostStatus",
    "ImageBuild",
    "InProcessHost",
    "SandboxHost",
    "reap_local",
]
