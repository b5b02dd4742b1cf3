"""E2BSandbox against the E2B SDK STAND-IN of tests/e2b_standin.py (E2B cannot be reached
from CI): results, deadlines, lifetime extension, account rate limits, error mapping,
files, reaping. Tests named `..._against_standin` exercise the adapter over the stand-in;
what the stand-in fakes and assumes is listed in its docstring. The last test runs against
the real E2B service, only when E2B_API_KEY is set.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from e2b import (
    RateLimitException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    SandboxUnreachableException,
    TimeoutException,
)
from e2b.api import api_exception_from_code
from e2b.exceptions import format_request_timeout_error

from sandbox import (
    E2BSandbox,
    E2BSandboxConfig,
    Sandbox,
    SandboxClosedError,
    SandboxDiedError,
    SandboxError,
    SandboxFileError,
    SandboxResourceError,
    SandboxStartError,
    SandboxUnavailableError,
)
from sandbox.e2b import (
    _SWEEP,
    OWNER_LABEL,
    SANDBOX_LABEL,
    E2BAuthError,
    E2BRateLimiter,
    E2BRateLimitError,
    _exit_status,
    e2b_sandbox_factory,
    reap,
)
from tests.e2b_standin import STANDIN_API_KEY, FakeClock, StandInCloud, standin_cloud
from tests.processes import running

T = TypeVar("T")
OWNER = f"pytest-{os.getpid()}"

pytestmark = pytest.mark.timeout(60)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def cloud(clock: FakeClock) -> Iterator[StandInCloud]:
    cloud = standin_cloud(clock)
    yield cloud
    cloud.close()


def config(**fields: Any) -> E2BSandboxConfig:
    return E2BSandboxConfig(**{"api_key": STANDIN_API_KEY, "owner": OWNER, **fields})


def make(
    cloud: StandInCloud, clock: FakeClock, limiter: E2BRateLimiter | None = None, **fields: Any
) -> E2BSandbox:
    cfg = config(**fields)
    limiter = limiter or E2BRateLimiter(1000.0, 100, clock, clock.sleep)
    return E2BSandbox(cfg, limiter=limiter, sdk=cloud.AsyncSandbox, clock=clock)


def killed(pid: int, within_s: float = 5.0) -> bool:
    """`pid` is gone within `within_s`: SIGKILL is delivered asynchronously, so a process
    the sweep just killed may still show as running for a moment on a loaded machine (a
    `sleep 30` the sweep missed would still run after it)."""
    deadline = time.monotonic() + within_s
    while running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_e2b_sandbox_satisfies_the_protocol() -> None:
    assert isinstance(E2BSandbox(), Sandbox)


def test_importing_sandbox_does_not_import_the_e2b_sdk() -> None:
    import subprocess
    import sys

    probe = "import sys, sandbox; print('e2b' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[1],
    )
    assert out.stdout.strip() == "False"


# -- commands ------------------------------------------------------------------------------


def test_success_keeps_stdout_and_stderr_apart_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> Any:
        async with make(cloud, clock) as sandbox:
            return await sandbox.exec("echo out; echo err >&2", 10)

    result = run(go())
    assert (result.exit_code, result.stdout, result.stderr) == (0, "out\n", "err\n")
    assert result.ok and not result.timed_out and result.limit_hit is None
    assert (result.stdout_bytes, result.stderr_bytes) == (4, 4)


def test_nonzero_exit_is_a_result_with_its_output_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> Any:
        async with make(cloud, clock) as sandbox:
            return await sandbox.exec("echo partial; echo boom >&2; exit 3", 10)

    result = run(go())
    assert (result.exit_code, result.stdout, result.stderr) == (3, "partial\n", "boom\n")
    assert not result.ok and not result.timed_out


def test_death_by_signal_follows_the_shell_convention_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> tuple[Any, Any]:
        async with make(cloud, clock) as sandbox:
            return await sandbox.exec("kill -SEGV $$", 10), await sandbox.exec("kill -XFSZ $$", 10)

    segv, xfsz = run(go())
    assert segv.exit_code == 139 and segv.limit_hit is None
    assert xfsz.exit_code == 153 and xfsz.limit_hit == "file_size"


@pytest.mark.parametrize(
    ("exit_code", "error", "expected"),
    [(0, None, 0), (2, "exit status 2", 2), (-1, "signal: killed", 137), (-1, "odd", 255)],
)
def test_exit_status_maps_envd_signal_reports(exit_code: int, error: Any, expected: int) -> None:
    assert _exit_status(exit_code, error) == expected


def test_sdk_command_timeout_is_a_timed_out_result_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> tuple[Any, str, str]:
        async with make(cloud, clock) as sandbox:
            result = await sandbox.exec(
                "echo $$ > main.pid; sleep 30 & echo $! > bg.pid; wait", 0.3
            )
            main_pid = await sandbox.read_file("main.pid")
            background_pid = await sandbox.read_file("bg.pid")
            return result, main_pid.decode(), background_pid.decode()

    started = time.monotonic()
    result, main_pid, background_pid = run(go())
    assert time.monotonic() - started < 10
    assert result.timed_out and result.exit_code == 137 and result.limit_hit == "wall_time"
    assert 0.3 <= result.duration_s < 5
    # The command was killed by pid, then the user's processes swept (background too).
    assert int(main_pid) in cloud.killed_pids
    assert sum(cmd == _SWEEP for _, cmd in cloud.commands) == 1
    assert killed(int(main_pid)) and killed(int(background_pid))


def test_deadline_kills_only_the_command_without_the_sweep_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> tuple[Any, bool]:
        async with make(cloud, clock, sweep_on_kill=False) as sandbox:
            result = await sandbox.exec("sleep 30 & echo $! > bg.pid; wait", 0.2)
            background = int((await sandbox.read_file("bg.pid")).decode())
            return result, not running(background)

    result, background_gone = run(go())
    assert result.timed_out and result.exit_code == 137
    assert not background_gone and all(cmd != _SWEEP for _, cmd in cloud.commands)


def test_own_deadline_backs_up_a_stream_that_ignores_its_timeout_against_standin(
    clock: FakeClock,
) -> None:
    cloud = standin_cloud(clock, honor_stream_timeout=False)
    try:

        async def go() -> Any:
            async with make(cloud, clock, kill_grace_s=0.2) as sandbox:
                return await sandbox.exec("sleep 30", 0.2)

        result = run(go())
    finally:
        cloud.close()
    assert result.timed_out and result.exit_code == 137 and result.limit_hit == "wall_time"
    assert 0.4 <= result.duration_s < 5  # timeout + kill grace


def test_standin_kill_all_acts_when_its_caller_exits_and_spares_it(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    """The stand-in's `kill -1` (what the sweep runs): another command ending while the
    caller still runs must not carry it out (it killed the caller under load in CI)."""

    async def go() -> list[Any]:
        async with make(cloud, clock) as sandbox:
            caller = sandbox.exec("kill -KILL -1; sleep 1; exit 0", 20)
            ends_first = sandbox.exec("sleep 0.3", 20)
            bystander = sandbox.exec("sleep 30", 20)
            return list(await asyncio.gather(caller, ends_first, bystander))

    caller, ends_first, bystander = run(go())
    assert caller.exit_code == 0 and ends_first.exit_code == 0
    assert bystander.exit_code == 137 and bystander.duration_s < 10


def test_output_flood_is_killed_and_capped_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> Any:
        async with make(cloud, clock, max_output_mb=0.5, output_head_kb=1, output_tail_kb=1) as sb:
            return await sb.exec("yes", 30)

    result = run(go())
    assert result.limit_hit == "output" and result.exit_code == 137 and not result.timed_out
    assert result.duration_s < 10
    assert result.stdout_truncated and result.stdout_bytes > 512 * 1024
    assert len(result.stdout) < 3 * 1024


def test_long_output_keeps_head_and_tail_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> Any:
        async with make(cloud, clock, output_head_kb=1, output_tail_kb=1) as sandbox:
            return await sandbox.exec("seq 1 20000", 10)

    result = run(go())
    full = "".join(f"{i}\n" for i in range(1, 20001))
    assert result.exit_code == 0 and result.stdout_truncated
    assert result.stdout_bytes == len(full)
    assert result.stdout.startswith(full[:1024]) and result.stdout.endswith(full[-1024:])
    assert "bytes of output omitted" in result.stdout


def test_cwd_is_relative_to_the_workdir_and_env_is_passed_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> tuple[Any, Any]:
        async with make(cloud, clock, env={"FROM_CONFIG": "c"}) as sandbox:
            await sandbox.exec("mkdir -p sub", 10)
            here = await sandbox.exec(
                'pwd; echo "$FOO $FROM_CONFIG"', 10, cwd="sub", env={"FOO": "f"}
            )
            missing = await sandbox.exec("pwd", 10, cwd="nope")
            return here, missing

    here, missing = run(go())
    assert here.stdout.splitlines()[0].endswith("/home/user/sub")
    assert here.stdout.splitlines()[1] == "f c"
    assert missing.exit_code == 1 and "nope" in missing.stderr
    assert cloud.created[0]["envs"] == {"PYTHONDONTWRITEBYTECODE": "1", "FROM_CONFIG": "c"}


def test_cancelled_exec_kills_its_command_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> str:
        async with make(cloud, clock) as sandbox:
            task = asyncio.ensure_future(sandbox.exec("echo $$ > pid; sleep 30", 60))
            while not (cloud.root / sandbox.sandbox_id / "home/user/pid").exists():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return (await sandbox.read_file("pid")).decode()

    pid = int(run(go()))
    assert pid in cloud.killed_pids and killed(pid)


# -- lifetime ------------------------------------------------------------------------------


def test_created_with_template_lifetime_and_ownership_metadata_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    cloud.templates.add("swe-base")
    sandbox = make(
        cloud,
        clock,
        template="swe-base",
        trajectory_timeout_s=1800,
        grading_timeout_s=600,
        labels={"run": "r1"},
    )

    async def go() -> None:
        async with sandbox:
            pass

    run(go())
    created = cloud.created[0]
    assert created["template"] == "swe-base" and created["timeout"] == 2400
    assert created["metadata"] == {SANDBOX_LABEL: "1", OWNER_LABEL: OWNER, "run": "r1"}
    assert created["allow_internet_access"] is False
    assert created["api_key"] == STANDIN_API_KEY


def test_lifetime_is_extended_before_commands_that_would_outlive_it_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> None:
        sandbox = make(
            cloud,
            clock,
            trajectory_timeout_s=1000,
            grading_timeout_s=200,
            lifetime_margin_s=60,
            extension_s=600,
        )
        async with sandbox:
            t0 = clock.now
            assert (await sandbox.exec("true", 30)).ok
            clock.advance(1100)  # 100 s left: covers 30 + 60
            assert (await sandbox.exec("true", 30)).ok
            assert cloud.set_timeouts == []
            clock.advance(20)  # 80 s left: too little
            assert (await sandbox.exec("true", 30)).ok
            assert cloud.set_timeouts == [(sandbox.sandbox_id, 600, t0 + 1120)]
            clock.advance(530)  # past the lifetime at creation, alive thanks to the extension
            assert (await sandbox.exec("true", 30)).ok
            assert cloud.set_timeouts[-1] == (sandbox.sandbox_id, 600, t0 + 1650)
            assert (await sandbox.exec("true", 1000)).ok  # a long command: more than extension_s
            assert cloud.set_timeouts[-1] == (sandbox.sandbox_id, 1060, t0 + 1650)
            await sandbox.write_file("f", b"x")  # file transfers keep it alive too
            clock.advance(1000)
            assert await sandbox.read_file("f") == b"x"
            assert cloud.set_timeouts[-1] == (sandbox.sandbox_id, 600, t0 + 2650)
            assert len(cloud.set_timeouts) == 4

    run(go())


def test_sandbox_dies_at_its_lifetime_when_not_extended_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> None:
        sandbox = make(cloud, clock, trajectory_timeout_s=100, grading_timeout_s=0)
        async with sandbox:
            assert await sandbox.is_alive()
            clock.advance(101)
            assert not await sandbox.is_alive()
            assert sandbox.sandbox_id not in cloud.running()
            with pytest.raises(SandboxDiedError, match="lifetime"):
                await sandbox.exec("true", 10)

    run(go())


def test_failed_extension_is_an_infrastructure_error_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> None:
        sandbox = make(cloud, clock, trajectory_timeout_s=100, grading_timeout_s=0)
        async with sandbox:
            cloud.fail_next("set_timeout", SandboxNotFoundException("Sandbox x not found"))
            with pytest.raises(SandboxDiedError, match="extend"):
                await sandbox.exec("true", 90)
            cloud.fail_next("set_timeout", api_exception_from_code(429, "slow down"))
            with pytest.raises(E2BRateLimitError):
                await sandbox.exec("true", 90)

    run(go())


# -- account limits ------------------------------------------------------------------------


def test_creations_are_spaced_to_the_account_rate_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    limiter = E2BRateLimiter(5.0, 100, clock, clock.sleep)

    async def go() -> None:
        for _ in range(10):
            await make(cloud, clock, limiter).start()

    started = clock.now
    run(go())
    times = [created["at"] for created in cloud.created]
    assert len(times) == 10 and times[0] == started
    assert all(later - earlier >= 0.2 - 1e-9 for earlier, later in itertools.pairwise(times))
    assert times[-1] - started >= (10 - 1) / 5.0 - 1e-9


def test_concurrent_creations_wait_their_turns_in_order(clock: FakeClock) -> None:
    limiter = E2BRateLimiter(5.0, 100, clock, clock.sleep)

    async def go() -> None:
        await asyncio.gather(*(limiter.creation_turn() for _ in range(10)))

    started = clock.now
    run(go())
    # Asked at once, only the first goes without waiting; the fake clock runs the sleeps
    # one after the other, so together they span the nine intervals.
    assert len(clock.slept) == 9
    assert clock.now - started >= (10 - 1) / 5.0 - 1e-9


def test_rate_limiter_waits_in_real_time() -> None:
    limiter = E2BRateLimiter(20.0, 10)

    async def go() -> float:
        started = time.monotonic()
        await asyncio.gather(*(limiter.creation_turn() for _ in range(4)))
        return time.monotonic() - started

    assert run(go()) >= 3 / 20.0 - 0.01


def test_concurrency_cap_holds_a_slot_from_start_to_close_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    limiter = E2BRateLimiter(1000.0, 2, clock, clock.sleep)

    async def go() -> None:
        first, second, third = (make(cloud, clock, limiter) for _ in range(3))
        await first.start()
        await second.start()
        waiting = asyncio.ensure_future(third.start())
        await asyncio.sleep(0.1)
        assert not waiting.done() and len(cloud.running()) == 2
        await first.close()
        await asyncio.wait_for(waiting, 5)
        assert len(cloud.running()) == 2
        await second.close()
        await third.close()

    run(go())


def test_factory_runs_each_task_image_as_its_template_against_standin(
    clock: FakeClock,
) -> None:
    """The SWE harness asks for a sandbox of the task's image: its E2B template."""
    cloud = standin_cloud(clock, templates=("base", "swe-astropy-1"))
    image = "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    new_sandbox = e2b_sandbox_factory(config(), cloud.AsyncSandbox, {image: "swe-astropy-1"})

    async def go() -> None:
        async with new_sandbox(image), new_sandbox(None):
            pass

    try:
        run(go())
        assert [c["template"] for c in cloud.created] == ["swe-astropy-1", "base"]
        with pytest.raises(SandboxUnavailableError, match="no E2B template for image 'other'"):
            new_sandbox("other")
    finally:
        cloud.close()


