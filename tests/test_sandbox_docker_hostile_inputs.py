"""Hostile inputs to every DockerSandbox method, the classes of the local suite
(tests/test_sandbox_hostile_inputs.py): commands, cwds and environments no process can be
given or the API cannot carry, odd working directories, invalid timeouts, paths the daemon
cannot name or that lead through links the sandbox planted, odd file contents, and calls
after or during close(). Whatever the input, a method returns a result or raises a
SandboxError (ValueError only for a timeout that is not positive and finite: the caller's
bug); nothing else escapes, nothing blocks. Controls show the same inputs break a plain
docker-py exec or archive call. Skipped when no daemon answers (.ci/run starts one).
"""

from __future__ import annotations

import asyncio
import io
import math
import os
import posixpath
import re
import tarfile
import time
from collections.abc import Awaitable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import docker.errors
import pytest

from sandbox import (
    DockerSandbox,
    DockerSandboxConfig,
    ExecResult,
    SandboxClosedError,
    SandboxError,
    SandboxFileError,
)
from sandbox.docker import OWNER_LABEL, docker_client, reap
from tests.docker_images import daemon_problem, sandbox_test_image

T = TypeVar("T")
OWNER = f"pytest-hostile-{os.getpid()}"

pytestmark = [
    pytest.mark.skipif(daemon_problem() is not None, reason=f"{daemon_problem()}"),
    # Generous for the first test, which may build the image (about a minute); every
    # operation is bounded on its own by `outcome`.
    pytest.mark.timeout(300),
]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def image() -> str:
    return sandbox_test_image()


@pytest.fixture(scope="module")
def client() -> Iterator[docker.DockerClient]:
    client = docker_client(concurrency=4)
    yield client
    reap({OWNER_LABEL: OWNER}, client)
    client.close()


def config(image: str, **fields: Any) -> DockerSandboxConfig:
    return DockerSandboxConfig(image=image, owner=OWNER, **fields)


def writable_root(image: str) -> DockerSandboxConfig:
    """The daemon refuses any archive into a read-only root: with a writable one, only the
    sandbox's checks stand between a planted link and its target."""
    return config(image, read_only=False)


async def outcome(operation: Awaitable[T]) -> T | SandboxError:
    """The result, or the SandboxError raised; any other exception fails the test (as
    does an operation that blocks)."""
    try:
        return await asyncio.wait_for(operation, 20)
    except SandboxError as exc:
        return exc


def plain_exec(
    client: docker.DockerClient, container_id: str, argv: list[str], **options: Any
) -> tuple[int, bytes]:
    """The control: docker-py's own exec, as a caller without the sandbox would run it."""
    exec_id = client.api.exec_create(container_id, argv, **options)["Id"]
    output = client.api.exec_start(exec_id)
    return client.api.exec_inspect(exec_id)["ExitCode"], output


def tar_of(name: str, data: bytes) -> bytes:
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        member = tarfile.TarInfo(name)
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    return archive.getvalue()


# -- commands ------------------------------------------------------------------------------

OCTETS = " | od -An -tx1"
REPLACEMENT = b" ef bf bd"
"""What od prints for U+FFFD: the API's stand-in for text that is not UTF-8."""
RUNC_REFUSED = re.compile(rb"OCI runtime exec failed|^exec \S+: ")
"""runc could not start the process: its OCI error, or its init's line (runc 1.1)."""


@dataclass(frozen=True)
class BadCommand:
    cmd: str
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    altered_to: bytes | None = None
    """What a plain exec prints instead, the input changed on its way; None: runc refuses
    to start the process."""


BAD_COMMANDS = {
    "nul in command": BadCommand("echo a\0b"),
    "lone surrogate in command": BadCommand("printf %s \ud800" + OCTETS, altered_to=REPLACEMENT),
    "non-UTF-8 byte in command": BadCommand("printf %s \udcff" + OCTETS, altered_to=REPLACEMENT),
    "argument over MAX_ARG_STRLEN": BadCommand("echo " + "x" * 200_000),
    "nul in cwd": BadCommand("pwd", cwd="a\0b"),
    "non-UTF-8 byte in cwd": BadCommand("pwd", cwd="\udcff"),
    "nul in env value": BadCommand("true", env={"A": "b\0c"}),
    "= in env name": BadCommand('printf %s "$A"', env={"A=B": "c"}, altered_to=b"B=c"),
    "empty env name": BadCommand("true", env={"": "c"}),
    "non-UTF-8 byte in env": BadCommand(
        'printf %s "$A"' + OCTETS, env={"A": "\udcff"}, altered_to=REPLACEMENT
    ),
    # Each variable passes on its own; together they are past the kernel's ARG_MAX.
    "environment over ARG_MAX": BadCommand("true", env={f"V{i}": "y" * 100_000 for i in range(30)}),
}


