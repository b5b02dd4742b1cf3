"""Cells that attack the python worker itself: its reply protocol, the work a call
leaves behind, its standard streams, and what basic isolation exposes of an interpreter
under a root-only directory. Each runs under both isolation levels and must end with a
result (never an exception outside the SandboxError family) and a next call that works.

The protocol's side is out of the cells' reach by construction (the supervisor holds it
and is not dumpable, and a call ends only when the process that ran it has exited); these
cells try every way in a cell has: /proc descriptors of every process of the uid, every
socket the interpreter holds, frames, forged messages, answering later calls, killing or
stopping the supervisor, odd exit codes, a broken runtime, closed standard streams,
directory descriptors and `..`. Controls show each attack does what it says where nothing
stops it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from sandbox import (
    LocalSandbox,
    LocalSandboxConfig,
    PythonWorker,
    PythonWorkerConfig,
    WorkerExecResult,
)
from sandbox.leases import uid_processes
from sandbox.python_worker import CHILD_SCRIPT, FRAME_HEADER
from tests.sandbox_modes import STRICT, run

T = TypeVar("T")
UID_BASE = 303_000
PY = "/usr/bin/python3"


pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids need root"),
    pytest.mark.timeout(90),
]


@pytest.fixture(params=[STRICT, "basic"])
def isolation(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def root_dir() -> Iterator[Path]:
    root = Path(tempfile.gettempdir()) / f"opd-sandbox-attacks-{os.getpid()}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def worker_config(root_dir: Path, isolation: str) -> PythonWorkerConfig:
    sandbox = LocalSandboxConfig(
        isolation=isolation, root_dir=root_dir, uid_base=UID_BASE, uid_count=200
    )
    return PythonWorkerConfig(sandbox=sandbox, preload_modules=[])


async def cells(
    cfg: PythonWorkerConfig, *codes: str, timeout_s: float = 10.0
) -> list[WorkerExecResult]:
    async with PythonWorker(cfg) as worker:
        return [await worker.exec(code, timeout_s) for code in codes]


# -- the reply protocol --------------------------------------------------------------------

FORGED_REPLY = b'{"exit_code": 0, "state_lost": false, "reason": null}'
FORGE = f"""
import gc, os, socket, sys
# A frame of this protocol, and for every short string the call's frames hold (a nonce,
# say) an end marker of the worker's earlier protocol with a reply it could not parse.
payloads = [{FRAME_HEADER.pack(b"r", len(FORGED_REPLY)) + FORGED_REPLY!r}]
frame, frames = sys._getframe(), 0
while frame is not None:
    frames += 1
    for value in list(frame.f_locals.values()):
        for text in list(value.values()) if isinstance(value, dict) else [value]:
            if isinstance(text, str) and 0 < len(text) < 100:
                marker = b"\\x00OPD-CELL-END " + text.encode(errors="replace") + b"\\x00"
                payloads.append(marker + b'{{"exit_code": "forged"}}\\n')
    frame = frame.f_back
def forge(fd):
    sent = 0
    for payload in payloads:
        try:
            sent += os.write(fd, payload) == len(payload)
        except OSError:
            pass
    return sent
