"""LocalSandbox behaviour (results, files, lifecycle, errors) and its building blocks:
the head + tail output buffer, the jail's command line, limit attribution."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import stat
import tempfile
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

import sandbox as sandbox_pkg
from sandbox import (
    ExecResult,
    LocalSandbox,
    LocalSandboxConfig,
    Sandbox,
    SandboxCleanupError,
    SandboxClosedError,
    SandboxDiedError,
    SandboxError,
    SandboxFileError,
    SandboxResourceError,
    SandboxUnavailableError,
)
from sandbox import jail as jail_module
from sandbox import leases as leases_module
from sandbox import local as local_module
from sandbox.jail import Jail, Limits, find_bwrap, limit_from_exit, probe_strict
from sandbox.leases import uid_processes
from sandbox.output import HeadTailBuffer

T = TypeVar("T")
UID_BASE = 300_000
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids need root")


def _strict_problem() -> str | None:
    bwrap = find_bwrap()
    return "bubblewrap is not installed" if bwrap is None else probe_strict(bwrap)


STRICT = pytest.param(
    "strict",
    marks=pytest.mark.skipif(_strict_problem() is not None, reason=f"{_strict_problem()}"),
)
BOTH = [STRICT, pytest.param("basic", marks=needs_root)]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def root_dir() -> Iterator[Path]:
    root = Path(tempfile.gettempdir()) / f"opd-sandbox-local-{os.getpid()}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def config(root_dir: Path, isolation: str, **fields: Any) -> LocalSandboxConfig:
    return LocalSandboxConfig(
        isolation=isolation, root_dir=root_dir, uid_base=UID_BASE, uid_count=200, **fields
    )


# -- output buffer -------------------------------------------------------------------------


def test_short_output_is_kept_whole() -> None:
    buffer = HeadTailBuffer(head_bytes=8, tail_bytes=8)
    for piece in (b"hello ", b"world"):
        buffer.feed(piece)
    assert buffer.text() == "hello world"
    assert not buffer.truncated and buffer.total_bytes == 11


def test_long_output_keeps_head_and_tail_and_says_what_was_cut() -> None:
    buffer = HeadTailBuffer(head_bytes=4, tail_bytes=4)
    for piece in (b"AB", b"CDxxxx", b"xxxxxx", b"xWX", b"YZ"):
        buffer.feed(piece)
    assert buffer.truncated and buffer.total_bytes == 19
    assert buffer.text() == "ABCD\n[... 11 bytes of output omitted ...]\nWXYZ"


def test_a_hundred_megabytes_through_the_buffer_keeps_only_head_and_tail() -> None:
    buffer = HeadTailBuffer(head_bytes=64 * 1024, tail_bytes=64 * 1024)
    chunk = bytes(range(256)) * 256  # 64 KiB
    for _ in range(1600):
        buffer.feed(chunk)
    assert buffer.total_bytes == 1600 * len(chunk)
    assert buffer.kept_bytes == 128 * 1024
    buffer.feed(b"END")
    assert buffer.text().endswith("END")


def test_invalid_utf8_is_replaced_not_raised() -> None:
    buffer = HeadTailBuffer(head_bytes=16, tail_bytes=0)
    buffer.feed(b"ok \xff\xfe")
    assert buffer.text() == "ok \ufffd\ufffd"


# -- limit attribution ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exit_code", "stderr", "limit"),
    [
        (128 + signal.SIGXFSZ, "", "file_size"),
        (128 + signal.SIGXCPU, "", "cpu_time"),
        (1, "Traceback ...\nMemoryError\n", "memory"),
        (1, "bash: fork: retry: Resource temporarily unavailable\n", "processes"),
        (0, "MemoryError mentioned by a passing test\n", None),
        (1, "AssertionError\n", None),
    ],
)
def test_limit_is_attributed_from_signal_or_error(exit_code: int, stderr: str, limit: str) -> None:
    assert limit_from_exit(exit_code, stderr) == limit


# -- jail command line ---------------------------------------------------------------------


def test_strict_command_line_confines_namespaces_mounts_and_uid(tmp_path: Path) -> None:
    workdir = tmp_path / "opd" / "work-200007"
    jail = Jail("strict", 200_007, workdir, [Path("/opt/py/lib"), Path("/usr/lib/x")], 32, "bwrap")
    limits = Limits(memory_mb=256, max_processes=64, file_size_mb=32, open_files=128, cpu_s=3)
    argv = jail.argv(["/bin/bash", "-c", "true"], limits)
    joined = " ".join(argv)

    assert argv[0] == "prlimit"
    for flag in ("--as=268435456", "--fsize=33554432", "--nofile=128", "--nproc=64", "--cpu=3:4"):
        assert flag in argv
    bwrap = argv.index("bwrap")
    for flag in ("--unshare-net", "--unshare-pid", "--die-with-parent", "--new-session"):
        assert flag in argv[bwrap:]
    assert "--ro-bind / /" not in joined and "--bind / /" not in joined
    assert "--ro-bind /opt/py/lib /opt/py/lib" in joined
    assert "/usr/lib/x" not in joined  # already visible through /usr
    assert "--perms 0755 --dir /opt --perms 0755 --dir /opt/py" in joined
    assert f"--bind {workdir} /sandbox --chdir /sandbox" in joined
    # a read-only path under /sandbox would be hidden by it: the host path is kept then
    nested = Jail("strict", 200_007, workdir, [Path("/sandbox/py")], 32, "bwrap")
    assert f"--bind {workdir} {workdir}" in " ".join(nested.argv(["true"], limits))
    assert f"--size {32 * 1024 * 1024} --tmpfs /tmp" in joined
    setpriv = argv.index("setpriv")
    assert argv[setpriv : setpriv + 4] == [
        "setpriv",
        "--reuid=200007",
        "--regid=200007",
        "--clear-groups",
    ]
    assert argv[-3:] == ["/bin/bash", "-c", "true"]


def test_basic_command_line_runs_as_the_uid_without_privileges(tmp_path: Path) -> None:
    jail = Jail("basic", 200_008, tmp_path, [], 32, None)
    limits = Limits(memory_mb=256, max_processes=64, file_size_mb=32, open_files=128)
    argv = jail.argv(["true"], limits)
    assert argv[0] == "prlimit" and "bwrap" not in argv
    assert argv[-4:] == ["setpriv", "--no-new-privs", "--", "true"]
    kwargs = jail.spawn_kwargs()
    assert (kwargs["user"], kwargs["group"], kwargs["extra_groups"]) == (200_008, 200_008, [])
    assert kwargs["start_new_session"] is True


def test_a_privileged_start_leaves_the_drop_to_the_command(tmp_path: Path) -> None:
    """Only the python worker asks for it: it drops to the uid itself (basic mode)."""
    basic = Jail("basic", 200_008, tmp_path, [], 32, None).spawn_kwargs(privileged_start=True)
    assert "user" not in basic and basic["start_new_session"] is True
    strict = Jail("strict", 200_008, tmp_path, [], 32, "bwrap")
    assert strict.spawn_kwargs(privileged_start=True) == strict.spawn_kwargs()


def test_without_a_sandbox_uid_there_is_no_process_cap(tmp_path: Path) -> None:
    """As the host's own user, RLIMIT_NPROC would count all that user's processes."""
    limits = Limits(memory_mb=256, max_processes=64, file_size_mb=32, open_files=128)
    assert not any(a.startswith("--nproc") for a in Jail("basic", None, tmp_path).argv([], limits))


# -- bubblewrap missing --------------------------------------------------------------------


@pytest.fixture()
def no_bwrap(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(jail_module.shutil, "which", lambda name: None)
    find_bwrap.cache_clear()
    local_module.warn_once.cache_clear()
    yield
    monkeypatch.undo()
    find_bwrap.cache_clear()
    local_module.warn_once.cache_clear()


@needs_root
def test_missing_bwrap_is_said_once_loudly_and_strict_is_refused(
    no_bwrap: None, root_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    with pytest.raises(SandboxUnavailableError, match="bubblewrap"):
        run(LocalSandbox(config(root_dir, "strict")).start())

    async def two_auto_sandboxes() -> list[str]:
        isolations = []
        for _ in range(2):
            async with LocalSandbox(config(root_dir, "auto")) as sandbox:
                isolations.append(sandbox.isolation)
        return isolations

    assert run(two_auto_sandboxes()) == ["basic", "basic"]
    missing = [r for r in caplog.records if "not installed" in r.getMessage()]
    assert len(missing) == 1 and missing[0].levelno == logging.WARNING
    assert "apt-get install bubblewrap" in missing[0].getMessage()


# -- behaviour -----------------------------------------------------------------------------


def test_default_local_sandbox_works() -> None:
    async def scenario() -> tuple[ExecResult, bool]:
        sandbox = LocalSandbox()
        assert isinstance(sandbox, Sandbox)
        async with sandbox:
            result = await sandbox.exec("echo hi; echo oops >&2; exit 3", timeout_s=10)
        return result, await sandbox.is_alive()

    result, alive_after_close = run(scenario())
    assert (result.exit_code, result.stdout, result.stderr) == (3, "hi\n", "oops\n")
    assert not result.ok and not result.timed_out and result.limit_hit is None
    assert 0 < result.duration_s < 10
    assert not alive_after_close


@pytest.mark.parametrize("isolation", BOTH)
def test_commands_run_as_the_sandbox_uid_in_its_workdir_with_a_scrubbed_env(
    root_dir: Path, isolation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPD_HOST_ONLY", "1")

    async def scenario() -> tuple[ExecResult, ExecResult, int | None, Path]:
        cfg = config(root_dir, isolation, env={"FROM_CONFIG": "c"})
        async with LocalSandbox(cfg) as sandbox:
            env = await sandbox.exec("id -u; pwd; env", 10, env={"FROM_CALL": "x"})
            await sandbox.exec("mkdir -p sub/dir", 10)
            where = await sandbox.exec("pwd", 10, cwd="sub/dir")
            return env, where, sandbox.uid, sandbox.visible_workdir

    env, where, uid, workdir = run(scenario())
    # strict: the same path in every sandbox, so what commands print does not name the slot
    assert (str(workdir) == "/sandbox") == (isolation == "strict")
    lines = env.stdout.splitlines()
    assert lines[0] == str(uid) and lines[1] == str(workdir)
    variables = dict(line.split("=", 1) for line in lines[2:] if "=" in line)
    assert variables["FROM_CALL"] == "x" and variables["FROM_CONFIG"] == "c"
    assert variables["HOME"] == str(workdir)
    assert "OPD_HOST_ONLY" not in variables
    assert where.stdout.strip() == str(workdir / "sub" / "dir")


# An edit that keeps the file's size, with its mtime in the same second as the import
# before it: a .pyc written by that import would be trusted, and the edit not run.
STALE_BYTECODE_SCRIPT = (
    "printf 'X = 1\\n' > m.py && touch -r m.py stamp && python3 -c 'import m; print(m.X)' && "
    "printf 'X = 2\\n' > m.py && touch -r stamp m.py && python3 -c 'import m; print(m.X)'; "
    "ls -a"
)


def assert_ran_the_edit(result: ExecResult) -> None:
    """STALE_BYTECODE_SCRIPT's second import ran the edit, and no bytecode was written."""
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[:2] == ["1", "2"]
    assert "__pycache__" not in result.stdout.split()