def test_controls_the_bad_commands_break_a_plain_docker_exec(
    image: str, client: docker.DockerClient
) -> None:
    async def scenario() -> dict[str, tuple[int, bytes]]:
        async with DockerSandbox(config(image), client=client) as sandbox:
            return {
                name: plain_exec(
                    client,
                    sandbox.container_id,
                    ["/bin/bash", "-c", case.cmd],
                    environment=case.env,
                    workdir=None if case.cwd is None else posixpath.join("/work", case.cwd),
                )
                for name, case in BAD_COMMANDS.items()
            }

    plain = run(scenario())
    for name, case in BAD_COMMANDS.items():
        exit_code, output = plain[name]
        if case.altered_to is None:
            assert exit_code != 0 and RUNC_REFUSED.search(output), (name, plain[name])
        else:
            assert exit_code == 0 and case.altered_to in output, (name, plain[name])


def test_a_command_no_process_can_be_given_fails_with_exit_code_126(image: str) -> None:
    async def scenario() -> tuple[dict[str, Any], ExecResult]:
        async with DockerSandbox(config(image)) as sandbox:
            results = {
                name: await outcome(sandbox.exec(case.cmd, 10, cwd=case.cwd, env=case.env or None))
                for name, case in BAD_COMMANDS.items()
            }
            return results, await sandbox.exec("echo still fine", 10)

    results, after = run(scenario())
    seen = {
        name: (result.exit_code, result.stderr) if isinstance(result, ExecResult) else result
        for name, result in results.items()
    }
    assert all(
        isinstance(r, ExecResult)
        and r.exit_code == 126
        and "the sandbox cannot run this command" in r.stderr
        for r in results.values()
    ), seen
    assert after.stdout == "still fine\n"


def test_an_odd_cwd_is_the_commands_failure_or_that_directory(image: str) -> None:
    cwds = ["missing", "/root", "root-link", "-", "new\nline", "/", "../.."]

    async def scenario() -> tuple[ExecResult, dict[str, Any]]:
        async with DockerSandbox(config(image)) as sandbox:
            await sandbox.exec("ln -s /root root-link; mkdir -- - 'new\nline'", 10)
            # Control: cd takes a lone "-" for the previous directory, not "./-".
            plain_cd = await sandbox.exec("cd -- - && pwd", 10)
            return plain_cd, {cwd: await outcome(sandbox.exec("pwd", 10, cwd=cwd)) for cwd in cwds}

    plain_cd, results = run(scenario())
    assert "/work/-" not in plain_cd.stdout
    assert all(isinstance(r, ExecResult) for r in results.values()), results
    ended = {cwd: (r.exit_code, r.stdout) for cwd, r in results.items()}
    assert ended == {
        "missing": (1, ""),
        "/root": (1, ""),  # 0700, not the sandbox user's
        "root-link": (1, ""),
        "-": (0, "/work/-\n"),
        "new\nline": (0, "/work/new\nline\n"),
        "/": (0, "/\n"),  # the container's own root: commands may go anywhere in it
        "../..": (0, "/\n"),
    }
    assert all("can't cd" in results[cwd].stderr for cwd in ("missing", "/root", "root-link"))


def test_control_a_nan_or_infinite_deadline_never_fires() -> None:
    async def fires(timeout_s: float) -> bool:
        never_done = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.wait({never_done}, timeout=timeout_s), 0.2)
        except asyncio.TimeoutError:
            return False
        return True

    assert run(fires(0.01))
    assert not run(fires(math.nan)) and not run(fires(math.inf))


def test_invalid_timeouts_are_the_callers_bug(image: str) -> None:
    async def scenario() -> ExecResult:
        async with DockerSandbox(config(image)) as sandbox:
            for timeout_s in (0.0, -1.0, -math.inf, math.nan, math.inf):
                with pytest.raises(ValueError, match="positive and finite"):
                    await asyncio.wait_for(sandbox.exec("sleep 60", timeout_s), 10)
            return await sandbox.exec("echo far", 1e300)  # finite, however far

    assert run(scenario()).stdout == "far\n"