def test_factory_sandboxes_share_the_account_limits_against_standin(
    cloud: StandInCloud,
) -> None:
    new_sandbox = e2b_sandbox_factory(
        config(max_concurrent=1, slot_timeout_s=0.1), cloud.AsyncSandbox
    )

    async def go() -> None:
        async with new_sandbox(None):
            with pytest.raises(SandboxResourceError, match="slots"):
                await new_sandbox(None).start()
        async with new_sandbox(None):  # the slot came back at close
            pass

    run(go())


# -- infrastructure errors -----------------------------------------------------------------

START_FAILURES: list[tuple[str, Callable[[], BaseException], type[SandboxError], str]] = [
    ("rate_limit", lambda: api_exception_from_code(429, "too many"), E2BRateLimitError, "429"),
    ("busy", lambda: api_exception_from_code(503, "no capacity"), E2BRateLimitError, "503"),
    ("request_timeout", format_request_timeout_error, SandboxStartError, "in time"),
    ("server_error", lambda: api_exception_from_code(500, "boom"), SandboxStartError, "500"),
]


@pytest.mark.parametrize(
    ("exc", "expected", "fragment"),
    [case[1:] for case in START_FAILURES],
    ids=[case[0] for case in START_FAILURES],
)
def test_creation_failures_map_to_sandbox_errors_against_standin(
    cloud: StandInCloud,
    clock: FakeClock,
    exc: Callable[[], BaseException],
    expected: type[SandboxError],
    fragment: str,
) -> None:
    limiter = E2BRateLimiter(1000.0, 1, clock, clock.sleep)
    cloud.fail_next("create", exc())
    sandbox = make(cloud, clock, limiter)
    with pytest.raises(expected, match=fragment):
        run(sandbox.start())
    assert cloud.running() == []

    async def slot_is_back() -> None:
        async with make(cloud, clock, limiter, slot_timeout_s=0.5):
            pass

    run(slot_is_back())