@pytest.mark.parametrize("isolation", BOTH)
def test_python_runs_an_edit_made_in_the_second_of_an_earlier_import(
    root_dir: Path, isolation: str
) -> None:
    """No command's result depends on timing through Python's bytecode cache
    (sandbox.base.STEADY_PYTHON_ENV)."""
    assert_ran_the_edit(run(_exec_once(config(root_dir, isolation), STALE_BYTECODE_SCRIPT, 30)))


@pytest.mark.parametrize("isolation", BOTH)
def test_deadline_kills_the_command_and_reports_it(root_dir: Path, isolation: str) -> None:
    result = run(_exec_once(config(root_dir, isolation), "echo started; sleep 30", 0.5))
    assert result.timed_out and result.limit_hit == "wall_time" and result.exit_code == 137
    assert result.stdout == "started\n"
    assert 0.5 <= result.duration_s < 3.0


async def _exec_once(cfg: LocalSandboxConfig, cmd: str, timeout_s: float) -> ExecResult:
    async with LocalSandbox(cfg) as sandbox:
        return await sandbox.exec(cmd, timeout_s)


@pytest.mark.parametrize("isolation", BOTH)
def test_files_round_trip_owned_by_the_sandbox(root_dir: Path, isolation: str) -> None:
    async def scenario() -> tuple[bytes, ExecResult, os.stat_result, int | None]:
        async with LocalSandbox(config(root_dir, isolation)) as sandbox:
            await sandbox.write_file("pkg/mod.py", b"VALUE = 7\n")
            await sandbox.write_file(str(sandbox.workdir / "abs.txt"), b"absolute")
            seen = await sandbox.exec("cat pkg/mod.py abs.txt; echo more >> abs.txt", 10)
            info = (sandbox.workdir / "pkg" / "mod.py").stat()
            return await sandbox.read_file("abs.txt"), seen, info, sandbox.uid

    data, seen, info, uid = run(scenario())
    assert seen.stdout == "VALUE = 7\nabsolute" and seen.exit_code == 0
    assert data == b"absolutemore\n"  # the sandbox could write the file it was given
    assert info.st_uid == uid and stat.S_IMODE(info.st_mode) == 0o644


