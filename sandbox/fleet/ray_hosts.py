"""Sandbox hosts as Ray actors, one per node, for a fleet that spans machines.

`RayHost` is the fleet's handle on an actor that runs an `InProcessHost` on its node. The
fleet bounds every call (`Fleet._call`), so a stopped or unreachable actor costs a
deadline, never a hang; this module maps Ray's failures to the sandbox error family: the
host's own SandboxErrors come back as themselves, a dead actor is a SandboxDiedError (a
start on it is retried on another host, a command on it ends its trajectory), and a call
abandoned at its deadline is cancelled on the actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from sandbox.base import ExecResult, SandboxDiedError
from sandbox.fleet.hosts import Created, HostConfig, HostStatus
from sandbox.fleet.in_process import InProcessHost

SANDBOX_RESOURCE = "opd_sandbox_host"
"""The Ray resource a sandbox node offers; `opd launch` starts those nodes with it
(launch.plan.SANDBOX_RESOURCE, the same name)."""


class _HostActor:
    """Runs one InProcessHost in an async actor (calls run concurrently on its loop)."""

    def __init__(self, config: HostConfig, owner: str, blocking_threads: int) -> None:
        self._host = InProcessHost(config, owner)
        self._blocking_threads = blocking_threads
        self._executor: ThreadPoolExecutor | None = None

    def _ensure_executor(self) -> None:
        if self._executor is None:  # docker calls block a thread each
            self._executor = ThreadPoolExecutor(self._blocking_threads, "opd-host")
            asyncio.get_running_loop().set_default_executor(self._executor)

    async def open(self) -> HostStatus:
        self._ensure_executor()
        return await self._host.open()

    async def status(self) -> HostStatus:
        return await self._host.status()

    async def prepare(self, images: list[str | None]) -> None:
        self._ensure_executor()
        await self._host.prepare(images)

    async def create(self, image: str | None) -> Created:
        self._ensure_executor()
        return await self._host.create(image)

    async def exec(
        self,
        sandbox_id: str,
        cmd: str,
        timeout_s: float,
        cwd: str | None,
        env: dict[str, str] | None,
    ) -> ExecResult:
        return await self._host.exec(sandbox_id, cmd, timeout_s, cwd, env)

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> None:
        await self._host.write_file(sandbox_id, path, data)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self._host.read_file(sandbox_id, path)

    async def is_alive(self, sandbox_id: str) -> bool:
        return await self._host.is_alive(sandbox_id)

    async def close_sandbox(self, sandbox_id: str) -> None:
        await self._host.close_sandbox(sandbox_id)

    async def shutdown(self) -> int:
        return await self._host.shutdown()

    async def pid(self) -> int:
        return os.getpid()


class RayHost:
    """A `SandboxHost` whose sandboxes live in a Ray actor (see the module docstring)."""

    def __init__(self, actor: Any, name: str) -> None:
        self._actor = actor
        self._name = name

    @classmethod
    def spawn(
        cls,
        config: HostConfig,
        owner: str,
        *,
        node_id: str | None = None,
        num_cpus: float = 0.0,
        resources: dict[str, float] | None = None,
        blocking_threads: int = 256,
    ) -> RayHost:
        """Start the host's actor (on `node_id` when given; it is not restarted if it
        dies: its sandboxes died with it, and the fleet's breaker moves work elsewhere).
        No CPU by default: `opd launch` starts sandbox hosts with none for Ray, so that
        the job's CPU actors (slime's RolloutManager) cannot land on them."""
        options: dict[str, Any] = {
            "num_cpus": num_cpus,
            "resources": resources or {},
            "max_restarts": 0,
            "max_concurrency": 1000,
        }
        if node_id is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        actor = ray.remote(_HostActor).options(**options).remote(config, owner, blocking_threads)
        return cls(actor, config.name)

    @property
    def name(self) -> str:
        return self._name

    def kill(self) -> None:
        """End the actor now (its sandboxes' processes die or are reaped by label)."""
        ray.kill(self._actor, no_restart=True)

    async def pid(self) -> int:
        """The actor's process id (for fault injection and leak checks)."""
        pid: int = await self._remote("pid")
        return pid

    async def open(self) -> HostStatus:
        status: HostStatus = await self._remote("open")
        return status

    async def status(self) -> HostStatus:
        status: HostStatus = await self._remote("status")
        return status

    async def prepare(self, images: list[str | None]) -> None:
        await self._remote("prepare", images)

    async def create(self, image: str | None) -> Created:
        created: Created = await self._remote("create", image)
        return created

    async def exec(
        self,
        sandbox_id: str,
        cmd: str,
        timeout_s: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        result: ExecResult = await self._remote("exec", sandbox_id, cmd, timeout_s, cwd, env)
        return result

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> None:
        await self._remote("write_file", sandbox_id, path, data)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        data: bytes = await self._remote("read_file", sandbox_id, path)
        return data

    async def is_alive(self, sandbox_id: str) -> bool:
        alive: bool = await self._remote("is_alive", sandbox_id)
        return alive

    async def close_sandbox(self, sandbox_id: str) -> None:
        await self._remote("close_sandbox", sandbox_id)

    async def shutdown(self) -> int:
        reaped: int = await self._remote("shutdown")
        return reaped

    async def _remote(self, method: str, *args: Any) -> Any:
        ref = getattr(self._actor, method).remote(*args)
        try:
            return await ref
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                ray.cancel(ref)  # the fleet gave up on it: stop the command on the actor
            raise
        except RayTaskError as exc:
            if isinstance(exc.cause, Exception):
                raise exc.cause from None
            raise
        except (RayActorError, ActorUnavailableError) as exc:
            raise SandboxDiedError(f"host {self._name}: its Ray actor is gone: {exc}") from exc


@dataclass(frozen=True)
class SandboxNode:
    """An alive Ray node that offers the sandbox-host resource."""

    node_id: str
    address: str
    """Its node IP address (names its hosts)."""


def sandbox_nodes(resource: str = SANDBOX_RESOURCE) -> list[SandboxNode]:
    """The alive nodes offering `resource` (this process must be connected to Ray)."""
    return [
        SandboxNode(node["NodeID"], node.get("NodeManagerAddress", node["NodeID"]))
        for node in ray.nodes()
        if node.get("Alive") and node.get("Resources", {}).get(resource, 0) > 0
    ]


def spawn_per_node(
    configs_for: Callable[[SandboxNode], Sequence[HostConfig]],
    owner: str,
    resource: str = SANDBOX_RESOURCE,
    num_cpus: float = 0.0,
) -> list[RayHost]:
    """Host actors pinned to every alive node that offers `resource`: one per setting
    `configs_for(node)` gives (names must differ across the fleet)."""
    return [
        RayHost.spawn(
            config,
            owner,
            node_id=node.node_id,
            num_cpus=num_cpus,
            resources={resource: 0.01},
        )
        for node in sandbox_nodes(resource)
        for config in configs_for(node)
    ]