def test_refused_api_key_is_an_auth_error_against_standin(
    cloud: StandInCloud, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(E2BAuthError, match="401"):
        run(make(cloud, clock, api_key="e2b_wrong").start())
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(E2BAuthError, match="E2B_API_KEY"):
        run(make(cloud, clock, api_key=None).start())


def test_unknown_template_and_refused_lifetime_are_start_errors_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    with pytest.raises(SandboxStartError, match="template"):
        run(make(cloud, clock, template="no-such-template").start())
    with pytest.raises(SandboxStartError, match="refused the arguments"):
        run(make(cloud, clock, trajectory_timeout_s=90_000).start())
    assert cloud.running() == []


RUN_FAILURES: list[tuple[str, str, Callable[[], BaseException], type[SandboxError]]] = [
    (
        "killed_mid_stream",
        "stream",
        lambda: SandboxNotRunningException("The sandbox x was not found"),
        SandboxDiedError,
    ),
    (
        "unreachable",
        "run",
        lambda: SandboxUnreachableException("port is not open"),
        SandboxDiedError,
    ),
    ("request_timeout", "stream", lambda: TimeoutException("cancelled"), SandboxDiedError),
    ("rate_limit", "run", lambda: RateLimitException("Rate limit exceeded"), E2BRateLimitError),
]


@pytest.mark.parametrize(
    ("operation", "exc", "expected"),
    [case[1:] for case in RUN_FAILURES],
    ids=[case[0] for case in RUN_FAILURES],
)
def test_command_infrastructure_failures_raise_against_standin(
    cloud: StandInCloud,
    clock: FakeClock,
    operation: str,
    exc: Callable[[], BaseException],
    expected: type[SandboxError],
) -> None:
    async def go() -> None:
        async with make(cloud, clock) as sandbox:
            cloud.fail_next(operation, exc())
            with pytest.raises(expected):
                await sandbox.exec("sleep 0.05", 10)

    run(go())


def test_sandbox_killed_under_a_command_is_an_infrastructure_error_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> None:
        async with make(cloud, clock) as sandbox:
            running = asyncio.ensure_future(sandbox.exec("sleep 30", 60))
            await asyncio.sleep(0.1)
            await cloud.AsyncSandbox.kill(sandbox.sandbox_id, api_key=STANDIN_API_KEY)
            with pytest.raises(SandboxDiedError):
                await running
            assert not await sandbox.is_alive()
            with pytest.raises(SandboxDiedError):
                await sandbox.exec("true", 10)
            with pytest.raises(SandboxDiedError):  # not a SandboxFileError: the sandbox is gone
                await sandbox.read_file("anything")

    run(go())


# -- files ---------------------------------------------------------------------------------


def test_files_round_trip_against_standin(cloud: StandInCloud, clock: FakeClock) -> None:
    data = bytes(range(256)) * 4

    async def go() -> tuple[bytes, bytes, Any]:
        async with make(cloud, clock) as sandbox:
            await sandbox.write_file("deep/dir/blob.bin", data)
            await sandbox.write_file("/home/user/note.txt", b"first")
            await sandbox.write_file("note.txt", b"second")  # replaces
            listed = await sandbox.exec("wc -c < deep/dir/blob.bin; cat note.txt", 10)
            return (
                await sandbox.read_file("deep/dir/blob.bin"),
                await sandbox.read_file("/home/user/note.txt"),
                listed,
            )

    blob, note, listed = run(go())
    assert blob == data and note == b"second"
    assert listed.stdout.split() == ["1024", "second"]


@pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "/home/user", "a/../../b"])
def test_paths_outside_the_workdir_are_refused_against_standin(
    cloud: StandInCloud, clock: FakeClock, path: str
) -> None:
    async def go() -> None:
        async with make(cloud, clock) as sandbox:
            with pytest.raises(SandboxFileError):
                await sandbox.write_file(path, b"x")
            with pytest.raises(SandboxFileError):
                await sandbox.read_file(path)

    run(go())