@needs_root
def test_file_paths_outside_the_workdir_and_oversized_reads_are_refused(root_dir: Path) -> None:
    async def scenario() -> list[str]:
        cfg = config(root_dir, "auto", max_read_file_mb=1)
        async with LocalSandbox(cfg) as sandbox:
            await sandbox.exec("head -c 2M /dev/zero > big.bin", 10)
            refusals = []
            for op in (
                sandbox.read_file("missing.txt"),
                sandbox.read_file("/etc/hostname"),
                sandbox.read_file("a/../../x"),
                sandbox.write_file("", b"x"),
                sandbox.read_file("big.bin"),
            ):
                with pytest.raises(SandboxFileError) as refused:
                    await op
                refusals.append(str(refused.value))
            return refusals

    missing, outside, dotdot, empty, big = run(scenario())
    assert "No such file" in missing
    assert "outside the working directory" in outside
    assert "inside the working directory" in dotdot and "inside the working directory" in empty
    assert "over the 1,048,576 limit" in big


@needs_root
def test_close_kills_background_work_and_removes_the_workdir(root_dir: Path) -> None:
    async def scenario() -> tuple[int, Path, int]:
        sandbox = LocalSandbox(config(root_dir, "basic"))
        await sandbox.start()
        await sandbox.exec("nohup sleep 60 >/dev/null 2>&1 &", 10)
        assert sandbox.uid is not None
        uid, workdir, running = sandbox.uid, sandbox.workdir, len(uid_processes(sandbox.uid))
        await sandbox.close()
        with pytest.raises(SandboxClosedError):
            await sandbox.exec("true", 10)
        await sandbox.close()  # idempotent
        return running, workdir, len(uid_processes(uid, include_zombies=False))

    running_before, workdir, running_after = run(scenario())
    assert running_before == 1  # basic mode: background work outlives its command ...
    assert running_after == 0  # ... until close()
    assert not workdir.exists()


