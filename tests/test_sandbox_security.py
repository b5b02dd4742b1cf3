"""Attacks a model's code could make, each run twice: in a plain subprocess (the positive
control: the attack works, so the test can fail) and in a LocalSandbox (the specific
outcome the sandbox promises). Attacks and controls are bounded (300 processes against a
cap of 64, 512 MiB against 256 MiB, 128 MiB on disk, 100 MB of output, short deadlines),
so a broken sandbox cannot hurt the machine running the suite.

Most cases run under both isolation levels; host files and the host network are hidden
only by bubblewrap ('strict'). The last test checks the host after all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from sandbox import ExecResult, LocalSandbox, LocalSandboxConfig, PythonWorker, PythonWorkerConfig
from sandbox.base import SandboxFileError, SandboxResourceError
from sandbox.leases import remove_tree, uid_processes
from tests.sandbox_modes import STRICT, run

T = TypeVar("T")
PY = "/usr/bin/python3"
"""Attacks are python scripts run by the system interpreter (visible in both modes)."""
UID_BASE = 301_000
UID_COUNT = 200
SECRET = "opd-host-secret-4f1c9a"

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids need the host to be root"),
    pytest.mark.skipif(not os.path.exists(PY), reason=f"attack scripts need {PY}"),
]


BOTH = [STRICT, "basic"]


@pytest.fixture(scope="module")
def root_dir() -> Iterator[Path]:
    # Not under pytest's 0700 tmp dirs: basic-mode uids must be able to reach their dirs.
    root = Path(tempfile.gettempdir()) / f"opd-sandbox-security-{os.getpid()}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture()
def host_dir() -> Iterator[Path]:
    """A world-readable host directory holding a world-readable secret: only a sandbox
    that hides the host file system (or a uid check) keeps it from other users."""
    path = Path(tempfile.mkdtemp(prefix="opd-host-"))
    path.chmod(0o755)
    secret = path / "host_secret.txt"
    secret.write_text(SECRET)
    secret.chmod(0o644)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def config(root_dir: Path, isolation: str, **limits: Any) -> LocalSandboxConfig:
    return LocalSandboxConfig(
        isolation=isolation, root_dir=root_dir, uid_base=UID_BASE, uid_count=UID_COUNT, **limits
    )


async def sandboxed(cfg: LocalSandboxConfig, cmd: str, timeout_s: float = 20.0) -> ExecResult:
    async with LocalSandbox(cfg) as sandbox:
        return await sandbox.exec(cmd, timeout_s)


def plain(cmd: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """The control: the same command as an ordinary subprocess of the host."""
    return subprocess.run(
        ["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout_s, check=False
    )


def live_processes(uid: int, settle_s: float = 2.0) -> list[int]:
    """Processes of `uid` still alive after `settle_s` (SIGKILL is delivered
    asynchronously: a killed process may still be on its way out for a moment)."""
    deadline = time.monotonic() + settle_s
    while (left := uid_processes(uid, include_zombies=False)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def python_attack(script: str, *args: object) -> str:
    return shlex.join([PY, "-c", script, *map(str, args)])


FORK_ATTACK = """
import os, time
children = []
try:
    for _ in range(300):
        pid = os.fork()
        if pid == 0:
            time.sleep(20)
            os._exit(0)
        children.append(pid)
finally:
    print(len(children), flush=True)
    for pid in children:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
