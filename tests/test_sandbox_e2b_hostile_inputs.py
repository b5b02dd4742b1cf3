"""Hostile inputs to E2BSandbox where the backend itself handles them (against the SDK
STAND-IN of tests/e2b_standin.py): commands, cwds and environments no process can be given
or envd's requests cannot carry, invalid and overlong timeouts, paths envd cannot name and
files that are not regular, odd file contents, and calls after or during close(). Whatever
the input, a method returns a result or raises a SandboxError (ValueError only for a
timeout that is not positive and finite); nothing else escapes, nothing blocks. Controls
show the same inputs break the SDK when they reach it: its own request encoding and
deadline conversion, or the stand-in's host process where envd's answer is not known.
Where parents of a path are links, the stand-in (not the backend) confines the transfer,
so those cases live in the Docker suite only.
"""

from __future__ import annotations

import asyncio
import math
import shlex
from collections.abc import Awaitable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from e2b.envd.filesystem import filesystem_pb
from e2b.envd.process import process_pb
from e2b.envd.utils import timeout_to_ms

from sandbox import (
    E2BSandbox,
    ExecResult,
    SandboxClosedError,
    SandboxError,
    SandboxResourceError,
)
from tests.e2b_standin import STANDIN_API_KEY, FakeClock, StandInCloud, standin_cloud
from tests.test_sandbox_e2b import make

T = TypeVar("T")

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


async def outcome(operation: Awaitable[T]) -> T | SandboxError:
    """The result, or the SandboxError raised; any other exception fails the test (as
    does an operation that blocks)."""
    try:
        return await asyncio.wait_for(operation, 15)
    except SandboxError as exc:
        return exc


# -- commands ------------------------------------------------------------------------------

BAD_COMMANDS: dict[str, dict[str, Any]] = {
    "nul in command": {"cmd": "echo a\0b"},
    "lone surrogate in command": {"cmd": "echo \ud800"},
    "non-UTF-8 byte in command": {"cmd": "echo \udcff"},
    "argument over MAX_ARG_STRLEN": {"cmd": "echo " + "x" * 200_000},
    "nul in cwd": {"cmd": "pwd", "cwd": "a\0b"},
    "non-UTF-8 byte in cwd": {"cmd": "pwd", "cwd": "\udcff"},
    "nul in env value": {"cmd": "true", "env": {"A": "b\0c"}},
    "= in env name": {"cmd": "true", "env": {"A=B": "c"}},
    "empty env name": {"cmd": "true", "env": {"": "c"}},
    "non-UTF-8 byte in env": {"cmd": "true", "env": {"A": "\udcff"}},
}
NOT_BROKEN_BY_THE_STANDIN = {"empty env name"}
"""Accepted by a host process; refused all the same, as runc refuses it (DockerSandbox)."""


def encodes(request: Any) -> bool:
    """Whether the SDK's protobuf can encode `request` for envd."""
    try:
        request.to_binary()
    except UnicodeEncodeError:
        return False
    return True


