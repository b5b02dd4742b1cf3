"""Where actions run: the sandbox protocol and its backends.

`LocalSandbox` runs shell commands under its own uid (bubblewrap when available);
`PythonWorker` keeps one python interpreter per trajectory for tool-integrated reasoning;
`DockerSandbox` runs them in a hardened container (`sandbox.docker.reap` removes leftovers);
`E2BSandbox` in an E2B cloud sandbox (`sandbox.e2b.reap` kills leftovers).
`Fleet` places sandboxes for many trajectories over hosts (`sandbox.fleet.ray_hosts.RayHost`
when the hosts are Ray actors on other machines).
"""

from sandbox.base import (
    ExecResult,
    Sandbox,
    SandboxCleanupError,
    SandboxClosedError,
    SandboxDiedError,
    SandboxError,
    SandboxFileError,
    SandboxResourceError,
    SandboxStartError,
    SandboxUnavailableError,
)
from sandbox.docker import DockerSandbox, DockerSandboxConfig
from sandbox.e2b import E2BSandbox, E2BSandboxConfig
from sandbox.fleet import (
    Fleet,
    FleetConfig,
    FleetDeadlineError,
    FleetSandbox,
    HostConfig,
    InProcessHost,
    SandboxHost,
)
from sandbox.local import LocalSandbox, LocalSandboxConfig
from sandbox.python_worker import PythonWorker, PythonWorkerConfig, WorkerExecResult

__all__ = [
    "DockerSandbox",
    "DockerSandboxConfig",
    "E2BSandbox",
    "E2BSandboxConfig",
    "ExecResult",
    "Fleet",
    "FleetConfig",
    "FleetDeadlineError",
    "FleetSandbox",
    "HostConfig",
    "InProcessHost",
    "LocalSandbox",
    "LocalSandboxConfig",
    "PythonWorker",
    "PythonWorkerConfig",
    "Sandbox",
    "SandboxCleanupError",
    "SandboxClosedError",
    "SandboxDiedError",
    "SandboxError",
    "SandboxFileError",
    "SandboxHost",
    "SandboxResourceError",
    "SandboxStartError",
    "SandboxUnavailableError",
    "WorkerExecResult",
]
