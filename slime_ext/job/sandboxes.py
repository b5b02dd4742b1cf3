"""The job's SWE sandboxes, from its `sandbox` section, one way on every path (the slime
generate hook, `opd train`, `opd eval`, `opd ssd`).

`JobSandboxes` is opened once per event loop and then hands out sandboxes by a task's image
(`sandbox(image)`, a harness's `sandbox_factory`). Local and Docker sandboxes come from a
`Fleet`: its hosts are this machine (`hosts: here`), a host actor on every Ray node that
offers the sandbox-host resource (`hosts: ray`, the nodes `opd launch` starts on
cluster.sandbox_hosts), or the hosts a fleet file names; E2B sandboxes from the E2B
account, a template per image.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import yaml
from pydantic import SecretStr

from rollout.harness.swe import SWEHarnessConfig
from sandbox.base import Sandbox, SandboxClosedError, SandboxUnavailableError
from sandbox.docker import DockerSandboxConfig
from sandbox.e2b import E2BSandboxConfig, e2b_sandbox_factory
from sandbox.fleet import Fleet, FleetConfig, HostConfig, InProcessHost, SandboxHost
from sandbox.local import LocalSandboxConfig
from slime_ext.job.config import JobConfig, SandboxConfig

logger = logging.getLogger(__name__)

Backend = Literal["local", "docker"]


class FleetFileError(ValueError):
    """A fleet file that cannot be used, with what is wrong in it."""


def run_owner(run_dir: str | Path, prefix: str = "opd") -> str:
    """The owner label of a run's sandboxes: the same for a restarted run (its hosts reap
    what the run left before), different for every other run."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]
    return f"{prefix}-{digest}"


def hosts_of(job: JobConfig) -> Literal["here", "ray"]:
    """Where the job's local and Docker sandboxes start (the section's `hosts`, resolved)."""
    if job.sandbox.hosts != "auto":
        return job.sandbox.hosts
    on_cluster = job.parallel.gpus_per_node > 0  # `opd launch`, which starts the hosts
    return "ray" if on_cluster and job.cluster.sandbox_hosts else "here"


def backends_of(section: SandboxConfig) -> tuple[Backend, ...]:
    """The host backends a fleet needs: auto runs image-less tasks locally and the others
    in Docker, so it has both."""
    if section.backend == "local":
        return ("local",)
    if section.backend == "docker":
        return ("docker",)
    return ("local", "docker")


def describe_sandboxes(
    section: SandboxConfig, hosts: Literal["here", "ray"], on_cluster: bool = False
) -> str:
    """One line for plans (`on_cluster`) and logs: the backend and where sandboxes start."""
    if section.backend == "e2b":
        mapped = f", {len(section.images)} images mapped" if section.images else ""
        return f"e2b (a template per task image{mapped}; key in ${section.e2b_api_key_env})"
    backends = " + ".join(backends_of(section))
    if section.fleet_file:
        where = f"the hosts of {section.fleet_file}"
    elif hosts == "ray":
        where = "every Ray node offering the sandbox-host resource (cluster.sandbox_hosts)"
    else:
        where = "the node slime's rollout process runs on" if on_cluster else "this machine"
    return (
        f"{backends} on {where}, up to {section.max_sandboxes} per host, "
        f"{section.memory_mb} MB / {section.cpus:g} CPU / {section.max_processes} processes "
        f"each, network {'on' if section.network else 'off'}"
    )


def docker_configured() -> bool:
    """Whether this machine names a Docker daemon (DOCKER_HOST, or the default socket)."""
    return bool(os.environ.get("DOCKER_HOST")) or Path("/var/run/docker.sock").exists()


def image_to_run(section: SandboxConfig, image: str | None) -> str | None:
    """The image (or E2B template) that runs a task naming `image`: its entry in `images`,
    else the registry prefix added to it; None stays None (the host's default)."""
    if image is None:
        return None
    if image in section.images:
        return section.images[image]
    return f"{section.registry}{image}" if section.registry else image