def test_controls_the_bad_commands_break_the_sdk_when_they_reach_it(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def sent(sandbox: E2BSandbox, spec: dict[str, Any]) -> bool:
        """Whether the command, cwd included as the adapter includes it, went through: the
        SDK's real request encoding, then the stand-in's start of it (a failure there the
        adapter used to report as a dead sandbox)."""
        cmd, env = spec["cmd"], spec.get("env")
        if "cwd" in spec:
            cmd = f"cd -- {shlex.quote(spec['cwd'])} || exit 1; {cmd}"
        config = process_pb.ProcessConfig(cmd="/bin/bash", args=["-l", "-c", cmd], envs=env)
        if not encodes(process_pb.StartRequest(process=config)):
            return False
        try:
            await sandbox._started().commands.run(cmd, envs=env, timeout=10)
        except (ValueError, OSError):  # UnicodeEncodeError is a ValueError
            return False
        return True

    async def go() -> set[str]:
        async with make(cloud, clock) as sandbox:
            return {name for name, spec in BAD_COMMANDS.items() if await sent(sandbox, spec)}

    assert run(go()) == NOT_BROKEN_BY_THE_STANDIN


def test_a_command_no_process_can_be_given_fails_with_exit_code_126_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> tuple[dict[str, Any], ExecResult]:
        async with make(cloud, clock) as sandbox:
            results = {
                name: await outcome(sandbox.exec(**spec, timeout_s=10))
                for name, spec in BAD_COMMANDS.items()
            }
            return results, await sandbox.exec("echo still fine", 10)

    results, after = run(go())
    assert all(
        isinstance(r, ExecResult)
        and r.exit_code == 126
        and "the sandbox cannot run this command" in r.stderr
        for r in results.values()
    ), results
    assert [cmd for _, cmd in cloud.commands] == ["echo still fine"]  # none reached the SDK
    assert after.stdout == "still fine\n"


def test_a_lone_dash_cwd_is_that_directory_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> tuple[ExecResult, ExecResult]:
        async with make(cloud, clock) as sandbox:
            await sandbox.exec("mkdir -- -", 10)
            # Control: cd takes a lone "-" for the previous directory.
            return await sandbox.exec("cd -- -", 10), await sandbox.exec("pwd", 10, cwd="-")

    plain_cd, result = run(go())
    assert plain_cd.exit_code == 1 and "OLDPWD not set" in plain_cd.stderr
    assert result.exit_code == 0 and result.stdout.endswith("/home/user/-\n")


def test_controls_the_sdk_cannot_turn_a_nan_or_infinite_timeout_into_a_deadline() -> None:
    with pytest.raises(ValueError):
        timeout_to_ms(math.nan)
    with pytest.raises(OverflowError):
        timeout_to_ms(math.inf)


def test_invalid_timeouts_are_the_callers_bug_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> tuple[Any, BaseException, ExecResult, bool]:
        async with make(cloud, clock) as sandbox:
            for timeout_s in (0.0, -1.0, -math.inf, math.nan, math.inf):
                with pytest.raises(ValueError, match="positive and finite"):
                    await sandbox.exec("true", timeout_s)
            overlong = await outcome(sandbox.exec("true", 1e6))  # past E2B's 24 h
            # Control: E2B itself refuses that lifetime, which is not the sandbox dying.
            with pytest.raises(Exception) as refused:
                await sandbox._started().set_timeout(10**6, api_key=STANDIN_API_KEY)
            return (
                overlong,
                refused.value,
                await sandbox.exec("echo fine", 10),
                (await sandbox.is_alive()),
            )

    overlong, refused, after, alive = run(go())
    assert isinstance(overlong, SandboxResourceError) and "lower timeout_s" in str(overlong)
    assert getattr(refused, "status_code", None) == 400
    assert after.stdout == "fine\n" and alive
    assert [cmd for _, cmd in cloud.commands] == ["echo fine"]


# -- files ---------------------------------------------------------------------------------

PLANT = (
    "mkfifo fifo; mkdir dir; printf hi > 'new\nline'; ln -s /etc/shadow shadow; "
    "ln -s /dev/zero zero; ln -s /proc/self/environ environ; ln -s nowhere dangling; "
    "python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\""
)
BAD_PATHS = {
    "nul": "a\0b",
    "lone surrogate": "\ud800",
    "non-UTF-8 byte": "\udcff",
    "over PATH_MAX": "a/" * 2100 + "b",
    "over PATH_MAX with the workdir": "a/" * 2043 + "b",
    "component over NAME_MAX": "x" * 300,
    "fifo": "fifo",
    "socket": "sock",
    "directory": "dir",
    "symlink to a root-only file": "shadow",
    "symlink to a device": "zero",
    "symlink to a /proc entry": "environ",
    "dangling symlink": "dangling",
    "the working directory": ".",
    "the root": "/",
    "outside": "../../etc/passwd",
    "absolute outside": "/etc/passwd",
    "absolute /proc entry": "/proc/self/environ",
}


def test_controls_odd_paths_break_the_sdk_when_they_reach_it(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    assert not encodes(filesystem_pb.StatRequest(path="/home/user/\udcff"))

    async def go() -> None:
        async with make(cloud, clock) as sandbox:
            with pytest.raises(OSError, match="too long"):
                await sandbox._started().files.get_info("x" * 300)

    run(go())


def test_file_transfer_of_hostile_paths_raises_only_file_errors_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> tuple[dict[str, Any], bytes, ExecResult]:
        async with make(cloud, clock) as sandbox:
            planted = await sandbox.exec(PLANT, 10)
            assert planted.exit_code == 0, planted.stderr
            outcomes: dict[str, Any] = {}
            for name, path in BAD_PATHS.items():
                outcomes[f"read {name}"] = await outcome(sandbox.read_file(path))
                outcomes[f"write {name}"] = await outcome(sandbox.write_file(path, b"planted"))
            await sandbox.write_file("new\nline", b"round trip")
            listing = await sandbox.exec("ls -A; readlink shadow", 10)
            return outcomes, await sandbox.read_file("new\nline"), listing

    outcomes, newline, listing = run(go())
    refused = {op: type(result).__name__ for op, result in outcomes.items()}
    assert set(refused.values()) == {"SandboxFileError"}, refused
    assert newline == b"round trip"
    assert "a\n" not in listing.stdout and listing.stdout.endswith("/etc/shadow\n")


def test_odd_contents_round_trip_against_standin(cloud: StandInCloud, clock: FakeClock) -> None:
    odd: dict[str, Any] = {
        "empty": b"",
        "every byte": bytes(range(256)) * 4,
        "bytearray": bytearray(b"\0\xff\n"),
        "memoryview": memoryview(b"\xfe\0view"),
    }

    async def go() -> dict[str, bytes]:
        async with make(cloud, clock) as sandbox:
            for name, data in odd.items():
                await sandbox.write_file(name, data)
            return {name: await sandbox.read_file(name) for name in odd}

    assert run(go()) == {name: bytes(data) for name, data in odd.items()}


# -- close ---------------------------------------------------------------------------------


def test_every_method_after_close_raises_sandbox_closed_error_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> tuple[list[Any], bool]:
        sandbox = make(cloud, clock)
        async with sandbox:
            pass
        await sandbox.close()
        calls = [
            sandbox.exec("true", 10),
            sandbox.exec("true", 10, cwd="a\0b"),  # closed, whatever the input
            sandbox.read_file("x"),
            sandbox.read_file("a\0b"),
            sandbox.write_file("x", b""),
            sandbox.keep_alive(10),
            sandbox.start(),
        ]
        return [await outcome(call) for call in calls], await sandbox.is_alive()

    results, alive = run(go())
    assert all(isinstance(r, SandboxClosedError) for r in results), results
    assert not alive


def test_close_during_a_command_ends_it_as_closed_against_standin(
    cloud: StandInCloud, clock: FakeClock
) -> None:
    async def go() -> Any:
        sandbox = make(cloud, clock)
        await sandbox.start()
        running = asyncio.ensure_future(outcome(sandbox.exec("sleep 30", 20)))
        while not cloud.state(sandbox.sandbox_id).process_groups:  # the command runs
            await asyncio.sleep(0.01)
        await sandbox.close()
        return await running

    ended = run(go())
    assert isinstance(ended, SandboxClosedError), ended


def test_close_during_a_kill_ends_the_command_as_closed_against_standin(clock: FakeClock) -> None:
    """At the deadline the command is killed and its stream given a grace to end; a
    close() in that grace left the adapter without a sandbox to name."""
    cloud = standin_cloud(clock, honor_stream_timeout=False)  # our own deadline kills

    async def go() -> Any:
        sandbox = make(cloud, clock, sweep_on_kill=False, kill_grace_s=1.0)
        await sandbox.start()
        # The background sleep holds the output open after the command's kill.
        running = asyncio.ensure_future(outcome(sandbox.exec("sleep 30 & wait", 0.2)))
        while not cloud.killed_pids:
            await asyncio.sleep(0.01)
        await sandbox.close()
        return await running

    try:
        ended = run(go())
    finally:
        cloud.close()
    assert isinstance(ended, SandboxClosedError), ended