def test_missing_links_dirs_and_big_files_are_file_errors_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> None:
        async with make(cloud, clock, max_read_file_mb=0.001) as sandbox:
            await sandbox.exec(
                "mkdir adir; ln -s /etc/hostname link; head -c 2000 /dev/zero > big", 10
            )
            with pytest.raises(SandboxFileError, match="No such file"):
                await sandbox.read_file("missing")
            with pytest.raises(SandboxFileError, match="not a regular file"):
                await sandbox.read_file("adir")
            with pytest.raises(SandboxFileError, match="not a regular file"):
                await sandbox.write_file("adir", b"x")
            with pytest.raises(SandboxFileError, match="symlink"):
                await sandbox.read_file("link")
            with pytest.raises(SandboxFileError, match="symlink"):
                await sandbox.write_file("link", b"x")
            with pytest.raises(SandboxFileError, match="limit"):
                await sandbox.read_file("big")

    run(go())


# -- lifecycle and reaping -----------------------------------------------------------------


def test_close_is_idempotent_and_use_after_close_fails_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> None:
        never_started = make(cloud, clock)
        await never_started.close()
        await never_started.close()
        sandbox = make(cloud, clock, workdir="/home/user/work")
        async with sandbox:
            assert (await sandbox.exec("pwd", 10)).stdout.strip().endswith("/home/user/work")
            sandbox_id = sandbox.sandbox_id
        assert sandbox_id not in cloud.running()
        await sandbox.close()
        assert not await sandbox.is_alive()
        with pytest.raises(SandboxClosedError):
            await sandbox.exec("true", 10)
        with pytest.raises(SandboxClosedError):
            await sandbox.start()

    run(go())