# -- files ---------------------------------------------------------------------------------

PLANT = (
    "mkfifo fifo; mkdir dir; printf hi > 'new\nline'; printf x > plain; "
    "ln -s /etc/shadow shadow; ln -s /dev/zero zero; ln -s /root rootdir; ln -s /etc etclink; "
    "ln -s /proc/self/environ environ; ln -s /proc proc; ln -s . loop; "
    "ln -s nowhere dangling; mkdir -p " + "d/" * 300 + "; "
    "python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\""
)
TOO_DEEP = "d/" * 300 + "f"
"""Deeper than the daemon's scoped path resolution goes (255 components)."""
BAD_PATHS = {
    "nul": "a\0b",
    "lone surrogate": "\ud800",
    "non-UTF-8 byte": "\udcff",
    "over PATH_MAX": "a/" * 2100 + "b",
    "over PATH_MAX with the workdir": "a/" * 2045 + "b",
    "component over NAME_MAX": "x" * 300,
    "deeper than the daemon resolves": TOO_DEEP,
    "fifo": "fifo",
    "socket": "sock",
    "directory": "dir",
    "symlink to a root-only file": "shadow",
    "symlink to a device": "zero",
    "symlink to a /proc entry": "environ",
    "dangling symlink": "dangling",
    "through a symlink to a root-only dir": "rootdir/.bashrc",
    "through a symlink to /etc": "etclink/shadow",
    "new file through a symlink to /etc": "etclink/planted",
    "through a symlink to /proc": "proc/1/environ",
    "through a symlink loop": "loop/loop/plain",
    "under a file": "new\nline/child",
    "the working directory": ".",
    "the root": "/",
    "outside": "../../etc/passwd",
    "absolute outside": "/etc/passwd",
    "absolute /proc entry": "/proc/self/environ",
}


def test_controls_plain_archive_calls_follow_planted_links_and_choke_on_odd_paths(
    image: str, client: docker.DockerClient
) -> None:
    async def scenario() -> tuple[bytes, ExecResult, ExecResult, dict[str, BaseException]]:
        async with DockerSandbox(writable_root(image), client=client) as sandbox:
            assert (await sandbox.exec(PLANT, 10)).exit_code == 0
            container = sandbox.container_id
            stream, _ = client.api.get_archive(container, "/work/etclink/shadow")
            shadow = b"".join(stream)
            client.api.put_archive(container, "/work/etclink", tar_of("planted", b"planted"))
            raised = {}
            for path in ("\udcff", "x" * 300, TOO_DEEP):
                with pytest.raises((UnicodeEncodeError, docker.errors.APIError)) as choked:
                    client.api.get_archive(container, f"/work/{path}")
                raised[path] = choked.value
            return (
                shadow,
                await sandbox.exec("cat /etc/shadow", 10),
                await sandbox.exec("cat /etc/planted", 10),
                raised,
            )

    shadow, user_cat, planted, raised = run(scenario())
    assert b"root:" in shadow and user_cat.exit_code != 0  # root-only, read as root
    assert planted.stdout == "planted"  # written outside the working directory
    assert isinstance(raised["\udcff"], UnicodeEncodeError)
    assert isinstance(raised["x" * 300], docker.errors.APIError)  # HTTP 500
    assert isinstance(raised[TOO_DEEP], docker.errors.APIError)


def test_file_transfer_of_hostile_paths_raises_only_file_errors(image: str) -> None:
    async def scenario() -> tuple[dict[str, Any], bytes, ExecResult]:
        async with DockerSandbox(writable_root(image)) as sandbox:
            planted = await sandbox.exec(PLANT, 10)
            assert planted.exit_code == 0, planted.stderr
            outcomes: dict[str, Any] = {}
            for name, path in BAD_PATHS.items():
                outcomes[f"read {name}"] = await outcome(sandbox.read_file(path))
                outcomes[f"write {name}"] = await outcome(sandbox.write_file(path, b"planted"))
            await sandbox.write_file("new\nline", b"round trip")
            after = await sandbox.exec("ls /etc; cat /etc/passwd; [ ! -e a ] && echo no a", 10)
            return outcomes, await sandbox.read_file("new\nline"), after

    outcomes, newline, after = run(scenario())
    refused = {op: type(result).__name__ for op, result in outcomes.items()}
    assert set(refused.values()) == {"SandboxFileError"}, refused
    assert "HTTP 500" in str(outcomes["read deeper than the daemon resolves"])
    assert newline == b"round trip"  # a newline is just a character of a name
    assert "planted" not in after.stdout and after.stdout.endswith("no a\n")


