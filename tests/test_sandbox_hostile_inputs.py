"""Hostile inputs to every LocalSandbox (and PythonWorker) method, under both isolation
levels: commands, paths and environments no process can be given, names with newlines,
symlinks to root-only and device files, FIFOs, sockets, device nodes. Whatever the input,
a method returns a result or raises a SandboxError; nothing else escapes, nothing blocks.
Controls show the same inputs break a plain subprocess or open()."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from sandbox import (
    ExecResult,
    LocalSandbox,
    LocalSandboxConfig,
    PythonWorker,
    PythonWorkerConfig,
    SandboxError,
    SandboxFileError,
    WorkerExecResult,
)
from tests.sandbox_modes import STRICT, run

T = TypeVar("T")
UID_BASE = 304_000
HUGE_COMMAND = "echo " + "x" * 200_000  # one argument over the kernel's 128 KiB


pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids need root"),
    pytest.mark.timeout(60),
]


@pytest.fixture(params=[STRICT, "basic"])
def isolation(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def root_dir() -> Iterator[Path]:
    root = Path(tempfile.gettempdir()) / f"opd-sandbox-hostile-{os.getpid()}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def config(root_dir: Path, isolation: str) -> LocalSandboxConfig:
    return LocalSandboxConfig(
        isolation=isolation, root_dir=root_dir, uid_base=UID_BASE, uid_count=200
    )


async def outcome(operation: Awaitable[T]) -> T | SandboxError:
    """The result, or the SandboxError raised; any other exception fails the test (as
    does an operation that blocks)."""
    try:
        return await asyncio.wait_for(operation, 15)
    except SandboxError as exc:
        return exc


BAD_COMMANDS: dict[str, dict[str, Any]] = {
    "nul in command": {"cmd": "echo a\0b"},
    "surrogate in command": {"cmd": "echo \ud800"},
    "huge command": {"cmd": HUGE_COMMAND},
    "nul in cwd": {"cmd": "true", "cwd": "a\0b"},
    "nul in env value": {"cmd": "true", "env": {"A": "b\0c"}},
    "= in env name": {"cmd": "true", "env": {"A=B": "c"}},
    "surrogate in env": {"cmd": "true", "env": {"A": "\ud800"}},
}


def test_controls_the_bad_commands_break_a_plain_subprocess() -> None:
    for spec in BAD_COMMANDS.values():
        with pytest.raises((ValueError, OSError)):  # UnicodeEncodeError is a ValueError
            subprocess.run(
                ["bash", "-c", spec["cmd"]],
                cwd=spec.get("cwd"),
                env={**os.environ, **spec.get("env", {})},
                capture_output=True,
                timeout=10,
                check=False,
            )


@pytest.mark.parametrize("case", list(BAD_COMMANDS))
def test_a_command_no_process_can_be_given_fails_with_exit_code_126(
    root_dir: Path, isolation: str, case: str
) -> None:
    async def scenario() -> tuple[ExecResult | SandboxError, ExecResult]:
        async with LocalSandbox(config(root_dir, isolation)) as sandbox:
            return await outcome(sandbox.exec(**BAD_COMMANDS[case], timeout_s=10)), (
                await sandbox.exec("echo still fine", 10)
            )

    result, after = run(scenario())
    assert isinstance(result, ExecResult)
    assert result.exit_code == 126 and "the sandbox cannot run this command" in result.stderr
    assert after.stdout == "still fine\n"


@pytest.fixture(scope="module")
def root_only_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="opd-root-only-"))  # 0700
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("cwd", ["missing", "root-only", "link"])
def test_an_odd_cwd_is_the_commands_failure(
    root_dir: Path, root_only_dir: Path, isolation: str, cwd: str
) -> None:
    async def scenario() -> ExecResult | SandboxError:
        async with LocalSandbox(config(root_dir, isolation)) as sandbox:
            await sandbox.exec(f"ln -s {root_only_dir} link", 10)
            where = str(root_only_dir) if cwd == "root-only" else cwd
            return await outcome(sandbox.exec("pwd", 10, cwd=where))

    result = run(scenario())
    assert isinstance(result, ExecResult) and result.exit_code == 125
    # Closed to the uid in basic mode; not there at all in strict mode.
    assert "Permission denied" in result.stderr or "No such file" in result.stderr


def test_invalid_timeouts_are_the_callers_bug(root_dir: Path) -> None:
    async def scenario() -> None:
        async with LocalSandbox(config(root_dir, "basic")) as sandbox:
            for timeout_s in (0.0, -1.0, float("inf"), float("nan")):
                with pytest.raises(ValueError, match="positive and finite"):
                    await sandbox.exec("true", timeout_s)

    run(scenario())


PLANT = (
    "mkfifo fifo; mkdir dir; printf hi > 'new\nline'; ln -s /etc/shadow shadow; "
    "ln -s /dev/zero zero; ln -s /root rootdir; "
    "python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\""
)
BAD_PATHS = {
    "nul": "a\0b",
    "surrogate": "\ud800",
    "over PATH_MAX": "a/" * 2100 + "b",
    "component over NAME_MAX": "x" * 300,
    "fifo": "fifo",
    "socket": "sock",
    "directory": "dir",
    "device node": "device",
    "symlink to a root-only file": "shadow",
    "symlink to a device": "zero",
    "through a symlink to a root-only dir": "rootdir/.bashrc",
    "under a file": "new\nline/child",
    "the working directory": ".",
    "the root": "/",
    "outside": "../../etc/passwd",
    "absolute outside": "/etc/passwd",
}


@pytest.mark.skipif(not shutil.which("python3"), reason="the planted socket needs python3")
def test_file_transfer_of_hostile_paths_raises_only_file_errors(
    root_dir: Path, isolation: str
) -> None:
    async def scenario() -> tuple[dict[str, Any], bytes, bytes, bytes]:
        async with LocalSandbox(config(root_dir, isolation)) as sandbox:
            planted = await sandbox.exec(PLANT, 10)
            assert planted.exit_code == 0, planted.stderr
            device = sandbox.workdir / "device"
            os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 5))  # a host-made /dev/zero
            with open(device, "rb") as plain:  # control: open() reads zeros from it
                zeros = plain.read(4)
            outcomes: dict[str, Any] = {}
            for name, path in BAD_PATHS.items():
                outcomes[f"read {name}"] = await outcome(sandbox.read_file(path))
                outcomes[f"write {name}"] = await outcome(sandbox.write_file(path, b"planted"))
            await sandbox.write_file("new\nline", b"round trip")
            return (
                outcomes,
                zeros,
                await sandbox.read_file("new\nline"),
                Path("/etc/passwd").read_bytes(),
            )

    outcomes, zeros, newline, passwd = run(scenario())
    assert zeros == bytes(4)
    refused = {op: type(result).__name__ for op, result in outcomes.items()}
    assert set(refused.values()) == {"SandboxFileError"}, refused
    assert newline == b"round trip"  # a newline is just a character of a name
    assert b"planted" not in passwd and Path("/etc/shadow").read_bytes().find(b"planted") < 0


def test_worker_methods_take_hostile_inputs_as_the_cells_failure(
    root_dir: Path, isolation: str
) -> None:
    cfg = PythonWorkerConfig(sandbox=config(root_dir, isolation), preload_modules=[])
    cells: list[dict[str, Any]] = [
        {"cmd": "print('a\0b')"},
        {"cmd": "x = '\ud800'"},
        {"cmd": "x = '" + "y" * 3_000_000 + "'\nlen(x)"},
        {"cmd": "1", "cwd": "a\0b"},
        {"cmd": "1", "cwd": "missing"},
        {"cmd": "1", "env": {"A": "b\0c"}},
        {"cmd": "1", "env": {"A=B": "c"}},
        {"cmd": "1", "env": {"A": "\ud800"}},
    ]

    async def scenario() -> tuple[list[Any], list[Any], WorkerExecResult]:
        async with PythonWorker(cfg) as worker:
            results = [await outcome(worker.exec(**cell, timeout_s=10)) for cell in cells]
            files = [
                await outcome(worker.read_file(path)) for path in ("a\0b", "\ud800", "/etc/passwd")
            ]
            return results, files, await worker.exec("print('fine')", 10)

    results, files, after = run(scenario())
    assert all(isinstance(r, ExecResult) for r in results), results
    assert [r.exit_code for r in results] == [1, 1, 0, 1, 1, 1, 1, 1]
    assert results[2].stdout == "3000000\n"
    assert all(isinstance(f, SandboxFileError) for f in files)
    assert after.stdout == "fine\n" and not after.worker_restarted