"""

MEMORY_ATTACK = """
import sys
size = int(sys.argv[1]) * 1024 * 1024
block = bytearray(size)
block[::4096] = b"x" * len(range(0, size, 4096))
print("allocated", len(block))
"""


# -- host file system ----------------------------------------------------------------------


@pytest.mark.parametrize("isolation", [STRICT])
def test_planted_host_file_outside_the_workdir_is_unreadable(
    root_dir: Path, host_dir: Path, isolation: str
) -> None:
    attack = f"cat {host_dir}/host_secret.txt; ls {host_dir}"
    control = plain(attack)
    assert control.returncode == 0 and SECRET in control.stdout

    result = run(sandboxed(config(root_dir, isolation), attack))
    assert SECRET not in result.stdout
    assert "No such file or directory" in result.stderr
    assert result.exit_code != 0


@pytest.mark.parametrize("isolation", [STRICT])
def test_host_file_system_is_not_writable(root_dir: Path, host_dir: Path, isolation: str) -> None:
    target = host_dir / "planted_by_sandbox.txt"
    prefix_target = Path(sys.prefix) / "planted_by_sandbox.txt"
    attack = f"echo pwned > {target}; echo pwned > {prefix_target}"
    control = plain(attack)
    assert control.returncode == 0 and target.exists() and prefix_target.exists()
    target.unlink()
    prefix_target.unlink()

    result = run(sandboxed(config(root_dir, isolation), attack))
    assert result.exit_code != 0
    assert "Read-only file system" in result.stderr  # the visible interpreter prefix
    assert not target.exists() and not prefix_target.exists()


@pytest.mark.parametrize("isolation", BOTH)
def test_file_transfer_does_not_follow_sandbox_planted_links(
    root_dir: Path, host_dir: Path, isolation: str
) -> None:
    secret = host_dir / "host_secret.txt"

    async def scenario() -> tuple[str, list[str], str]:
        async with LocalSandbox(config(root_dir, isolation)) as sandbox:
            await sandbox.exec(f"ln -s {secret} file_link; ln -s {host_dir} dir_link", 10)
            # Control: a host-side open() of the same path, as root, follows the link.
            naive = (sandbox.workdir / "file_link").read_text()
            refusals = []
            for op in (
                sandbox.read_file("file_link"),
                sandbox.read_file("dir_link/host_secret.txt"),
                sandbox.write_file("file_link", b"overwritten"),
                sandbox.write_file("dir_link/new.txt", b"planted"),
                sandbox.read_file(str(secret)),
                sandbox.read_file("../../etc/passwd"),
            ):
                with pytest.raises(SandboxFileError) as refused:
                    await op
                refusals.append(str(refused.value))
            listing = (await sandbox.exec("ls", 10)).stdout
            return naive, refusals, listing

    naive, refusals, listing = run(scenario())
    assert naive == SECRET
    assert len(refusals) == 6
    assert "symlink" in refusals[0] and "outside the working directory" in refusals[4]
    assert secret.read_text() == SECRET and not (host_dir / "new.txt").exists()
    assert "file_link" in listing


@pytest.mark.parametrize("isolation", BOTH)
def test_read_file_refuses_a_fifo_instead_of_blocking(root_dir: Path, isolation: str) -> None:
    async def scenario() -> tuple[bool, str]:
        async with LocalSandbox(config(root_dir, isolation)) as sandbox:
            await sandbox.exec("mkfifo trap", 10)
            fifo = sandbox.workdir / "trap"
            # Control: a plain open() of the FIFO blocks until a writer appears.
            opened = threading.Event()
            reader = threading.Thread(target=lambda: (open(fifo).close(), opened.set()))
            reader.start()
            blocked = not opened.wait(0.5)
            with open(fifo, "w"):
                pass
            reader.join(5)
            with pytest.raises(SandboxFileError) as refused:
                await asyncio.wait_for(sandbox.read_file("trap"), 5)
            return blocked, str(refused.value)

    blocked, refusal = run(scenario())
    assert blocked
    assert "not a regular file" in refusal


# -- network -------------------------------------------------------------------------------


@pytest.mark.parametrize("isolation", [STRICT])
def test_host_loopback_listener_is_unreachable(root_dir: Path, isolation: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        attack = f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected"
        control = plain(attack)
        assert control.returncode == 0 and "connected" in control.stdout

        result = run(sandboxed(config(root_dir, isolation), attack))
    assert "connected" not in result.stdout
    assert "Connection refused" in result.stderr
    assert result.exit_code != 0


@pytest.mark.parametrize("isolation", [STRICT])
def test_host_abstract_unix_socket_is_unreachable(root_dir: Path, isolation: str) -> None:
    name = f"opd-sandbox-test-{os.getpid()}"
    connect = "import socket, sys\nsocket.socket(socket.AF_UNIX).connect('\\0' + sys.argv[1])\n"
    attack = python_attack(connect + "print('connected')", name)
    with socket.socket(socket.AF_UNIX) as server:
        server.bind("\0" + name)
        server.listen()
        control = plain(attack)
        assert control.returncode == 0 and "connected" in control.stdout

        result = run(sandboxed(config(root_dir, isolation), attack))
    assert "connected" not in result.stdout
    assert "ConnectionRefusedError" in result.stderr


# -- resource limits -----------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("isolation", BOTH)
def test_fork_bomb_stops_at_the_process_cap(root_dir: Path, isolation: str) -> None:
    attack = python_attack(FORK_ATTACK)
    control = plain(attack)
    assert control.returncode == 0, control.stderr
    assert int(control.stdout) == 300

    result = run(sandboxed(config(root_dir, isolation, max_processes=64), attack))
    assert result.exit_code == 1
    assert 0 < int(result.stdout) < 64
    assert "Resource temporarily unavailable" in result.stderr
    assert result.limit_hit == "processes"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("isolation", BOTH)
def test_classic_fork_bomb_is_contained_and_cleaned_up(root_dir: Path, isolation: str) -> None:
    """The unbounded bomb never runs outside the sandbox; its control is the bounded one
    above. Here: it ends at the deadline and leaves no process behind."""

    async def scenario() -> tuple[ExecResult, list[int]]:
        cfg = config(root_dir, isolation, max_processes=32)
        async with LocalSandbox(cfg) as sandbox:
            result = await sandbox.exec(":(){ :|:& };:; sleep 30", timeout_s=2)
            assert sandbox.uid is not None
            return result, await asyncio.to_thread(live_processes, sandbox.uid)

    result, left = run(scenario())
    assert result.timed_out and result.limit_hit == "wall_time"
    assert left == []


@pytest.mark.parametrize("isolation", BOTH)
def test_memory_bomb_stops_at_the_address_space_cap(root_dir: Path, isolation: str) -> None:
    control = plain(python_attack(MEMORY_ATTACK, 512))
    assert control.returncode == 0 and "allocated 536870912" in control.stdout

    async def scenario() -> tuple[ExecResult, ExecResult]:
        async with LocalSandbox(config(root_dir, isolation, memory_mb=256)) as sandbox:
            small = await sandbox.exec(python_attack(MEMORY_ATTACK, 64), 20)
            bomb = await sandbox.exec(python_attack(MEMORY_ATTACK, 512), 20)
            return small, bomb

    small, bomb = run(scenario())
    assert small.exit_code == 0 and "allocated 67108864" in small.stdout  # cap is not too low
    assert bomb.exit_code == 1
    assert "MemoryError" in bomb.stderr and "allocated" not in bomb.stdout
    assert bomb.limit_hit == "memory"


@pytest.mark.parametrize("isolation", BOTH)
def test_disk_fill_stops_at_the_file_size_cap(
    root_dir: Path, host_dir: Path, isolation: str
) -> None:
    control = plain(f"head -c 128M /dev/zero > {host_dir}/fill.bin")
    assert control.returncode == 0
    assert (host_dir / "fill.bin").stat().st_size == 128 * 1024 * 1024
    (host_dir / "fill.bin").unlink()

    async def scenario() -> tuple[ExecResult, int]:
        async with LocalSandbox(config(root_dir, isolation, file_size_mb=32)) as sandbox:
            result = await sandbox.exec("head -c 128M /dev/zero > fill.bin", 20)
            return result, (sandbox.workdir / "fill.bin").stat().st_size

    result, size = run(scenario())
    assert result.exit_code == 128 + signal.SIGXFSZ
    assert result.limit_hit == "file_size"
    assert size == 32 * 1024 * 1024


@pytest.mark.parametrize("isolation", [STRICT])
def test_private_tmp_stops_at_its_size(root_dir: Path, isolation: str) -> None:
    control = plain("head -c 32M /dev/zero > /tmp/opd-tmp-fill-control && echo ok")
    assert control.returncode == 0 and "ok" in control.stdout
    os.unlink("/tmp/opd-tmp-fill-control")

    cfg = config(root_dir, isolation, tmp_size_mb=16, file_size_mb=64)
    result = run(sandboxed(cfg, "head -c 32M /dev/zero > /tmp/fill && echo ok"))
    assert "No space left on device" in result.stderr
    assert result.exit_code != 0 and "ok" not in result.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("isolation", BOTH)
def test_infinite_loop_is_killed_at_the_deadline_with_its_escaped_children(
    root_dir: Path, isolation: str
) -> None:
    attack = "setsid bash -c 'while :; do :; done' & while :; do :; done"
    control = subprocess.Popen(["bash", "-c", "while :; do :; done"])
    try:
        time.sleep(1.0)
        assert control.poll() is None  # nothing stops it by itself
    finally:
        control.kill()
        control.wait()

    async def scenario() -> tuple[ExecResult, list[int]]:
        async with LocalSandbox(config(root_dir, isolation)) as sandbox:
            result = await sandbox.exec(attack, timeout_s=1.0)
            assert sandbox.uid is not None
            return result, await asyncio.to_thread(live_processes, sandbox.uid)

    result, left = run(scenario())
    assert result.timed_out and result.limit_hit == "wall_time"
    assert result.exit_code == 137
    assert 1.0 <= result.duration_s < 4.0
    assert left == []  # the setsid child is gone too, before close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("isolation", BOTH)
def test_output_flood_is_cut_at_the_output_cap(root_dir: Path, isolation: str) -> None:
    flood = "head -c 100M /dev/zero | tr '\\0' x"
    with subprocess.Popen(["bash", "-c", flood], stdout=subprocess.PIPE) as control:
        assert control.stdout is not None
        received = sum(len(chunk) for chunk in iter(lambda: control.stdout.read(1 << 20), b""))
    assert received == 100 * 1024 * 1024

    cfg = config(root_dir, isolation, max_output_mb=8, output_head_kb=16, output_tail_kb=16)
    result = run(sandboxed(cfg, flood))
    assert result.limit_hit == "output" and result.exit_code == 137
    assert result.stdout_truncated
    assert 8 * 1024 * 1024 < result.stdout_bytes < 100 * 1024 * 1024
    assert len(result.stdout) < 33 * 1024 + 200
    assert result.stdout.startswith("x" * 1000) and result.stdout.endswith("x" * 1000)
    assert "bytes of output omitted" in result.stdout


# -- secrets and other sandboxes -----------------------------------------------------------


@pytest.mark.parametrize("isolation", BOTH)
def test_host_environment_secrets_are_invisible(
    root_dir: Path, isolation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPD_SANDBOX_TEST_SECRET", SECRET)
    attack = f"env; cat /proc/{os.getpid()}/environ; cat /proc/*/environ 2>/dev/null; true"
    control = plain(attack)
    assert SECRET in control.stdout

    result = run(sandboxed(config(root_dir, isolation), attack))
    assert result.exit_code == 0
    assert "PATH=" in result.stdout  # the scrubbed environment is there
    assert SECRET not in result.stdout and SECRET not in result.stderr


@pytest.mark.parametrize("isolation", BOTH)
def test_a_sandbox_cannot_read_or_write_another_sandboxs_files(
    root_dir: Path, isolation: str
) -> None:
    async def scenario() -> tuple[subprocess.CompletedProcess[str], ExecResult, Path]:
        cfg = config(root_dir, isolation)
        async with LocalSandbox(cfg) as victim, LocalSandbox(cfg) as attacker:
            await victim.exec(f"echo {SECRET} > secret.txt; chmod 666 secret.txt", 10)
            target = victim.workdir / "secret.txt"
            attack = f"cat {target}; echo tampered > {target}; ls {victim.workdir}"
            control = await asyncio.to_thread(plain, f"cat {target}")
            result = await attacker.exec(attack, 10)
            assert (await victim.read_file("secret.txt")).decode().strip() == SECRET
            return control, result, target

    control, result, _ = run(scenario())
    assert SECRET in control.stdout
    assert SECRET not in result.stdout
    assert result.exit_code != 0


def _wait_for_process(uid: int, name: str, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in uid_processes(uid):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                    return pid
            except FileNotFoundError:
                continue
        time.sleep(0.02)
    raise AssertionError(f"no {name!r} process of uid {uid} appeared")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("isolation", BOTH)
def test_a_sandbox_cannot_kill_another_sandboxs_processes(root_dir: Path, isolation: str) -> None:
    async def scenario() -> tuple[ExecResult, bool, subprocess.CompletedProcess[str], ExecResult]:
        cfg = config(root_dir, isolation)
        async with LocalSandbox(cfg) as victim, LocalSandbox(cfg) as attacker:
            running = asyncio.create_task(victim.exec("sleep 30", timeout_s=40))
            assert victim.uid is not None
            pid = await asyncio.to_thread(_wait_for_process, victim.uid, "sleep")
            attack = await attacker.exec(f"kill -9 {pid}", 10)
            alive = Path(f"/proc/{pid}").exists()
            control = await asyncio.to_thread(plain, f"kill -9 {pid}")
            victim_result = await asyncio.wait_for(running, 10)
            return attack, alive, control, victim_result

    attack, alive_after_attack, control, victim_result = run(scenario())
    assert attack.exit_code != 0
    assert "No such process" in attack.stderr or "Operation not permitted" in attack.stderr
    assert alive_after_attack
    assert control.returncode == 0
    assert victim_result.exit_code == 137 and not victim_result.timed_out  # the control's kill


@pytest.mark.parametrize("isolation", [STRICT])
def test_python_worker_cells_see_neither_host_files_nor_host_network(
    root_dir: Path, host_dir: Path, isolation: str
) -> None:
    read_cell = f"print(open({str(host_dir / 'host_secret.txt')!r}).read())"
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        connect_cell = (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "print('connected')"
        )
        for cell in (read_cell, connect_cell):
            control = plain(shlex.join([PY, "-c", cell]))
            assert control.returncode == 0, control.stderr
        assert SECRET in plain(shlex.join([PY, "-c", read_cell])).stdout

        async def scenario() -> tuple[ExecResult, ExecResult]:
            cfg = PythonWorkerConfig(sandbox=config(root_dir, isolation), preload_modules=[])
            async with PythonWorker(cfg) as worker:
                return await worker.exec(read_cell, 10), await worker.exec(connect_cell, 10)

        read, connect = run(scenario())
    assert "FileNotFoundError" in read.stderr and SECRET not in read.stdout
    assert "connected" not in connect.stdout and connect.exit_code == 1


# -- teardown ------------------------------------------------------------------------------

TREE_ATTACK = """
import os
os.makedirs("locked/inner")
open("locked/inner/file", "w").close()
os.chmod("locked", 0)
os.symlink("/etc", "etc-link")
for _ in range(5000):
    os.mkdir("d")
    os.chdir("d")