def test_close_survives_a_failed_kill_and_frees_the_slot_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    limiter = E2BRateLimiter(1000.0, 1, clock, clock.sleep)

    async def go() -> None:
        sandbox = make(cloud, clock, limiter)
        await sandbox.start()
        cloud.fail_next("kill", api_exception_from_code(500, "boom"))
        await sandbox.close()  # logged, not raised: reap finds it
        async with make(cloud, clock, limiter, slot_timeout_s=0.5):
            pass

    run(go())
    assert len(cloud.running()) == 1  # the one whose kill failed


def test_reap_kills_the_owners_sandboxes_only_against_standin(clock: FakeClock) -> None:
    cloud = standin_cloud(clock, page_size=2)
    try:

        async def go() -> tuple[int, int]:
            mine = [make(cloud, clock, owner="run-a") for _ in range(3)]
            theirs = make(cloud, clock, owner="run-b")
            for sandbox in [*mine, theirs]:
                await sandbox.start()
            cfg = config()
            reaped = await reap({OWNER_LABEL: "run-a"}, cfg, cloud.AsyncSandbox)
            assert not await mine[0].is_alive() and await theirs.is_alive()
            again = await reap({OWNER_LABEL: "run-a"}, cfg, cloud.AsyncSandbox)
            for sandbox in [*mine, theirs]:
                await sandbox.close()
            return reaped, again

        assert run(go()) == (3, 0)
    finally:
        cloud.close()