def host_config(section: SandboxConfig, name: str, backend: Backend) -> HostConfig:
    """One host's settings from the section's limits; the SWE harness's defaults for the
    rest (task images run with a writable root: the repository lives in it)."""
    defaults = SWEHarnessConfig()
    local: LocalSandboxConfig = defaults.sandbox.model_copy(
        update={"memory_mb": section.memory_mb, "max_processes": section.max_processes}
    )
    docker_update: dict[str, Any] = {
        "memory_mb": section.memory_mb,
        "cpus": section.cpus,
        "max_processes": section.max_processes,
        "workdir_size_mb": section.scratch_mb,
        "network_mode": "bridge" if section.network else "none",
    }
    if section.image is not None:
        docker_update["image"] = section.image
    docker: DockerSandboxConfig = defaults.docker.model_copy(update=docker_update)
    return HostConfig(
        name=name,
        backend=backend,
        local=local,
        docker=docker,
        max_sandboxes=section.max_sandboxes,
        warm_per_image=section.warm_per_image,
    )


def load_fleet_file(path: str | Path) -> tuple[FleetConfig, list[HostConfig]]:
    """A fleet YAML: {config: FleetConfig fields, hosts: [HostConfig fields, ...]}."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise FleetFileError(f"{path}: cannot read the fleet file: {exc}") from exc
    if not isinstance(data, dict) or not data.get("hosts"):
        raise FleetFileError(f"{path}: a fleet file needs `hosts:` (a list of host settings)")
    unknown = set(data) - {"config", "hosts"}
    if unknown:
        raise FleetFileError(f"{path}: unknown keys {sorted(unknown)}; allowed: config, hosts")
    if not isinstance(data["hosts"], list):
        raise FleetFileError(f"{path}: `hosts:` must be a list of host settings")
    try:
        config = FleetConfig.model_validate(data.get("config") or {})
        hosts = [HostConfig.model_validate(host) for host in data["hosts"]]
    except ValueError as exc:
        raise FleetFileError(f"{path}: {exc}") from exc
    return config, hosts


def ray_hosts(section: SandboxConfig, owner: str) -> list[SandboxHost]:
    """A host actor per backend on every alive Ray node offering the sandbox-host resource
    (this process must be connected to the job's Ray cluster), named address-backend."""
    import ray

    from sandbox.fleet.ray_hosts import SANDBOX_RESOURCE, SandboxNode, spawn_per_node

    if not ray.is_initialized():  # the slime hook runs in Ray; `opd train` may not
        address = os.environ.get("RAY_ADDRESS", "auto")
        try:
            _gcs_answers(address)  # ray.init retries a silent address for minutes
            ray.init(address=address, logging_level=logging.WARNING)
        except (OSError, RuntimeError, ValueError) as exc:
            raise SandboxUnavailableError(
                f"sandbox.hosts ray: no Ray cluster answers at {address} ({exc}); start one "
                "with sandbox hosts, or set sandbox.hosts: here"
            ) from exc

    def configs_for(node: SandboxNode) -> list[HostConfig]:
        return [
            host_config(section, f"{node.address}-{backend}", backend)
            for backend in backends_of(section)
        ]

    hosts: list[SandboxHost] = list(spawn_per_node(configs_for, owner))
    if not hosts:
        raise SandboxUnavailableError(
            f"sandbox.hosts ray: no alive Ray node offers the {SANDBOX_RESOURCE!r} resource "
            "(cluster.sandbox_hosts start with it under `opd launch`)"
        )
    return hosts


def _gcs_answers(address: str, timeout_s: float = 5.0) -> None:
    """Raises OSError when `address` (host:port; "auto" is Ray's to find) takes no
    connection."""
    host, _, port = address.rpartition(":")
    if address != "auto" and host and port.isdigit():
        socket.create_connection((host.removeprefix("ray://"), int(port)), timeout_s).close()


class JobSandboxes:
    """The job's SWE sandboxes (see the module docstring); `async with` or open/close."""

    def __init__(
        self,
        section: SandboxConfig,
        owner: str,
        *,
        hosts: Literal["here", "ray"] = "here",
        trajectory_timeout_s: float = 2400.0,
        e2b_sdk: Any = None,
    ) -> None:
        """`hosts`: resolved (see `hosts_of`); `trajectory_timeout_s`: an E2B sandbox's
        lifetime at creation. The fleet has the owner's default settings (a fleet file
        brings its own)."""
        self.section = section
        self.owner = owner
        self.hosts = hosts
        self._trajectory_timeout_s = trajectory_timeout_s
        self._e2b_sdk = e2b_sdk
        self._fleet: Fleet | None = None
        self._e2b: Any = None
        self._opening: asyncio.Lock | None = None
        self._opened = False

    @classmethod
    def of_job(cls, job: JobConfig, owner: str, **options: Any) -> JobSandboxes:
        """The sandboxes of `job`'s sandbox section, its hosts resolved."""
        return cls(
            job.sandbox,
            owner,
            hosts=hosts_of(job),
            trajectory_timeout_s=job.rollout.trajectory_timeout_s,
            **options,
        )

    def describe(self) -> str:
        """One line for logs: the backend and where sandboxes start."""
        return describe_sandboxes(self.section, self.hosts)

    @property
    def fleet(self) -> Fleet | None:
        """The fleet behind local and Docker sandboxes (None for e2b, or before open)."""
        return self._fleet

    async def open(self) -> None:
        """Start the hosts (each reaps what an earlier run of this owner left); once."""
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._opened:
                return
            self._open_backend()
            if self._fleet is not None:
                await self._fleet.open()
            self._opened = True

    def _open_backend(self) -> None:
        section = self.section
        if section.backend == "e2b":
            key = os.environ.get(section.e2b_api_key_env)
            if not key:  # refused here, not by each trajectory's first sandbox
                raise SandboxUnavailableError(
                    f"sandbox.backend e2b: no E2B API key in ${section.e2b_api_key_env} (set "
                    "it, or name the variable holding it in sandbox.e2b_api_key_env)"
                )
            e2b = E2BSandboxConfig(
                template=section.image or "base",
                api_key=SecretStr(key),
                allow_internet_access=section.network,
                owner=self.owner,
                trajectory_timeout_s=max(1, int(self._trajectory_timeout_s)),
            )
            self._e2b = e2b_sandbox_factory(e2b, sdk=self._e2b_sdk, templates=section.images)
            return
        config = FleetConfig(owner=self.owner)
        hosts: list[SandboxHost]
        if section.fleet_file:
            config, host_configs = load_fleet_file(section.fleet_file)
            hosts = [InProcessHost(host, config.owner) for host in host_configs]
        elif self.hosts == "ray":
            hosts = ray_hosts(section, config.owner)
        else:
            backends = backends_of(section)
            if section.backend == "auto" and not docker_configured():
                backends = ("local",)  # no daemon here: image tasks fail with that reason
            hosts = [
                InProcessHost(host_config(section, f"here-{backend}", backend), config.owner)
                for backend in backends
            ]
        self._fleet = Fleet(hosts, config)

    def sandbox(self, image: str | None) -> Sandbox:
        """An unstarted sandbox for a task naming `image` (a harness's sandbox_factory)."""
        if not self._opened:
            raise SandboxClosedError("the job's sandboxes are not open (await open() first)")
        if self._e2b is not None:  # maps the image to its template itself (`images`)
            sandbox: Sandbox = self._e2b(image)
            return sandbox
        assert self._fleet is not None
        return self._fleet.sandbox(image_to_run(self.section, image))

    def metrics(self) -> dict[str, Any]:
        """The fleet's metrics (empty for e2b)."""
        return self._fleet.metrics() if self._fleet is not None else {}

    async def close(self) -> None:
        if self._fleet is not None:
            await self._fleet.close()
        self._opened = False

    async def __aenter__(self) -> JobSandboxes:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


def fleet_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """A fleet's `metrics()` as W&B scalars under rollout/sandbox_ (counters since the
    fleet opened, latencies over its recent calls): starts, warm-pool hit rate, start
    retries and latency, failures by kind, breaker opens, and each host's sandboxes in
    use (its load). Empty for E2B (no fleet)."""
    if not metrics:
        return {}
    acquired = metrics["acquired"]
    out = {
        "rollout/sandbox_acquired": float(acquired),
        "rollout/sandbox_warm_hit_rate": metrics["warm_hits"] / acquired if acquired else 0.0,
        "rollout/sandbox_start_retries": float(metrics["retries"]),
        "rollout/sandbox_breaker_opens": float(metrics["breaker_opens"]),
        "rollout/sandbox_reaped": float(metrics["reaped"]),
    }
    for name, summary in (("start", metrics["creation_s"]), ("exec", metrics["exec_latency_s"])):
        for stat in ("p50", "p90", "max"):
            if stat in summary:
                out[f"rollout/sandbox_{name}_s_{stat}"] = float(summary[stat])
    for kind, count in metrics["failures_by_kind"].items():
        out[f"rollout/sandbox_failures/{kind}"] = float(count)
    for host, state in metrics["hosts"].items():
        out[f"rollout/sandbox_host_active/{host}"] = float(state["active"])
        out[f"rollout/sandbox_host_breaker_open/{host}"] = float(state["breaker"] == "open")
    return out
