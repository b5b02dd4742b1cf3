"""Fleet: placement, retries of starts only, deadlines, circuit breakers, warm pools,
images, reaping and metrics; then faults injected with real processes and containers,
and the Ray path (two host actors on a local Ray cluster, one killed mid-run).

The rules are pinned against `ScriptedHost`, an in-memory host whose failures are
scripted; everything after it runs real sandboxes: local ones (own uids, so leftovers are
found by uid) and containers (found by label). Docker tests skip when no daemon answers.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from sandbox import (
    DockerSandboxConfig,
    ExecResult,
    LocalSandboxConfig,
    Sandbox,
    SandboxClosedError,
    SandboxDiedError,
    SandboxError,
    SandboxResourceError,
    SandboxStartError,
    SandboxUnavailableError,
    leases,
)
from sandbox.docker import OWNER_LABEL
from sandbox.fleet import (
    HOST_LABEL,
    SANDBOX_ID_LABEL,
    CircuitBreaker,
    Created,
    Fleet,
    FleetConfig,
    FleetDeadlineError,
    HostConfig,
    HostStatus,
    ImageBuild,
    InProcessHost,
    SandboxHost,
    reap_local,
)
from tests.docker_images import BASE_IMAGE, daemon_problem, sandbox_test_image

T = TypeVar("T")
UID_BASE = 305_000
UID_COUNT = 300
SLACK_S = 2.0
HELD_BACK = 50
"""The 200-trajectory fault test's trajectories asked only after the host actor is killed."""
"""How far past its deadline a call may return on a loaded 2-core machine."""

needs_docker = pytest.mark.skipif(daemon_problem() is not None, reason=f"{daemon_problem()}")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids need root")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def owner() -> str:
    return f"pytest-fleet-{os.getpid()}-{secrets.token_hex(3)}"


@pytest.fixture(scope="module")
def root_dir() -> Iterator[Path]:
    root = Path(tempfile.gettempdir()) / f"opd-fleet-test-{os.getpid()}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def local_config(root_dir: Path, **fields: Any) -> LocalSandboxConfig:
    return LocalSandboxConfig(root_dir=root_dir, uid_base=UID_BASE, uid_count=UID_COUNT, **fields)


def sandbox_uid_processes() -> list[int]:
    """Live processes (not zombies) running as one of this module's sandbox uids."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid = int(fields["Uid"].split()[0])
        if UID_BASE <= uid < UID_BASE + UID_COUNT and not fields["State"].strip().startswith("Z"):
            found.append(int(entry.name))
    return found


def docker_cli(*args: str) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def leftovers(run_owner: str) -> tuple[str, str]:
    """Containers and volumes carrying the owner's label, as the docker CLI lists them."""
    label = f"label={OWNER_LABEL}={run_owner}"
    return docker_cli("ps", "-aq", "--filter", label), docker_cli(
        "volume", "ls", "-q", "--filter", label
    )


def pid_gone(pid: int, wait_s: float = 10.0) -> bool:
    """Whether process `pid` has exited (or is a zombie) within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return True
        if "State:\tZ" in state:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


async def until_gone(pid: int, wait_s: float = 10.0) -> None:
    """Wait (without blocking the loop) until process `pid` has exited."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not pid_gone(pid, wait_s=0):
        await asyncio.sleep(0.01)


@pytest.fixture(scope="session")
def image() -> str:
    return sandbox_test_image()


# -- the rules, against a scripted host ------------------------------------------------------