listed, written = [], 0
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        fds = os.listdir(f"/proc/{{pid}}/fd")
    except OSError:
        continue
    listed.append(int(pid))
    for fd in fds:
        try:
            target = os.open(f"/proc/{{pid}}/fd/{{fd}}", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        written += forge(target)
        os.close(target)
for fd in range(3, 64):
    written += forge(fd)
for thing in gc.get_objects():
    if isinstance(thing, socket.socket):
        for message in (b"done 1 0", b"next 1 1", b"done 99 0", bytes(range(256))):
            try:
                thing.send(message)
            except OSError:
                pass
print("\\nsummary", os.getpid() in listed, os.getppid() in listed, written > 0, frames)
sys.exit(7)
"""


def test_a_cell_cannot_reach_or_forge_the_reply_channel(root_dir: Path, isolation: str) -> None:
    _, forged, after = run(cells(worker_config(root_dir, isolation), "kept = 1", FORGE, "kept"))
    # Control: the cell could list its own descriptors and write the forged frame to them
    # (its own stdout among them: the frame comes back as plain output) ...
    summary = next(line for line in forged.stdout.splitlines() if line.startswith("summary"))
    own_listed, supervisor_listed, wrote, frames = summary.split()[1:]
    assert own_listed == "True" and wrote == "True" and int(frames) >= 1
    assert forged.stdout.count(FORGED_REPLY.decode()) >= 1
    # ... but not the supervisor's, and nothing it wrote ended, faked or shifted a call.
    assert supervisor_listed == "False"
    assert forged.exit_code == 7 and not forged.worker_died
    assert after.stdout == "1\n" and after.exit_code == 0 and not after.worker_restarted


LIVE_SOCKETS = """
import gc, os, socket, stat
def live_sockets():
    for thing in gc.get_objects():
        if isinstance(thing, socket.socket):
            try:
                if stat.S_ISSOCK(os.fstat(thing.fileno()).st_mode):
                    yield thing
            except OSError:
                pass
"""

EARLY_END = (
    LIVE_SOCKETS
    + """
import sys, time
frame = sys._getframe()
while frame is not None and "request" not in frame.f_locals:
    frame = frame.f_back
sockets = list(live_sockets())
print("sockets", len(sockets), flush=True)
for control in sockets:
    control.send(b"done %d 0" % frame.f_locals["request"]["call"])
time.sleep(2)
print("late")
"""
)


def test_a_cell_cannot_end_its_own_call_before_its_code_has_ended(
    root_dir: Path, isolation: str
) -> None:
    """A call ends when the process that ran it exits, not on anything said on a socket:
    the forged end changes nothing, the rest of the cell runs in its own call."""
    results = run(
        cells(worker_config(root_dir, isolation), "kept = 1", EARLY_END, "kept + 1", "kept + 2")
    )
    _, early, following, last = results
    assert early.exit_code == 0 and early.stdout.endswith("late\n") and early.duration_s >= 2
    assert int(early.stdout.split()[1]) >= 1  # control: it held live sockets and spoke
    assert following.stdout == "2\n" and last.stdout == "3\n"
    assert not any(r.worker_restarted or r.worker_died for r in results)


ANSWER_LATER = (
    LIVE_SOCKETS
    + """
import json, sys
frame = sys._getframe()
while frame is not None and "request" not in frame.f_locals:
    frame = frame.f_back
control = next(live_sockets())
print("holding a socket", flush=True)
control.send(b"done %d 0" % frame.f_locals["request"]["call"])
while True:  # take each later call's request and answer it without running its code
    _, fds, _, _ = socket.recv_fds(control, 16, 3)
    if len(fds) == 3:
        later = json.loads(os.read(fds[0], 1 << 20))
        os.write(fds[1], b"answered by an earlier cell\\n")
        control.send(b"done %d 0" % later["call"])
    for fd in fds:
        os.close(fd)
"""
)


def test_a_cell_cannot_stay_alive_and_answer_later_calls(root_dir: Path, isolation: str) -> None:
    async def scenario() -> list[WorkerExecResult]:
        async with PythonWorker(worker_config(root_dir, isolation)) as worker:
            attack = await worker.exec(ANSWER_LATER, 3)
            return [attack, await worker.exec("print('ran')", 10), await worker.exec("1 + 1", 10)]

    attack, ran, after = run(scenario())
    assert ran.stdout == "ran\n" and ran.exit_code == 0 and ran.worker_restarted
    assert after.stdout == "2\n" and not after.worker_restarted
    assert attack.timed_out and attack.worker_died  # its call lasted as long as its code
    assert attack.stdout == "holding a socket\n"  # control: it held the socket


@pytest.mark.parametrize(
    ("attack", "timeout_s"),
    [("os.kill(os.getppid(), 9)", 10.0), ("os.kill(os.getppid(), 19)", 1.0)],
)
def test_killing_or_stopping_the_supervisor_ends_only_that_worker(
    root_dir: Path, isolation: str, attack: str, timeout_s: float
) -> None:
    async def scenario() -> tuple[WorkerExecResult, WorkerExecResult]:
        async with PythonWorker(worker_config(root_dir, isolation)) as worker:
            hit = await worker.exec(f"import os\n{attack}\nimport time\ntime.sleep(5)", timeout_s)
            return hit, await worker.exec("1 + 1", 10)

    hit, after = run(scenario())
    assert hit.worker_died and hit.exit_code == 137
    assert hit.timed_out == (timeout_s < 5)
    assert after.stdout == "2\n" and after.worker_restarted


@pytest.mark.parametrize(
    ("cell", "exit_code", "state_kept"),
    [
        ("import sys; sys.exit(-1)", 255, True),
        ("import sys; sys.exit(256)", 0, True),
        ("raise SystemExit(2**70 + 3)", 3, True),
        ("import sys; sys.exit('bye')", 1, True),
        ("import sys; sys.exit(True)", 1, True),
        ("raise KeyboardInterrupt", 1, True),
        ("import os; os._exit(300)", 300 % 256, False),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 137, False),
    ],
)
def test_odd_exits_give_a_shell_exit_code_and_the_next_call_works(
    root_dir: Path, isolation: str, cell: str, exit_code: int, state_kept: bool
) -> None:
    _, ended, after = run(cells(worker_config(root_dir, isolation), "kept = 1", cell, "kept"))
    assert ended.exit_code == exit_code and ended.worker_died == (not state_kept)
    if state_kept:
        assert after.stdout == "1\n" and not after.worker_restarted
    else:
        assert after.worker_restarted and "NameError" in after.stderr
    if cell.endswith("'bye')"):
        assert ended.stderr == "bye\n"


BREAK_RUNTIME = """
import builtins, json, os, socket, sys
json.loads = json.dumps = None
socket.recv_fds = None
builtins.print = builtins.open = None
os.dup2 = None
sys.stdout = sys.stderr = None
"""

LEAVE_A_THIEF = (
    LIVE_SOCKETS
    + """
control = next(live_sockets())
if os.fork() == 0:
    os.setsid()
    while True:
        control.recv(1 << 16)  # would steal the next call's request
print("thief started")
"""
)


@pytest.mark.parametrize(
    "attack",
    [BREAK_RUNTIME, LEAVE_A_THIEF, "import os\nos.closerange(0, 1024)", "import os\nos.fork()"],
    ids=["break-runtime", "thief", "close-fds", "fork"],
)
def test_a_cell_that_breaks_the_cells_process_never_breaks_the_protocol(
    root_dir: Path, isolation: str, attack: str
) -> None:
    results = run(
        cells(worker_config(root_dir, isolation), attack, "1 + 1", "2 + 2", "print('fine')")
    )
    # No later call pays for the broken state: each runs, in a fresh process if need be.
    assert [r.stdout for r in results[1:]] == ["2\n", "4\n", "fine\n"]
    assert all(r.exit_code == 0 for r in results[1:])


STREAM_PROBE = """
import stat
def state(fd):
    try:
        return "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "open"
    except OSError:
        return "closed"
seen = " ".join(state(fd) for fd in (0, 1, 2))
with open("std-streams", "w") as probe:  # lands on a slot the cell freed
    probe.write(seen)
"""
STREAM_ATTACKS = {
    "close-all": ("import os\nfor fd in (0, 1, 2):\n    os.close(fd)\n", "closed closed closed"),
    "close-stdin": ("import os\nos.close(0)\n", "closed open open"),
    "directory-on-0": ("import os\nos.close(0)\nos.open('.', os.O_RDONLY)\n", "dir open open"),
}


@pytest.mark.parametrize("attack", list(STREAM_ATTACKS))
def test_a_cell_that_closes_or_reuses_the_standard_streams_leaves_later_calls_intact(
    root_dir: Path, isolation: str, attack: str
) -> None:
    """Whatever a cell leaves on descriptors 0-2, the worker's own descriptors never land
    there: the next call runs with its state, stdin /dev/null and its own output."""
    cell, damage = STREAM_ATTACKS[attack]

    async def scenario() -> tuple[WorkerExecResult, bytes, list[WorkerExecResult]]:
        async with PythonWorker(worker_config(root_dir, isolation)) as worker:
            await worker.exec("kept = 1", 10)
            hit = await worker.exec(cell + STREAM_PROBE, 10)
            probe = await worker.read_file("std-streams")
            later = ["kept", "import sys\nprint(repr(sys.stdin.read()))", "kept + 1"]
            return hit, probe, [await worker.exec(code, 10) for code in later]

    hit, probe, (kept, stdin, after) = run(scenario())
    assert probe.decode() == damage and hit.exit_code == 0  # control: the damage was done
    assert kept.stdout == "1\n" and kept.exit_code == 0, kept
    assert stdin.stdout == "''\n" and after.stdout == "2\n"
    assert not any(r.worker_restarted or r.worker_died for r in (hit, kept, stdin, after))


def test_a_call_the_cells_process_cannot_take_runs_in_a_fresh_one_that_says_so(
    root_dir: Path, isolation: str
) -> None:
    """A cell that breaks what takes the next request (here the JSON decoder) costs its
    trajectory the state, never the next call: that call runs in a fresh process and its
    result says so."""
    results = run(
        cells(
            worker_config(root_dir, isolation),
            "kept = 1",
            "import json\njson.loads = None",
            "print('innocent')",
            "kept",
        )
    )
    _, broke, innocent, after = results
    assert broke.exit_code == 0 and not broke.worker_died
    assert innocent.stdout == "innocent\n" and innocent.exit_code == 0, innocent
    assert innocent.worker_restarted and "could not take" in (innocent.restart_reason or "")
    assert "NameError" in after.stderr and not after.worker_restarted  # the state is gone


# -- work a call leaves behind ---------------------------------------------------------------

LEFTOVERS = """
import ctypes, os, subprocess, threading
def burn():
    while True:
        pass
threading.Thread(target=burn, daemon=True).start()
subprocess.Popen(["bash", "-c", "while :; do :; done"], start_new_session=True)
if os.fork() == 0:  # a daemon that hides its children from /proc listings
    os.setsid()
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    if os.fork() == 0:
        burn()
    burn()
kept = 1
print(len(os.listdir("/proc/self/task")), len(os.listdir(f"/proc/{os.getpid()}/task")))
"""

AT_FORK_THREAD = """
import os, threading
def burn():
    while True:
        pass
os.register_at_fork(after_in_child=lambda: threading.Thread(target=burn, daemon=True).start())
threading.Thread(target=burn, daemon=True).start()
kept = 1
"""


def _cpu_seconds(pids: list[int]) -> float:
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Threads:")).split()[1])


@pytest.mark.skipif(not os.path.exists(PY), reason=f"the control needs {PY}")
def test_a_burning_thread_keeps_burning_in_a_plain_interpreter() -> None:
    """Control for the test below: nothing stops a daemon thread while its interpreter lives."""
    burn = "import resource, threading, time\ndef burn():\n    while True:\n        pass\n"
    burn += "threading.Thread(target=burn, daemon=True).start()\ntime.sleep(1.5)\n"
    burn += "print(resource.getrusage(resource.RUSAGE_SELF).ru_utime)"
    done = subprocess.run([PY, "-c", burn], capture_output=True, text=True, timeout=30)
    assert float(done.stdout) > 0.3


@pytest.mark.parametrize(("cell", "state_kept"), [(LEFTOVERS, True), (AT_FORK_THREAD, False)])
def test_threads_and_processes_a_call_leaves_are_stopped_when_it_returns(
    root_dir: Path, isolation: str, cell: str, state_kept: bool
) -> None:
    async def scenario() -> tuple[WorkerExecResult, list[int], list[int], float, WorkerExecResult]:
        async with PythonWorker(worker_config(root_dir, isolation)) as worker:
            left = await worker.exec(cell, 10)
            uid = worker.sandbox.uid
            assert uid is not None
            await asyncio.sleep(0.2)
            pids = uid_processes(uid, include_zombies=False)
            before = _cpu_seconds(pids)
            await asyncio.sleep(1.5)
            burned = _cpu_seconds(uid_processes(uid, include_zombies=False)) - before
            threads = [_threads(pid) for pid in pids]
            return left, pids, threads, burned, await worker.exec("kept", 10)

    left, pids, threads, burned, after = run(scenario())
    assert left.exit_code == 0, left.stderr
    if cell is LEFTOVERS:  # control: the cell really had its burners running
        assert left.stdout.split() == ["2", "2"]
    assert len(pids) == 2 and threads == [1, 1]  # the supervisor and the stopped holder
    assert burned < 0.25
    if state_kept:
        assert after.stdout == "1\n" and not after.worker_restarted
    else:
        assert after.worker_restarted and "threads" in (after.restart_reason or "")


ABANDON = """
import asyncio, os, sys
from pathlib import Path
from sandbox import LocalSandboxConfig, PythonWorker, PythonWorkerConfig

async def main() -> None:
    root_dir, isolation, uid_base, cell = sys.argv[1:]
    sandbox = LocalSandboxConfig(
        isolation=isolation, root_dir=Path(root_dir), uid_base=int(uid_base), uid_count=200
    )
    worker = PythonWorker(PythonWorkerConfig(sandbox=sandbox, preload_modules=[]))
    await worker.start()
    await worker.exec("kept = 1", 10)
    print(worker.sandbox.uid, flush=True)
    if cell:
        asyncio.create_task(worker.exec(cell, 60))
        await asyncio.sleep(0.5)
    os._exit(0)  # the host dies: no close(), no deadline

asyncio.run(main())
"""


@pytest.mark.parametrize("cell", ["", "while True:\n    pass"], ids=["idle", "mid-call"])
def test_a_worker_whose_host_dies_leaves_nothing_running(
    root_dir: Path, isolation: str, cell: str
) -> None:
    host = subprocess.run(
        [sys.executable, "-c", ABANDON, str(root_dir), isolation, str(UID_BASE), cell],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    uid = int(host.stdout)
    deadline = time.monotonic() + 10
    while (left := uid_processes(uid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == []


# -- what an interpreter under a root-only directory exposes (basic isolation) ---------------

SECRET = "root-only project secret"

CLIMB = """
import os, stat, sys
import opd_probe_module
dir_fds, leaks = [], []
for name in os.listdir("/proc/self/fd"):
    try:
        if stat.S_ISDIR(os.stat(f"/proc/self/fd/{name}").st_mode):
            dir_fds.append(int(name))
    except OSError:
        pass  # the listing's own descriptor, closed by now
def read(path, dir_fd=None):
    try:
        fd = os.open(path, os.O_RDONLY, dir_fd=dir_fd)
    except OSError:
        return
    leaks.append(os.read(fd, 100).decode(errors="replace"))
    os.close(fd)
starts = [os.path.dirname(opd_probe_module.__file__), *sys.path]
for up in range(8):
    relative = "../" * up + "secret.txt"
    for fd in dir_fds:
        read(relative, dir_fd=fd)
        read(f"/proc/self/fd/{fd}/{relative}")
    for start in starts:
        read(f"{start}/{relative}")
print(opd_probe_module.ANSWER, dir_fds, leaks)
"""

HOLD_AND_CLIMB = """
import os, sys
site_packages, uid = sys.argv[1], int(sys.argv[2])
anchor = os.open(site_packages, os.O_PATH)
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
print(os.read(os.open("../../../../secret.txt", os.O_RDONLY, dir_fd=anchor), 100).decode())
"""


@pytest.fixture(scope="module")
def venv_in_root_only_project() -> Iterator[Path]:
    """<0700 root dir>/project (0755) holding a venv with a module of its own and, beside
    the venv, a 0644 secret: the sandbox uid reaches neither on its own."""
    base = Path(tempfile.mkdtemp(prefix="opd-root-only-"))
    project = base / "project"
    project.mkdir()
    project.chmod(0o755)
    venv = project / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    site_packages = next(venv.glob("lib/python3*/site-packages"))
    (site_packages / "opd_probe_module.py").write_text("ANSWER = 42\n")
    (project / "secret.txt").write_text(SECRET)
    (project / "secret.txt").chmod(0o644)
    yield venv / "bin" / "python"
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.timeout(120)
def test_no_descriptor_or_path_a_cell_holds_leads_past_the_import_paths(
    root_dir: Path, isolation: str, venv_in_root_only_project: Path
) -> None:
    python = venv_in_root_only_project
    project = python.parent.parent.parent
    site_packages = next(python.parent.parent.glob("lib/python3*/site-packages"))
    cfg = worker_config(root_dir, isolation).model_copy(update={"python": str(python)})
    # Control: a process of another uid holding a descriptor of site-packages climbs to
    # the secret with `..` (the kernel checks only the directories the walk passes) ...
    climbed = subprocess.run(
        [sys.executable, "-c", HOLD_AND_CLIMB, str(site_packages), str(UID_BASE + 199)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert climbed.stdout == SECRET + "\n", climbed.stderr

    async def scenario() -> tuple[WorkerExecResult, WorkerExecResult]:
        async with LocalSandbox(cfg.sandbox) as sandbox:  # ... which the uid cannot read
            alone = await sandbox.exec(f"cat {project / 'secret.txt'}", 10)
        async with PythonWorker(cfg) as worker:
            return alone, await worker.exec(CLIMB, 30)

    alone, climb = run(scenario())
    assert alone.exit_code == 1 and SECRET not in alone.stdout
    assert climb.exit_code == 0, climb.stderr
    assert climb.stdout == "42 [] []\n"


@pytest.mark.timeout(120)
def test_basic_isolation_refuses_import_paths_it_cannot_contain(
    venv_in_root_only_project: Path,
) -> None:
    """Without the right to make a mount namespace (CAP_SYS_ADMIN) the worker cannot
    expose a root-only venv alone: it does not start, and says why and what to do."""
    options = {"echo_last_expression": True, "preload_modules": [], "drop_to_uid": UID_BASE + 199}
    worker = [str(venv_in_root_only_project), "-I", str(CHILD_SCRIPT), json.dumps(options)]
    with_admin = subprocess.run(worker, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    assert with_admin.returncode == 0 and with_admin.stdout.startswith(b"r")  # control: ready
    refused = subprocess.run(
        ["setpriv", "--bounding-set=-sys_admin", "--", *worker],
        capture_output=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    message = refused.stderr.decode()
    assert refused.returncode != 0 and refused.stdout == b"", message
    assert str(venv_in_root_only_project.parent.parent) in message
    assert "isolation='strict'" in message and "`python`" in message


def _sweep_after_a_stale_scan(result: Path) -> None:
    """In a fresh subreaper: a child with a grandchild, then the sweep. Its first scan of
    the process tree is stale: it read our children, then the child exited (a zombie of
    ours, its grandchild handed to us) before the scan read the child's. Writes whether
    the grandchild outlived the sweep."""
    import ctypes
    import signal

    import sandbox.python_worker_child as child_module

    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    pid_r, pid_w = os.pipe()
    go_r, go_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        grandchild = os.fork()
        if grandchild == 0:
            signal.pause()
            os._exit(0)
        os.write(pid_w, str(grandchild).encode())
        os.read(go_r, 1)  # exit when the scan has read our parent's children
        os._exit(0)
    grandchild = int(os.read(pid_r, 32))
    real, scans = child_module._descendants, []

    def stale_once(root: int) -> set[int]:
        scans.append(root)
        if len(scans) > 1:
            return real(root)
        os.write(go_w, b"x")
        while child_module._is_live(middle):  # exited, not reaped: the grandchild is ours
            time.sleep(0.01)
        return {middle}  # what the scan saw: the child, with no children of its own yet

    child_module._descendants = stale_once
    supervisor = child_module.Supervisor.__new__(child_module.Supervisor)
    supervisor.kill_descendants(keep=None)
    outlived = child_module._is_live(grandchild)
    if outlived:
        os.kill(grandchild, signal.SIGKILL)
    result.write_text(json.dumps({"outlived": outlived, "scans": len(scans)}))


def test_the_sweep_kills_what_a_child_that_died_during_the_scan_handed_over(
    tmp_path: Path,
) -> None:
    """The worker's sweep after a call (kill every process but the state's keeper) reads
    the tree one process at a time, so a child of the supervisor that dies mid-scan hands
    its children over unseen. Seen under load: a cell's os.fork() left a copy of the cells'
    process that took the next call ('1 + 1' timed out). An empty scan ends the sweep only
    when no child of the supervisor died meanwhile; here the first scan is forced stale."""
    import multiprocessing

    result = tmp_path / "result.json"
    process = multiprocessing.get_context("fork").Process(
        target=_sweep_after_a_stale_scan, args=(result,)
    )
    process.start()
    process.join(timeout=30)
    assert process.exitcode == 0
    seen = json.loads(result.read_text())
    assert not seen["outlived"] and seen["scans"] >= 2, seen