def test_odd_and_oversized_contents(image: str, client: docker.DockerClient) -> None:
    odd: dict[str, Any] = {
        "empty": b"",
        "every byte": bytes(range(256)) * 4,
        "bytearray": bytearray(b"\0\xff\n"),
        "memoryview": memoryview(b"\xfe\0view"),
    }

    async def scenario() -> tuple[dict[str, bytes], Any, ExecResult, type[BaseException]]:
        async with DockerSandbox(config(image, workdir_size_mb=1), client=client) as sandbox:
            back = {}
            for name, data in odd.items():
                await sandbox.write_file(name, data)
                back[name] = await sandbox.read_file(name)
            too_big = await outcome(sandbox.write_file("big", b"z" * (2 << 20)))
            # The daemon's partial file fills the directory until the user removes it.
            after = await sandbox.exec("rm -f big && echo fine", 10)
            # Control: the same archive through docker-py raises the daemon's error.
            with pytest.raises(docker.errors.APIError) as plain:
                client.api.put_archive(
                    sandbox.container_id, "/work", tar_of("big", b"z" * (2 << 20))
                )
            return back, too_big, after, type(plain.value)

    back, too_big, after, plain = run(scenario())
    assert back == {name: bytes(data) for name, data in odd.items()}
    assert isinstance(too_big, SandboxFileError) and "no space left" in str(too_big)
    assert after.stdout == "fine\n"
    assert issubclass(plain, docker.errors.APIError)


# -- close ---------------------------------------------------------------------------------


def test_every_method_after_close_raises_sandbox_closed_error(
    image: str, client: docker.DockerClient
) -> None:
    async def calls(sandbox: DockerSandbox) -> list[Any]:
        return [
            await outcome(sandbox.exec("true", 10)),
            await outcome(sandbox.exec("true", 10, cwd="a\0b")),  # closed, whatever the input
            await outcome(sandbox.read_file("x")),
            await outcome(sandbox.read_file("a\0b")),
            await outcome(sandbox.write_file("x", b"")),
            await outcome(sandbox.start()),
        ]

    async def scenario() -> tuple[list[Any], list[Any], bool, str]:
        never_started = DockerSandbox(config(image))
        await never_started.close()
        sandbox = DockerSandbox(config(image), client=client)
        async with sandbox:
            container_id = sandbox.container_id
        await sandbox.close()
        return (
            await calls(never_started),
            await calls(sandbox),
            await sandbox.is_alive(),
            (container_id),
        )

    never_started, closed, alive, container_id = run(scenario())
    assert all(isinstance(r, SandboxClosedError) for r in never_started + closed), closed
    assert not alive
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(container_id)


@pytest.mark.parametrize("shared_client", [False, True])
def test_close_during_a_command_ends_it_as_closed(
    image: str, client: docker.DockerClient, shared_client: bool
) -> None:
    async def scenario() -> tuple[Any, float]:
        sandbox = DockerSandbox(config(image), client=client if shared_client else None)
        await sandbox.start()
        running = asyncio.ensure_future(outcome(sandbox.exec("sleep 60", 60)))
        await asyncio.sleep(0.5)
        started = time.monotonic()
        await sandbox.close()
        return await running, time.monotonic() - started

    ended, elapsed = run(scenario())
    assert isinstance(ended, SandboxClosedError), ended
    assert elapsed < 10


def test_close_during_a_file_transfer_ends_it_or_raises_a_sandbox_error(
    image: str, client: docker.DockerClient
) -> None:
    data = bytes(16 << 20)

    async def racing(delay_s: float, shared_client: bool) -> list[Any]:
        sandbox = DockerSandbox(config(image), client=client if shared_client else None)
        await sandbox.start()
        await sandbox.write_file("big", data)
        transfers = [
            asyncio.ensure_future(outcome(sandbox.read_file("big"))),
            asyncio.ensure_future(outcome(sandbox.write_file("other", data))),
        ]
        await asyncio.sleep(delay_s)
        await sandbox.close()
        return list(await asyncio.gather(*transfers))

    async def scenario() -> list[Any]:
        return [*(await racing(0, False)), *(await racing(0.05, True))]

    for ended in run(scenario()):
        assert ended is None or ended == data or isinstance(ended, SandboxError), ended