class ScriptedHost:
    """A host in memory: starts fail as scripted, calls can hang, every call is recorded."""

    def __init__(
        self,
        name: str,
        *,
        cap: int = 4,
        backend: str = "docker",
        images: tuple[str, ...] = (),
        warm: dict[str, int] | None = None,
        start_failures: list[SandboxError] | None = None,
        start_delay_s: float = 0.0,
        exec_failure: SandboxError | None = None,
        exec_hang_s: float = 0.0,
        exec_result: ExecResult | None = None,
    ) -> None:
        self.name = name
        self.cap, self.backend, self.images = cap, backend, list(images)
        self.warm = dict(warm or {})
        self.start_failures = list(start_failures or [])
        self.start_delay_s = start_delay_s
        self.exec_failure = exec_failure
        self.exec_hang_s = exec_hang_s
        self.exec_result = exec_result
        self.calls: list[str] = []
        self.live: set[str] = set()
        self.closed: list[str] = []

    async def open(self) -> HostStatus:
        return await self.status()

    async def status(self) -> HostStatus:
        return HostStatus(
            name=self.name,
            backend=self.backend,  # type: ignore[arg-type]
            default_image="default-image" if self.backend == "docker" else None,
            max_sandboxes=self.cap,
            handed_out=len(self.live),
            warm=self.warm,
            images=self.images,
            counters={},
        )

    async def prepare(self, images: list[str | None]) -> None:
        self.calls.append("prepare")

    async def create(self, image: str | None) -> Created:
        self.calls.append("create")
        if self.start_delay_s:
            await asyncio.sleep(self.start_delay_s)
        if self.start_failures:
            raise self.start_failures.pop(0)
        key = image or "default-image"
        warm = self.warm.get(key, 0) > 0
        if warm:
            self.warm[key] -= 1
        sandbox_id = f"{self.name}-{len(self.calls)}"
        self.live.add(sandbox_id)
        return Created(sandbox_id=sandbox_id, image=key, warm=warm)

    async def exec(
        self,
        sandbox_id: str,
        cmd: str,
        timeout_s: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        self.calls.append(f"exec {cmd}")
        if self.exec_hang_s:
            # Like a thread blocked on a hung daemon: ignores the first cancellation.
            try:
                await asyncio.sleep(self.exec_hang_s)
            except asyncio.CancelledError:
                await asyncio.sleep(self.exec_hang_s)
        if self.exec_failure is not None:
            raise self.exec_failure
        return self.exec_result or ExecResult(exit_code=0, stdout=cmd, duration_s=0.0)

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> None:
        self.calls.append("write")

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        self.calls.append("read")
        return b""

    async def is_alive(self, sandbox_id: str) -> bool:
        self.calls.append("is_alive")
        return sandbox_id in self.live

    async def close_sandbox(self, sandbox_id: str) -> None:
        self.calls.append("close")
        self.live.discard(sandbox_id)
        self.closed.append(sandbox_id)

    async def shutdown(self) -> int:
        self.calls.append("shutdown")
        return 0


def fleet_config(**fields: Any) -> FleetConfig:
    defaults: dict[str, Any] = {
        "owner": owner(),
        "backoff_s": 0.05,
        "breaker_cooldown_s": 30.0,
        "acquire_timeout_s": 5.0,
        "start_deadline_s": 2.0,
        "exec_margin_s": 1.0,
        "call_deadline_s": 2.0,
        "blocking_threads": None,
    }
    return FleetConfig(**{**defaults, **fields})


def test_a_failed_start_is_retried_on_another_host_after_a_backoff() -> None:
    broken = ScriptedHost("broken", images=("img",), start_failures=[SandboxStartError("x")])
    spare = ScriptedHost("spare")

    async def main() -> tuple[Any, float, dict[str, Any]]:
        async with Fleet([broken, spare], fleet_config(backoff_s=0.2)) as fleet:
            started = time.monotonic()
            sandbox = await fleet.acquire("img")  # "broken" holds the image: placed first
            took = time.monotonic() - started
            await sandbox.close()
            return sandbox, took, fleet.metrics()

    sandbox, took, metrics = run(main())
    assert (sandbox.host_name, sandbox.start_attempts) == ("spare", 2)
    assert broken.calls.count("create") == 1 and spare.calls.count("create") == 1
    assert took >= 0.1  # the backoff: 0.2 s times a jitter of 0.5-1
    assert metrics["retries"] == 1
    assert metrics["failures_by_kind"] == {"SandboxStartError": 1}


def test_when_every_start_fails_the_last_error_is_raised_with_all_attempts() -> None:
    failures: list[SandboxError] = [
        SandboxResourceError("uids exhausted"),
        SandboxUnavailableError("no bwrap"),
        SandboxDiedError("daemon gone"),
    ]
    host = ScriptedHost("only", start_failures=failures)

    async def main() -> None:
        async with Fleet([host], fleet_config(start_attempts=3)) as fleet:
            await fleet.acquire()

    with pytest.raises(SandboxDiedError) as raised:
        run(main())
    assert "3 attempts" in str(raised.value)
    assert "uids exhausted" in str(raised.value) and "daemon gone" in str(raised.value)
    assert host.calls.count("create") == 3


def test_a_command_that_failed_in_the_sandbox_is_raised_and_never_run_again() -> None:
    host = ScriptedHost("h", exec_failure=SandboxDiedError("the container stopped"))

    async def main() -> None:
        async with Fleet([host], fleet_config()) as fleet:
            sandbox = await fleet.acquire()
            with pytest.raises(SandboxDiedError, match="the container stopped"):
                await sandbox.exec("rm -rf build", 5)
            with pytest.raises(SandboxDiedError, match="failed earlier"):
                await sandbox.exec("rm -rf build", 5)
            assert not await sandbox.is_alive()
            await sandbox.close()

    run(main())
    assert host.calls.count("exec rm -rf build") == 1
    assert "close" in host.calls


def test_a_command_that_failed_on_its_own_is_a_result_not_a_host_failure() -> None:
    failed = ExecResult(exit_code=137, timed_out=True, limit_hit="wall_time", duration_s=1.0)
    host = ScriptedHost("h", exec_result=failed)

    async def main() -> dict[str, Any]:
        async with Fleet([host], fleet_config(breaker_failures=1)) as fleet:
            sandbox = await fleet.acquire()
            for _ in range(3):
                assert (await sandbox.exec("sleep 99", 1)).timed_out
            await sandbox.close()
            return fleet.metrics()

    metrics = run(main())
    assert metrics["failures_by_kind"] == {}
    assert metrics["hosts"]["h"]["breaker"] == "closed"
    assert metrics["exec_latency_s"]["count"] == 3


def test_a_call_past_its_deadline_returns_at_the_deadline_and_the_sandbox_is_dropped() -> None:
    host = ScriptedHost("h", exec_hang_s=3.0)

    async def main() -> float:
        async with Fleet([host], fleet_config(exec_margin_s=0.3)) as fleet:
            sandbox = await fleet.acquire()
            started = time.monotonic()
            with pytest.raises(FleetDeadlineError, match="effects are unknown"):
                await sandbox.exec("make", 0.2)
            took = time.monotonic() - started
            with pytest.raises(SandboxDiedError, match="failed earlier"):
                await sandbox.exec("make", 0.2)
            await sandbox.close()
            return took

    took = run(main())
    assert 0.5 <= took < 0.5 + SLACK_S
    assert host.calls.count("exec make") == 1


def test_a_start_that_finishes_after_its_deadline_is_closed() -> None:
    host = ScriptedHost("slow", images=("default-image",), start_delay_s=0.6)

    async def main() -> dict[str, Any]:
        config = fleet_config(start_deadline_s=0.2, start_attempts=1)
        async with Fleet([host], config) as fleet:
            with pytest.raises(FleetDeadlineError):
                await fleet.acquire()
            await asyncio.sleep(0.8)
            return fleet.metrics()

    metrics = run(main())
    assert metrics["late_starts_closed"] == 1
    assert host.live == set() and len(host.closed) == 1


def test_a_breaker_opens_after_failures_in_a_row_and_a_probe_closes_it() -> None:
    # Its warm pool keeps "flaky" first in line while its starts fail.
    failures: list[SandboxError] = [SandboxStartError("x")] * 3
    flaky = ScriptedHost("flaky", images=("img",), warm={"img": 9}, start_failures=failures)
    steady = ScriptedHost("steady")

    async def main() -> list[str]:
        config = fleet_config(breaker_failures=3, breaker_cooldown_s=0.5)
        states = []
        async with Fleet([flaky, steady], config) as fleet:
            for _ in range(4):  # three failures on flaky (each retried on steady), then none
                await (await fleet.acquire("img")).close()
            states.append(fleet.metrics()["hosts"]["flaky"]["breaker"])
            await asyncio.sleep(0.6)
            probe = await fleet.acquire("img")  # flaky recovered: the probe succeeds
            states.append(probe.host_name)
            states.append(fleet.metrics()["hosts"]["flaky"]["breaker"])
            await probe.close()
        return states

    assert run(main()) == ["open", "flaky", "closed"]
    assert flaky.calls.count("create") == 4  # the fourth acquire skipped it


def test_breaker_states_closed_open_half_open_and_back() -> None:
    breaker = CircuitBreaker(failures_to_open=2, cooldown_s=10.0)
    breaker.failed(now=0.0)
    breaker.succeeded()  # failures count only in a row
    breaker.failed(now=1.0)
    assert breaker.state == "closed" and breaker.accepts(now=1.0)
    breaker.failed(now=2.0)
    assert breaker.state == "open" and not breaker.accepts(now=11.9)
    assert breaker.accepts(now=12.0)
    breaker.placed()  # the probe
    assert breaker.state == "half_open" and not breaker.accepts(now=12.0)
    breaker.undecided()  # its caller gave up: another probe may go
    assert breaker.accepts(now=12.0)
    breaker.placed()
    breaker.failed(now=13.0)  # a failed probe opens it for a whole cooldown again
    assert breaker.state == "open" and not breaker.accepts(now=22.9)
    breaker.placed()
    breaker.succeeded()
    assert breaker.state == "closed" and breaker.opens == 2


def test_a_probe_whose_caller_gave_up_does_not_keep_the_host_shut() -> None:
    failures: list[SandboxError] = [SandboxStartError("x")] * 3
    host = ScriptedHost("h", images=("default-image",), start_failures=failures)

    async def main() -> str | None:
        config = fleet_config(breaker_failures=3, breaker_cooldown_s=0.2, start_attempts=3)
        async with Fleet([host], config) as fleet:
            with pytest.raises(SandboxStartError):
                await fleet.acquire()  # three failures: the breaker opens
            await asyncio.sleep(0.3)
            host.start_delay_s = 5.0
            probe = asyncio.create_task(fleet.acquire())
            await asyncio.sleep(0.2)
            probe.cancel()  # e.g. the trajectory's own deadline
            host.start_delay_s = 0.0
            sandbox = await asyncio.wait_for(fleet.acquire(), 2.0)  # not after the late start
            await sandbox.close()
            return sandbox.host_name

    assert run(main()) == "h"


def test_placement_prefers_a_warm_sandbox_then_the_image_then_a_lighter_load() -> None:
    warm = ScriptedHost("warm", images=("img",), warm={"img": 1})
    holder = ScriptedHost("holder", images=("img",))
    bare = ScriptedHost("bare")

    async def main() -> list[tuple[str | None, bool]]:
        async with Fleet([warm, holder, bare], fleet_config()) as fleet:
            first = await fleet.acquire("img")
            second = await fleet.acquire("img")  # no warm one left; both hold it; lighter
            third = await fleet.acquire("img")
            return [(s.host_name, s.warm) for s in (first, second, third)]

    placed = run(main())
    assert placed[0] == ("warm", True)
    assert placed[1] == ("holder", False)
    assert {host for host, _ in placed[1:]} <= {"warm", "holder"}


def test_acquire_waits_for_a_free_slot_then_gives_up_at_its_timeout() -> None:
    host = ScriptedHost("small", cap=1)

    async def main() -> float:
        async with Fleet([host], fleet_config(acquire_timeout_s=0.5)) as fleet:
            first = await fleet.acquire()
            waiting = asyncio.create_task(fleet.acquire())
            await asyncio.sleep(0.2)
            assert not waiting.done()
            await first.close()
            second = await asyncio.wait_for(waiting, 1.0)
            started = time.monotonic()
            with pytest.raises(SandboxResourceError, match="cap"):
                await fleet.acquire()
            await second.close()
            return time.monotonic() - started

    assert 0.4 <= run(main()) < 0.5 + SLACK_S


def test_an_image_no_host_can_run_is_refused_at_once() -> None:
    async def main() -> None:
        async with Fleet([ScriptedHost("l", backend="local")], fleet_config()) as fleet:
            with pytest.raises(SandboxUnavailableError, match="can run image"):
                await fleet.acquire("python:3.12")

    run(main())


def test_a_fleet_sandbox_is_a_sandbox_and_refuses_use_after_close() -> None:
    async def main() -> None:
        async with Fleet([ScriptedHost("h")], fleet_config()) as fleet:
            sandbox = await fleet.acquire()
            assert isinstance(sandbox, Sandbox)
            await sandbox.close()
            await sandbox.close()
            with pytest.raises(SandboxClosedError):
                await sandbox.exec("true", 1)

    run(main())


def test_a_sandbox_from_the_factory_is_placed_when_started() -> None:
    host = ScriptedHost("h")

    async def main() -> None:
        async with Fleet([host], fleet_config()) as fleet:
            never_used = fleet.sandbox()  # a harness's sandbox_factory
            await never_used.close()
            lazy = fleet.sandbox()
            assert host.calls == [] and lazy.host_name is None
            assert (await lazy.exec("echo hi", 5)).stdout == "echo hi"  # starts it first
            await lazy.start()  # idempotent
            assert lazy.host_name == "h" and host.calls == ["create", "exec echo hi"]
            await lazy.close()

    run(main())


# -- real local sandboxes ----------------------------------------------------------------


def test_local_host_runs_commands_files_and_a_warm_pool(root_dir: Path) -> None:
    config = HostConfig(
        name="local", local=local_config(root_dir), max_sandboxes=4, warm_per_image=2
    )

    async def main() -> dict[str, Any]:
        fleet_cfg = fleet_config()
        async with Fleet([InProcessHost(config, fleet_cfg.owner)], fleet_cfg) as fleet:
            await fleet.prefetch([None])
            assert fleet.metrics()["hosts"]["local"]["warm"] == {"local": 2}
            async with await fleet.acquire() as sandbox:
                assert sandbox.warm
                assert (await sandbox.exec("echo $((6 * 7))", 5)).stdout == "42\n"
                await sandbox.write_file("notes/a.txt", b"hello")
                assert await sandbox.read_file("notes/a.txt") == b"hello"
            await fleet.refresh()
            return fleet.metrics()

    metrics = run(main())
    assert metrics["warm_hits"] == 1
    assert metrics["starts"] >= 3  # two warm, then the refill
    assert sandbox_uid_processes() == []  # (without root sandboxes have no uids of their own)


@needs_root
def test_reap_local_kills_and_removes_what_a_killed_process_left(root_dir: Path) -> None:
    config = local_config(root_dir, isolation="basic")
    holder = textwrap.dedent(
        f"""
        import asyncio, sys
        from pathlib import Path
        from sandbox import LocalSandbox, LocalSandboxConfig
        async def main():
            config = LocalSandboxConfig.model_validate_json({config.model_dump_json()!r})
            sandbox = LocalSandbox(config)
            await sandbox.start()
            await sandbox.exec("sleep 300 >/dev/null 2>&1 &", 5)
            print(sandbox.workdir, flush=True)
            await asyncio.sleep(300)
        asyncio.run(main())
        """
    )
    process = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        workdir = Path(process.stdout.readline().strip())
    finally:
        process.kill()
        process.wait()
    assert workdir.is_dir() and sandbox_uid_processes() != []  # control: a real leftover

    assert run(reap_local(config)) == 1
    assert sandbox_uid_processes() == []
    assert not workdir.exists()


def _deep_tree(top: Path, depth: int) -> None:
    """`top`/d/d/.../d/leaf, `depth` levels: a path far longer than PATH_MAX."""
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    finally:
        os.close(fd)


@needs_root
def test_reap_local_removes_a_leftover_tree_5000_levels_deep(root_dir: Path) -> None:
    uid = UID_BASE + UID_COUNT - 1  # a range of its own: other sandboxes' uids are not reaped
    config = local_config(root_dir, isolation="basic").model_copy(
        update={"uid_base": uid, "uid_count": 1}
    )
    leases.prepare_root(root_dir)
    workdir = root_dir / f"work-{uid}"
    _deep_tree(workdir, 5000)
    assert run(reap_local(config)) == 1
    assert not workdir.exists()


# -- real containers -------------------------------------------------------------------------


def docker_host(name: str, image: str, **fields: Any) -> HostConfig:
    sandbox = DockerSandboxConfig(
        image=image, api_timeout_s=8, memory_mb=256, workdir_size_mb=16, tmp_size_mb=16
    )
    return HostConfig(name=name, backend="docker", docker=sandbox, **fields)


@needs_docker
@pytest.mark.timeout(180)
def test_warm_containers_are_checked_alive_before_hand_out(image: str) -> None:
    config = docker_host("warm", image, max_sandboxes=4, warm_per_image=2)
    fleet_cfg = fleet_config(start_deadline_s=30, call_deadline_s=30, exec_margin_s=10)

    async def main() -> tuple[bool, bool, dict[str, Any]]:
        async with Fleet([InProcessHost(config, fleet_cfg.owner)], fleet_cfg) as fleet:
            await fleet.prefetch([None])
            warm_ids = docker_cli("ps", "-q", "--filter", f"label={HOST_LABEL}=warm").split()
            assert len(warm_ids) == 2
            docker_cli("kill", *warm_ids)  # both warm containers die before anyone asks
            async with await fleet.acquire() as cold:
                assert (await cold.exec("echo fine", 10)).stdout == "fine\n"
            await fleet.prefetch([None])
            async with await fleet.acquire() as warm:
                assert (await warm.exec("echo fine", 10)).stdout == "fine\n"
            await fleet.refresh()
            return cold.warm, warm.warm, fleet.metrics()

    cold_was_warm, warm_was_warm, metrics = run(main())
    assert (cold_was_warm, warm_was_warm) == (False, True)
    assert metrics["warm_dead"] == 2
    assert leftovers(fleet_cfg.owner) == ("", "")


@needs_docker
@pytest.mark.timeout(180)
def test_images_are_built_ahead_of_need_and_collected_by_last_use(
    image: str, tmp_path: Path
) -> None:
    (tmp_path / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nARG WHICH\nLABEL opd.test=$WHICH\n")
    tags = [f"opd-fleet-test-{which}:{os.getpid()}" for which in ("a", "b")]
    builds = {
        tag: ImageBuild(context=tmp_path, buildargs={"WHICH": tag.split(":")[0]}) for tag in tags
    }
    # One image fits the budget, two do not (the base is about 130 MB).
    config = docker_host("builder", image, builds=builds, image_disk_budget_gb=0.2)
    fleet_cfg = fleet_config(start_deadline_s=60, pull_deadline_s=120, call_deadline_s=30)

    def present() -> set[str]:
        return {tag for tag in tags if docker_cli("images", "-q", tag)}

    async def main() -> tuple[list[set[str]], dict[str, Any]]:
        seen = []
        async with Fleet([InProcessHost(config, fleet_cfg.owner)], fleet_cfg) as fleet:
            await fleet.prefetch([tags[0]])
            seen.append(present())
            await fleet.prefetch([tags[1]])  # over budget: a, least recently used, goes
            seen.append(present())
            async with await fleet.acquire(tags[0]) as sandbox:  # built again at need
                assert (await sandbox.exec("echo in-a", 10)).stdout == "in-a\n"
                seen.append(present())
            await fleet.refresh()
            return seen, fleet.metrics()

    try:
        seen, metrics = run(main())
    finally:
        for tag in tags:
            subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=60)
    assert seen == [{tags[0]}, {tags[1]}, {tags[0]}]
    assert (metrics["image_builds"], metrics["images_removed"]) == (3, 2)
    assert leftovers(fleet_cfg.owner) == ("", "")


@needs_docker
@pytest.mark.timeout(180)
def test_opening_a_host_reaps_the_containers_a_killed_run_left(image: str) -> None:
    run_owner = owner()
    config = docker_host("reaped", image, max_sandboxes=4)
    crashed_run = textwrap.dedent(
        f"""
        import asyncio
        from sandbox.fleet import Fleet, FleetConfig, HostConfig, InProcessHost
        async def main():
            config = HostConfig.model_validate_json({config.model_dump_json()!r})
            fleet = Fleet([InProcessHost(config, {run_owner!r})], FleetConfig(owner={run_owner!r}))
            await fleet.open()
            held = [await fleet.acquire() for _ in range(2)]
            print("ready", flush=True)
            await asyncio.sleep(300)
        asyncio.run(main())
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", crashed_run], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
    finally:
        process.kill()  # a crash: nothing is closed
        process.wait()
    assert len(leftovers(run_owner)[0].split()) == 2  # control: the crash left them

    async def main() -> dict[str, Any]:
        fleet_cfg = fleet_config(owner=run_owner, call_deadline_s=30)
        async with Fleet([InProcessHost(config, run_owner)], fleet_cfg) as fleet:
            return fleet.metrics()

    assert run(main())["reaped"] == 2
    assert leftovers(run_owner) == ("", "")


# -- fault injection: 200 trajectories, real containers and processes ------------------------

RELAY = """
import asyncio, os, sys
listen, upstream = sys.argv[1], sys.argv[2]  # argv[3]: a marker for leak checks

async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except Exception:
        writer.close()

async def serve(client_reader, client_writer):
    try:
        reader, writer = await asyncio.open_unix_connection(upstream)
    except OSError:
        client_writer.close()
        return
    await asyncio.gather(pipe(client_reader, writer), pipe(reader, client_writer))
    writer.close()
    client_writer.close()

async def main():
    server = await asyncio.start_unix_server(serve, listen)
    print("listening", flush=True)
    await server.serve_forever()

asyncio.run(main())
"""


class Relay:
    """A real process between a host and the Docker daemon: stopping it (SIGSTOP) is a
    hung daemon; killing it leaves a socket that refuses, a stopped daemon."""

    def __init__(self, path: Path, marker: str) -> None:
        self.path, self.marker = path, marker
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.path.unlink(missing_ok=True)
        argv = [sys.executable, "-c", RELAY, str(self.path), "/var/run/docker.sock", self.marker]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "listening"

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@dataclass
class Call:
    op: str
    elapsed_s: float
    deadline_s: float
    hit: bool


@dataclass
class Record:
    index: int
    status: str = ""
    reason: str = ""
    host: str = ""
    asked_at: float = 0.0
    """When it asked the fleet for a sandbox."""
    calls: list[Call] = field(default_factory=list)


def signal_processes(marker: str, signum: int) -> int:
    """Send `signum` to every process whose command line holds `marker`."""
    hits = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in Path(entry.path, "cmdline").read_bytes():
                os.kill(int(entry.name), signum)
                hits += 1
        except (FileNotFoundError, ProcessLookupError):
            continue
    return hits


async def docker_async(*args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        "docker", *args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    out, _ = await process.communicate()
    return out.decode().strip()


async def inject(fault: str | None, sandbox: Any, marker: str) -> None:
    """One targeted fault while the command runs (once its marker shows in a process's
    command line: a pause that lands while runc is still starting the exec can wedge the
    daemon on that container, a race of runc's with the cgroup-v1 freezer): on the
    sandbox's container, or on the processes of the command."""
    if fault is None:
        return
    for _ in range(60):
        if signal_processes(marker, 0):
            break
        await asyncio.sleep(0.05)
    else:
        return
    await asyncio.sleep(0.1)
    if fault in ("docker_kill", "docker_pause"):
        label = f"label={SANDBOX_ID_LABEL}={sandbox.sandbox_id}"
        container = await docker_async("ps", "-q", "--filter", label)
        if container:
            await docker_async("kill" if fault == "docker_kill" else "pause", container)
    else:
        signal_processes(marker, signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)


async def fault_run(image: str, root_dir: Path, tmp_path: Path) -> dict[str, Any]:
    from sandbox.fleet.ray_hosts import RayHost

    run_owner = owner()
    token = secrets.token_hex(4)
    relay = Relay(tmp_path / "relay.sock", f"opd-relay-{token}")
    relay.start()
    stopped = tmp_path / "stopped.sock"
    with socket.socket(socket.AF_UNIX) as gone:  # a socket file whose daemon is gone
        gone.bind(str(stopped))
    local = local_config(root_dir)
    exec_timeout_s = 3.0
    cfg = FleetConfig(
        owner=run_owner,
        start_attempts=4,
        backoff_s=0.05,
        backoff_max_s=0.5,
        acquire_timeout_s=60,
        start_deadline_s=15,
        pull_deadline_s=15,
        exec_margin_s=3,
        call_deadline_s=6,
        shutdown_deadline_s=30,
        breaker_failures=3,
        breaker_cooldown_s=2,
        status_interval_s=2,
    )

    def via(name: str, url: str | None, cap: int) -> HostConfig:
        config = docker_host(name, image, max_sandboxes=cap)
        return config.model_copy(
            update={"docker": config.docker.model_copy(update={"docker_url": url})}
        )

    ray_host = RayHost.spawn(HostConfig(name="ray-d", local=local, max_sandboxes=6), run_owner)
    hosts: list[SandboxHost] = [
        InProcessHost(via("docker-a", None, 6), run_owner),
        InProcessHost(via("docker-relay", f"unix://{relay.path}", 4), run_owner),
        InProcessHost(via("docker-stopped", f"unix://{stopped}", 4), run_owner),
        InProcessHost(HostConfig(name="local-e", local=local, max_sandboxes=6), run_owner),
        ray_host,
    ]
    actor_pid = await asyncio.wait_for(ray_host.pid(), 60)
    fleet = Fleet(hosts, cfg)
    records: list[Record] = []
    events: dict[str, float] = {}
    done = 0
    running: Counter[str] = Counter()
    """Commands in flight per host."""
    actor_dead = asyncio.Event()
    """Set once the host actor is killed: the last HELD_BACK trajectories start then, so the
    work after the kill is a fixed amount, whatever the faults before it drained."""
    started = time.monotonic()

    async def timed(record: Record, op: str, call: Any, deadline_s: float, hit: bool) -> Any:
        began = time.monotonic()
        try:
            result = await call
        except SandboxError:
            record.calls.append(Call(op, time.monotonic() - began, deadline_s, True))
            raise
        record.calls.append(Call(op, time.monotonic() - began, deadline_s, hit))
        return result

    async def trajectory(index: int, gate: asyncio.Semaphore) -> Record:
        nonlocal done
        record = Record(index)
        rng = random.Random(index)
        sandbox = None
        if index >= 200 - HELD_BACK:  # asked only once the actor is dead
            await actor_dead.wait()
        async with gate:
            try:
                record.asked_at = time.monotonic()
                sandbox = await timed(
                    record, "acquire", fleet.acquire(), cfg.acquire_timeout_s, False
                )
                record.host = sandbox.host_name or ""
                if sandbox.start_attempts > 1:
                    record.calls[-1].hit = True
                for step in range(3):
                    marker = f"opd-fault-{token}-{index}-{step}"
                    fault = None
                    if sandbox.host_name == "docker-a" and rng.random() < 0.4:
                        fault = rng.choice(["docker_kill", "docker_pause"])
                    elif sandbox.host_name == "local-e" and rng.random() < 0.4:
                        fault = rng.choice(["sigstop", "sigkill"])
                    pause = "sleep 0.2; " if step == 1 else ""
                    command = f"echo {marker} >/dev/null; {pause}echo $(({index} * {step}))"
                    if fault:
                        command = f"echo {marker} >/dev/null; sleep 1.5; echo $(({index} * {step}))"
                    deadline_s = exec_timeout_s + cfg.exec_margin_s
                    injector = asyncio.create_task(inject(fault, sandbox, marker))
                    running[sandbox.host_name] += 1
                    try:
                        call = sandbox.exec(command, exec_timeout_s)
                        result = await timed(record, "exec", call, deadline_s, fault is not None)
                    finally:
                        running[sandbox.host_name] -= 1
                        await injector
                    if fault is None:  # an untouched command gives exactly its output
                        assert result.stdout == f"{index * step}\n", (
                            f"trajectory {index} step {step}, sandbox {sandbox.sandbox_id} on "
                            f"{sandbox.host_name} ({running[sandbox.host_name]} commands in "
                            f"flight there): exit {result.exit_code}, stdout {result.stdout!r} "
                            f"({result.stdout_bytes} bytes), stderr {result.stderr!r}, "
                            f"timed_out {result.timed_out}, limit {result.limit_hit}, "
                            f"{result.duration_s:.3f} s; calls so far {record.calls}"
                        )
                record.status, record.reason = "completed", "3 commands ran"
            except SandboxError as exc:
                record.status, record.reason = "sandbox_error", f"{type(exc).__name__}: {exc}"
            finally:
                if sandbox is not None:
                    await timed(record, "close", sandbox.close(), cfg.call_deadline_s, False)
        done += 1
        return record

    async def chaos() -> None:
        """Host-level faults, timed by progress so each lands while work is in flight."""

        async def reached(count: int) -> None:
            while done < count:
                await asyncio.sleep(0.05)

        await reached(25)
        relay.signal(signal.SIGSTOP)  # the daemon hangs
        events["relay_stopped"] = time.monotonic()
        await asyncio.sleep(7)
        relay.kill()  # the daemon is gone: its socket refuses
        await reached(60)
        os.kill(actor_pid, signal.SIGSTOP)  # the host actor hangs
        events["actor_stopped"] = time.monotonic()
        await asyncio.sleep(7)
        os.kill(actor_pid, signal.SIGCONT)
        await reached(110)
        # kill it while it runs a command (under load its breaker may still be open from
        # the hang: then none runs there for a while)
        for _ in range(4000):
            if running["ray-d"] > 0:
                events["killed_mid_command"] = 1.0
                break
            await asyncio.sleep(0.005)
        os.kill(actor_pid, signal.SIGKILL)  # the host actor dies
        await until_gone(actor_pid)
        events["actor_killed"] = time.monotonic()
        actor_dead.set()
        await reached(130)
        relay.start()  # the daemon is back

    async def chaos_then_release() -> None:
        try:
            await chaos()
        finally:  # a chaos step that failed must not leave the held-back work waiting
            actor_dead.set()

    try:
        await fleet.open()
        gate = asyncio.Semaphore(20)
        chaos_task = asyncio.create_task(chaos_then_release())
        records = await asyncio.gather(*(trajectory(i, gate) for i in range(200)))
        await asyncio.wait_for(chaos_task, 30)
        run_s = time.monotonic() - started
        await fleet.close()
        metrics = fleet.metrics()
    finally:
        await fleet.close()
        for host in hosts:
            if isinstance(host, RayHost):
                host.kill()
        relay.kill()
    return {
        "records": records,
        "metrics": metrics,
        "events": events,
        "owner": run_owner,
        "actor_pid": actor_pid,
        "relay_marker": relay.marker,
        "run_s": run_s,
    }


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    from sandbox.fleet.ray_hosts import SANDBOX_RESOURCE

    ray.init(
        num_cpus=2,
        resources={SANDBOX_RESOURCE: 1},  # this node is a sandbox node
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()


@needs_docker
@needs_root
@pytest.mark.timeout(300)
def test_200_trajectories_under_injected_faults_end_recorded_in_time_and_leave_nothing(
    image: str, root_dir: Path, tmp_path: Path, ray_cluster: None
) -> None:
    outcome = run(fault_run(image, root_dir, tmp_path))
    records: list[Record] = outcome["records"]
    metrics = outcome["metrics"]
    events = outcome["events"]
    calls = [call for record in records for call in record.calls]
    hit_fraction = sum(call.hit for call in calls) / len(calls)
    errors = [r for r in records if r.status == "sandbox_error"]
    per_host = {
        host: (
            sum(r.status == "completed" for r in records if r.host == host),
            sum(r.status == "sandbox_error" for r in records if r.host == host),
        )
        for host in sorted({r.host for r in records})
    }
    print(
        f"\n{len(records)} trajectories in {outcome['run_s']:.1f} s: "
        f"{len(records) - len(errors)} completed, {len(errors)} sandbox_error; "
        f"{len(calls)} calls, {hit_fraction:.0%} hit; failures {metrics['failures_by_kind']}; "
        f"per host (completed, sandbox_error): {per_host}"
    )

    # Every trajectory ends with a status and a reason that says what happened.
    assert len(records) == 200
    assert {r.status for r in records} <= {"completed", "sandbox_error"}
    assert all(r.reason for r in records)
    assert all(r.reason.split(":")[0].endswith("Error") for r in errors)
    # 10-30% of the calls were hit, and none blocked past its deadline.
    assert 0.10 <= hit_fraction <= 0.30
    late = [(r.index, c) for r in records for c in r.calls if c.elapsed_s > c.deadline_s + SLACK_S]
    assert late == []
    # Each fault showed up as what it is.
    assert metrics["failures_by_kind"].get("FleetDeadlineError", 0) > 0  # hung daemon, actor
    if events.get("killed_mid_command"):  # the command it ran says so
        assert any("Ray actor is gone" in r.reason for r in errors)  # killed actor
    assert any("container" in r.reason for r in errors)  # docker kill / pause
    assert metrics["hosts"]["docker-stopped"]["breaker_opens"] >= 1
    assert metrics["hosts"]["docker-relay"]["breaker_opens"] >= 1
    assert metrics["hosts"]["ray-d"]["breaker_opens"] >= 1
    assert not any(r.host == "docker-stopped" for r in records)
    # Work went on after the actor died, elsewhere.
    after = [r for r in records if r.asked_at > events["actor_killed"]]
    assert after and all(r.host != "ray-d" for r in after)
    assert len(after) >= HELD_BACK
    # about a fifth of them complete on the faulty hosts, all on the relay once it is back
    assert sum(r.status == "completed" for r in after) >= 3
    assert metrics["creation_s"]["count"] == sum(1 for r in records if r.host)
    assert metrics["exec_latency_s"]["count"] > 300
    # Nothing of ours is left: containers and volumes by label, processes by uid and pid.
    assert leftovers(outcome["owner"]) == ("", "")
    assert sandbox_uid_processes() == []
    assert pid_gone(outcome["actor_pid"])
    assert signal_processes(outcome["relay_marker"], 0) == 0


# -- the Ray path ------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_two_ray_host_actors_one_killed_mid_run_work_continues_on_the_other(
    root_dir: Path, ray_cluster: None
) -> None:
    from sandbox.fleet.ray_hosts import RayHost

    async def main() -> tuple[list[tuple[str, str, float]], float, dict[str, Any], int]:
        cfg = fleet_config(
            call_deadline_s=20, start_deadline_s=30, exec_margin_s=5, acquire_timeout_s=30
        )
        hosts = [
            RayHost.spawn(
                HostConfig(name=f"ray-{i}", local=local_config(root_dir), max_sandboxes=4),
                cfg.owner,
            )
            for i in range(2)
        ]
        killed_pid = await asyncio.wait_for(hosts[0].pid(), 60)
        killed_at = float("inf")
        outcomes: list[tuple[str, str, float]] = []
        gate = asyncio.Semaphore(8)

        async def trajectory(index: int) -> None:
            nonlocal killed_at
            async with gate:
                asked_at = time.monotonic()
                try:
                    async with await fleet.acquire() as sandbox:
                        first = await sandbox.exec(f"echo {index}", 10)
                        assert first.stdout == f"{index}\n"
                        await sandbox.exec("sleep 0.3", 10)
                    outcomes.append((sandbox.host_name or "", "completed", asked_at))
                except SandboxError as exc:
                    outcomes.append(("", f"{type(exc).__name__}: {exc}", 0.0))
                if len(outcomes) == 10:
                    hosts[0].kill()
                    await until_gone(killed_pid)
                    killed_at = time.monotonic()

        try:
            async with Fleet(hosts, cfg) as fleet:
                await asyncio.gather(*(trajectory(i) for i in range(40)))
                metrics = fleet.metrics()
        finally:
            hosts[1].kill()
        return outcomes, killed_at, metrics, killed_pid

    outcomes, killed_at, metrics, killed_pid = run(main())
    assert len(outcomes) == 40
    failed = [status for host, status, _ in outcomes if status != "completed"]
    assert all("ray-0" in status and status.startswith("SandboxDiedError") for status in failed)
    later = [host for host, status, asked in outcomes if asked > killed_at]
    assert later and set(later) == {"ray-1"}  # work asked for after the death: the survivor
    assert sum(status == "completed" for _, status, _ in outcomes) >= 30
    assert metrics["hosts"]["ray-0"]["breaker"] == "open"
    assert sandbox_uid_processes() == []
    assert pid_gone(killed_pid)


@pytest.mark.timeout(120)
def test_spawn_per_node_pins_one_host_to_each_sandbox_node(
    root_dir: Path, ray_cluster: None
) -> None:
    import ray

    from sandbox.fleet.ray_hosts import SandboxNode, spawn_per_node

    def config_for(node: SandboxNode) -> list[HostConfig]:
        return [HostConfig(name=f"node-{node.node_id[:8]}", local=local_config(root_dir))]

    async def main() -> tuple[list[str], str]:
        hosts = spawn_per_node(config_for, owner())
        try:
            async with Fleet(hosts, fleet_config(call_deadline_s=30)) as fleet:
                async with await fleet.acquire() as sandbox:
                    result = await sandbox.exec("echo on-node", 10)
                return [host.name for host in hosts], result.stdout
        finally:
            for host in hosts:
                host.kill()

    names, stdout = run(main())
    (node,) = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    assert names == [f"node-{node[:8]}"] and stdout == "on-node\n"