open("bottom", "w").close()
print("built", flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("isolation", BOTH)
def test_close_removes_a_tree_5000_levels_deep_and_frees_the_uid(
    root_dir: Path, isolation: str
) -> None:
    # A range of one uid: the second sandbox starts only if close() freed it.
    cfg = config(root_dir, isolation).model_copy(
        update={"uid_base": UID_BASE + UID_COUNT - 2, "uid_count": 1}
    )

    async def scenario() -> tuple[Path, str]:
        sandbox = LocalSandbox(cfg)
        await sandbox.start()
        workdir = sandbox.workdir
        built = await sandbox.exec(python_attack(TREE_ATTACK), 30)
        assert built.stdout == "built\n", built.stderr
        await sandbox.close()
        async with LocalSandbox(cfg) as again:
            return workdir, (await again.exec("echo reused", 5)).stdout

    workdir, reused = run(scenario())
    assert reused == "reused\n"
    assert not workdir.exists()
    assert Path("/etc/passwd").is_file()  # the planted link was unlinked, not followed


@pytest.mark.timeout(60)
def test_a_uid_held_only_by_unreaped_exited_processes_is_waited_for_not_refused(
    root_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a basic sandbox's orphans leave when they exit are zombies of the host's init,
    which may reap them seconds later (this machine's every ~2 s; `sleep infinity` as a
    container's pid 1 never): with no other uid free, the start waits for the reaping
    instead of failing, and says why when it never comes (the control: no wait)."""
    from sandbox import leases

    uid = UID_BASE + UID_COUNT - 6
    cfg = config(root_dir, "basic").model_copy(update={"uid_base": uid, "uid_count": 1})
    pid = os.fork()
    if pid == 0:  # a process of the uid that exits and is not reaped until we say so
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
            uid_processes(uid) == [pid] and not uid_processes(uid, include_zombies=False)
        ):
            time.sleep(0.01)
        assert uid_processes(uid) == [pid]  # the zombie
        assert uid_processes(uid, include_zombies=False) == []

        monkeypatch.setattr(leases, "ZOMBIE_WAIT_S", 0.0)
        with pytest.raises(SandboxResourceError, match=r"did not reap in 0 s.*--init"):
            run(LocalSandbox(cfg).start())
        monkeypatch.undo()

        reaper = threading.Timer(0.5, os.waitpid, (pid, 0))
        reaper.start()
        began = time.monotonic()

        async def scenario() -> str:
            async with LocalSandbox(cfg) as sandbox:
                return (await sandbox.exec("echo started", 5)).stdout

        assert run(scenario()) == "started\n"
        assert time.monotonic() - began >= 0.45
        reaper.join()
    finally:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _as_uid(uid: int, action: Callable[[], None]) -> int:
    """Run `action` in a child process holding only `uid`'s rights (a host that is not
    root, whose sandboxes run as its own user); the child's exit code."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            action()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_teardown_without_root_opens_up_locked_directories_and_never_follows_links(
    host_dir: Path,
) -> None:
    uid = UID_BASE + UID_COUNT - 3
    base = Path(tempfile.mkdtemp(prefix="opd-teardown-"))
    os.chown(base, uid, uid)
    workdir = base / "work"

    def build_and_remove() -> None:
        (workdir / "locked" / "inner").mkdir(parents=True)
        (workdir / "locked" / "inner" / "file").write_text("x")
        (workdir / "readonly").mkdir()
        (workdir / "readonly" / "file").write_text("x")
        (workdir / "host-link").symlink_to(host_dir)
        (workdir / "locked").chmod(0)
        (workdir / "readonly").chmod(0o500)
        remove_tree(workdir)
        assert not workdir.exists()

    try:
        assert _as_uid(uid, build_and_remove) == 0
        assert (host_dir / "host_secret.txt").read_text() == SECRET
    finally:
        remove_tree(base)


LEAVE_TRACES = """
import ctypes, os, platform, sys
tag, shared, ipc_key = sys.argv[1], sys.argv[2], int(sys.argv[3])
left = []
for where in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", shared):
    try:
        with open(f"{where}/{tag}", "w") as trace:
            trace.write("left behind")
        os.makedirs(f"{where}/{tag}-dir/sub")
        open(f"{where}/{tag}-dir/sub/file", "w").close()
        os.chmod(f"{where}/{tag}-dir", 0)
        left.append(where)
    except OSError:
        pass
libc = ctypes.CDLL(None, use_errno=True)
create = 0o1000 | 0o600  # IPC_CREAT
left += ["shm"] * (libc.shmget(ipc_key, 4096, create) >= 0)
left += ["sem"] * (libc.semget(ipc_key, 1, create) >= 0)
left += ["msg"] * (libc.msgget(ipc_key, create) >= 0)
if platform.machine() == "x86_64":  # add_key into the user keyring
    left += ["key"] * (libc.syscall(248, b"user", tag.encode(), b"secret", 6, -4) >= 0)
print(" ".join(left))
"""

FIND_TRACES = """
import ctypes, os, platform, sys
tag, shared, ipc_key = sys.argv[1], sys.argv[2], int(sys.argv[3])
found = [w for w in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", shared)
         if os.path.lexists(f"{w}/{tag}") or os.path.lexists(f"{w}/{tag}-dir")]
libc = ctypes.CDLL(None, use_errno=True)
found += ["shm"] * (libc.shmget(ipc_key, 0, 0) >= 0)
found += ["sem"] * (libc.semget(ipc_key, 0, 0) >= 0)
found += ["msg"] * (libc.msgget(ipc_key, 0) >= 0)
if platform.machine() == "x86_64":  # request_key
    found += ["key"] * (libc.syscall(249, b"user", tag.encode(), None, 0) >= 0)
print(" ".join(found) or "nothing")
"""


def _traces_on_host(uid: int, tag: str, shared: Path) -> list[str]:
    """What the host sees of `uid`'s traces: files it owns, its IPC objects, its keys."""
    seen = []
    for where in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", str(shared)):
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(f"{where}/{tag}").st_uid == uid:
                seen.append(where)
    for kind in ("shm", "sem", "msg"):
        lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        uid_column = lines[0].split().index("uid")
        seen += [kind for line in lines[1:] if int(line.split()[uid_column]) == uid]
    for line in Path("/proc/key-users").read_text().splitlines():
        user, counts = line.split(":", 1)
        if user.strip() == str(uid) and int(counts.split()[2].split("/")[0]) > 2:
            seen.append("key")
    return seen


@pytest.fixture()
def shared_dir() -> Iterator[Path]:
    """A root-owned world-writable sticky directory inside /tmp, like /tmp/.X11-unix."""
    path = Path(tempfile.mkdtemp(prefix="opd-shared-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("isolation", BOTH)
def test_a_sandbox_leaves_nothing_for_the_next_holder_of_its_uid(
    root_dir: Path, shared_dir: Path, isolation: str
) -> None:
    # A range of one uid: the second sandbox gets the first one's uid.
    cfg = config(root_dir, isolation).model_copy(
        update={"uid_base": UID_BASE + UID_COUNT - 4, "uid_count": 1}
    )
    tag = f"opd-trace-{os.getpid()}"
    args = (tag, shared_dir, 0x0DD0 + os.getpid() % 1000)

    async def scenario() -> tuple[str, list[str], list[str], str]:
        first = LocalSandbox(cfg)
        await first.start()
        assert first.uid is not None
        uid = first.uid
        left = await first.exec(python_attack(LEAVE_TRACES, *args), 20)
        before = _traces_on_host(uid, tag, shared_dir)
        await first.close()
        after = _traces_on_host(uid, tag, shared_dir)
        async with LocalSandbox(cfg) as second:
            assert second.uid == uid
            seen = await second.exec(python_attack(FIND_TRACES, *args), 20)
        return left.stdout.split(), before, after, seen.stdout.strip()

    left, before, after, seen = run(scenario())
    kinds = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock", str(shared_dir), "shm", "sem", "msg"]
    if isolation == "basic":  # control: the sandbox did write all over the host
        assert set(kinds) <= set(left) and set(kinds) <= set(before)
    if platform.machine() == "x86_64":  # keys are the kernel's, under either isolation
        assert "key" in left and "key" in before
    assert [trace for trace in after if trace != "key"] == []  # keys are collected lazily
    assert seen == "nothing"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strict", [STRICT])
def test_a_crashed_basic_holders_traces_are_gone_before_a_basic_sandbox_sees_them(
    root_dir: Path, shared_dir: Path, monkeypatch: pytest.MonkeyPatch, strict: str
) -> None:
    """A strict holder sweeps only its uid's keys (it cannot reach the host's scratch
    directories or IPC); what a basic holder left without giving the uid back (a crash:
    its sweep never ran) outlives the strict holder and is gone before the next basic
    holder's first command."""
    from sandbox import leases

    cfg = {
        isolation: config(root_dir, isolation).model_copy(
            update={"uid_base": UID_BASE + UID_COUNT - 5, "uid_count": 1}
        )
        for isolation in (strict, "basic")
    }
    tag = f"opd-crash-{os.getpid()}"
    args = (tag, shared_dir, 0x0EE0 + os.getpid() % 1000)
    sweeps: list[bool] = []
    real_remove = leases.remove_uid_leftovers

    def counted(uid: int, remove_at: Any, host_scratch: bool = True) -> None:
        sweeps.append(host_scratch)
        real_remove(uid, remove_at, host_scratch)

    async def scenario() -> tuple[list[str], list[str], str]:
        crashed = LocalSandbox(cfg["basic"])
        await crashed.start()
        uid = crashed.uid
        assert uid is not None
        await crashed.exec(python_attack(LEAVE_TRACES, *args), 20)
        await crashed.kill_all()
        with monkeypatch.context() as crash:  # its give-back sweeps nothing
            crash.setattr(leases, "remove_uid_leftovers", lambda *a, **k: None)
            await crashed.close()
        monkeypatch.setattr(leases, "remove_uid_leftovers", counted)
        async with LocalSandbox(cfg[strict]) as held:
            assert held.uid == uid
        after_strict = _traces_on_host(uid, tag, shared_dir)
        async with LocalSandbox(cfg["basic"]) as basic:
            assert basic.uid == uid
            before_command = _traces_on_host(uid, tag, shared_dir)
            seen = await basic.exec(python_attack(FIND_TRACES, *args), 20)
        return after_strict, before_command, seen.stdout.strip()

    after_strict, before_command, seen = run(scenario())
    assert sweeps == [False, False, True, True]  # strict: keys only; basic: everything
    # control: the crash left them, and the strict holder did not sweep them
    assert {"/tmp", "/dev/shm", str(shared_dir), "shm"} <= set(after_strict)
    assert [trace for trace in before_command if trace != "key"] == []
    assert seen == "nothing"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("isolation", BOTH)
def test_closing_kills_every_process_of_the_uid_forking_a_kill_only_where_needed(
    root_dir: Path, isolation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Processes that left the command's group and session live on until close, which
    leaves none of the uid's. Under strict isolation they die with their pid namespace, so
    close waits for that instead of forking a kill as the uid (a fork of this whole
    process); under basic isolation only that kill reaches them (the control)."""
    from sandbox import leases

    spawned: list[tuple[Any, ...]] = []
    real_spawn = asyncio.create_subprocess_exec

    async def counted(*args: Any, **kwargs: Any) -> Any:
        if args == leases.KILL_ALL_ARGV:
            spawned.append(args)
        return await real_spawn(*args, **kwargs)

    monkeypatch.setattr(leases.asyncio, "create_subprocess_exec", counted)

    async def scenario() -> tuple[int, list[int], list[int]]:
        sandbox = LocalSandbox(config(root_dir, isolation))
        await sandbox.start()
        uid = sandbox.uid
        assert uid is not None
        # 40 processes that left the group: a namespace takes a while to tear down
        escape = (
            "setsid sh -c 'for i in $(seq 39); do sleep 300 & done; sleep 300' "
            "</dev/null >/dev/null 2>&1 & sleep 300"
        )
        command = asyncio.create_task(sandbox.exec(escape, 30))
        for _ in range(200):
            if len(uid_processes(uid, include_zombies=False)) >= 42:
                break
            await asyncio.sleep(0.02)
        before = uid_processes(uid, include_zombies=False)
        await sandbox.close()
        await asyncio.gather(command, return_exceptions=True)
        return uid, before, uid_processes(uid, include_zombies=False)

    _, before, after = run(scenario())
    assert len(before) >= 42  # the command and the 41 that left its group
    assert after == []
    assert len(spawned) == (0 if isolation == "strict" else 1)


# -- the host afterwards -------------------------------------------------------------------


def _all_sandbox_uid_processes() -> list[tuple[int, int]]:
    """(pid, uid) of every live process with a uid in this suite's range (zombies are
    dead: they wait for the host's init to reap them)."""
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
            found.append((int(entry.name), uid))
    return found


def test_host_stays_healthy_after_all_of_it(root_dir: Path) -> None:
    # Control: a stray process under a sandbox uid is seen by the check below.
    stray = subprocess.Popen(["sleep", "30"], user=UID_BASE + UID_COUNT - 1, group=UID_BASE)
    try:
        assert (stray.pid, UID_BASE + UID_COUNT - 1) in _all_sandbox_uid_processes()
    finally:
        stray.kill()
        stray.wait()

    assert _all_sandbox_uid_processes() == []
    assert list(root_dir.glob("work-*")) == []
    meminfo = Path("/proc/meminfo").read_text()
    available_kb = int(next(x for x in meminfo.splitlines() if "MemAvailable" in x).split()[1])
    assert available_kb > 1024 * 1024
    assert plain("echo alive").stdout == "alive\n"
    result = run(sandboxed(config(root_dir, "auto"), "echo still works"))
    assert result.exit_code == 0 and result.stdout == "still works\n"