@needs_root
def test_two_sandboxes_get_different_uids_and_workdirs(root_dir: Path) -> None:
    async def scenario() -> tuple[tuple[int | None, Path], tuple[int | None, Path]]:
        async with (
            LocalSandbox(config(root_dir, "auto")) as a,
            LocalSandbox(config(root_dir, "auto")) as b,
        ):
            return (a.uid, a.workdir), (b.uid, b.workdir)

    (uid_a, dir_a), (uid_b, dir_b) = run(scenario())
    assert uid_a != uid_b and dir_a != dir_b
    assert uid_a is not None and UID_BASE <= uid_a < UID_BASE + 200


@needs_root
def test_exhausted_uid_range_is_a_resource_error(root_dir: Path) -> None:
    async def scenario() -> None:
        cfg = config(root_dir, "basic").model_copy(update={"uid_base": 300_500, "uid_count": 1})
        async with LocalSandbox(cfg):
            await LocalSandbox(cfg).start()

    with pytest.raises(SandboxResourceError, match="in use"):
        run(scenario())


@needs_root
@pytest.mark.parametrize(
    "failure", [PermissionError(1, "Operation not permitted"), RecursionError()]
)
def test_a_failed_teardown_is_a_cleanup_error_and_still_frees_the_uid(
    root_dir: Path, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    def cannot_remove(path: Path) -> None:
        raise failure

    async def scenario() -> str:
        cfg = config(root_dir, "basic").model_copy(update={"uid_base": 300_501, "uid_count": 1})
        sandbox = LocalSandbox(cfg)
        await sandbox.start()
        monkeypatch.setattr(leases_module, "remove_tree", cannot_remove)
        with pytest.raises(SandboxCleanupError):
            await sandbox.close()
        monkeypatch.undo()
        async with LocalSandbox(cfg) as again:  # the range's only uid was freed
            return (await again.exec("echo reused", 5)).stdout

    assert run(scenario()) == "reused\n"


@pytest.mark.parametrize("isolation", [STRICT])
def test_a_sandbox_that_cannot_launch_raises_instead_of_returning_a_result(
    root_dir: Path, isolation: str, tmp_path: Path
) -> None:
    extra = tmp_path / "tools"
    extra.mkdir()

    async def scenario() -> None:
        async with LocalSandbox(config(root_dir, isolation, ro_paths=[extra])) as sandbox:
            assert (await sandbox.exec("true", 10)).exit_code == 0
            extra.rmdir()  # the mount source vanishes: bwrap cannot build the sandbox
            await sandbox.exec("true", 10)

    with pytest.raises(SandboxDiedError, match="bubblewrap could not run") as raised:
        run(scenario())
    assert isinstance(raised.value, SandboxError)


def test_public_names_are_exported() -> None:
    for name in ("ExecResult", "SandboxError", "LocalSandbox", "PythonWorker"):
        assert hasattr(sandbox_pkg, name)
    assert issubclass(SandboxUnavailableError, SandboxError)