# -- the real service ----------------------------------------------------------------------


@pytest.mark.skipif(not os.environ.get("E2B_API_KEY"), reason="E2B_API_KEY is not set")
@pytest.mark.timeout(300)
def test_real_e2b_create_exec_files_close() -> None:
    """Against E2B itself (needs network and an API key; template E2B_TEMPLATE or base)."""
    owner = f"pytest-real-{os.getpid()}-{int(time.time())}"
    cfg = E2BSandboxConfig(
        template=os.environ.get("E2B_TEMPLATE", "base"),
        owner=owner,
        trajectory_timeout_s=240,
        grading_timeout_s=60,
        max_creations_per_s=1.0,
        max_concurrent=2,
    )

    async def go() -> None:
        try:
            async with E2BSandbox(cfg) as sandbox:
                done = await sandbox.exec("echo out; echo err >&2; exit 3", 30)
                assert done.exit_code == 3  # a login shell may print before the command
                assert done.stdout.endswith("out\n") and done.stderr.endswith("err\n")
                await sandbox.write_file("dir/blob.bin", bytes(range(256)))
                assert await sandbox.read_file("dir/blob.bin") == bytes(range(256))
                slow = await sandbox.exec("sleep 300 & echo $! > bg.pid; sleep 60", 2)
                assert slow.timed_out and slow.exit_code == 137
                background = (await sandbox.read_file("bg.pid")).decode().strip()
                probe = await sandbox.exec(f"kill -0 {background}", 30)
                assert probe.exit_code != 0, "the deadline sweep left a background process"
                assert await sandbox.is_alive()
            assert not await sandbox.is_alive()
        finally:
            await reap({OWNER_LABEL: owner}, cfg)

    run(go())
