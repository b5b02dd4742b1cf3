"""The persistent python worker for TIR: state across calls, per-call deadlines that kill
only that call's work, crashes survived with the restart reported, framing that only the
worker's supervisor speaks and that the host checks, interpreters the sandbox uid could
not reach on its own. Every behaviour runs under both isolation levels."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from sandbox import (
    LocalSandbox,
    LocalSandboxConfig,
    PythonWorker,
    PythonWorkerConfig,
    SandboxDiedError,
    SandboxStartError,
    WorkerExecResult,
)
from sandbox.leases import uid_processes
from sandbox.python_worker import FRAME_HEADER, _Cell, _interpreter_roots, _read_frames, _Route
from sandbox.python_worker_child import FRAME_HEADER as CHILD_FRAME_HEADER
from tests.sandbox_modes import STRICT, run

T = TypeVar("T")
UID_BASE = 302_000


pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids need root")


@pytest.fixture(params=[STRICT, "basic"])
def isolation(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def root_dir() -> Iterator[Path]:
    root = Path(tempfile.gettempdir()) / f"opd-sandbox-worker-{os.getpid()}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def worker_config(
    root_dir: Path, isolation: str, preload: tuple[str, ...] = (), **limits: Any
) -> PythonWorkerConfig:
    sandbox = LocalSandboxConfig(
        isolation=isolation, root_dir=root_dir, uid_base=UID_BASE, uid_count=200, **limits
    )
    return PythonWorkerConfig(sandbox=sandbox, preload_modules=list(preload))


async def cells(
    cfg: PythonWorkerConfig, *codes: str, timeout_s: float = 10.0
) -> list[WorkerExecResult]:
    async with PythonWorker(cfg) as worker:
        return [await worker.exec(code, timeout_s) for code in codes]


def test_state_persists_across_calls_like_notebook_cells(root_dir: Path, isolation: str) -> None:
    first, second, third, fourth = run(
        cells(
            worker_config(root_dir, isolation),
            "x = 41\ndef double(v):\n    return 2 * v",
            "x + 1",
            "print(double(x), end='')\nNone",
            "import math\nmath.factorial(5)",
        )
    )
    assert (first.exit_code, first.stdout) == (0, "")
    assert second.stdout == "42\n"  # the trailing expression is echoed
    assert third.stdout == "82"  # a trailing None is not
    assert fourth.stdout == "120\n"
    assert not any(r.worker_restarted or r.worker_died for r in (first, second, third, fourth))


def test_exception_reports_a_traceback_of_the_cell_and_keeps_state(
    root_dir: Path, isolation: str
) -> None:
    _, failing, after = run(
        cells(worker_config(root_dir, isolation), "total = 10", "y = 1\ntotal / 0", "total + y")
    )
    assert failing.exit_code == 1 and not failing.worker_died
    assert 'File "<cell-2>", line 2' in failing.stderr and "total / 0" in failing.stderr
    assert "ZeroDivisionError: division by zero" in failing.stderr
    assert "python_worker_child" not in failing.stderr  # the worker's frames are hidden
    assert after.stdout == "11\n" and not after.worker_restarted


def test_system_exit_gives_its_code_without_killing_the_worker(
    root_dir: Path, isolation: str
) -> None:
    _, exited, after = run(
        cells(worker_config(root_dir, isolation), "kept = 'yes'", "import sys; sys.exit(4)", "kept")
    )
    assert exited.exit_code == 4 and not exited.worker_died
    assert after.stdout == "'yes'\n" and not after.worker_restarted


def test_numeric_stack_is_preloaded_and_usable(root_dir: Path, isolation: str) -> None:
    (result,) = run(
        cells(
            worker_config(root_dir, isolation, preload=("numpy", "sympy")),
            "import os, sys\nassert 'numpy' in sys.modules and 'sympy' in sys.modules\n"
            "assert os.environ['OPENBLAS_NUM_THREADS'] == '1'\n"
            "import numpy as np, sympy as sp\n"
            "n = sp.Symbol('n')\n"
            "print(int(np.arange(1, 11).sum()), sp.factor(n**2 - 1), sp.summation(n, (n, 1, 10)))",
        )
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "55 (n - 1)*(n + 1) 55\n"


@pytest.mark.timeout(60)
def test_timeout_kills_only_that_calls_work_and_the_next_call_reports_a_restart(
    root_dir: Path,
    isolation: str,
) -> None:
    hang = (
        "import subprocess, time\n"
        "helper = subprocess.Popen(['sleep', '60'])\n"
        "print('started', flush=True)\n"
        "time.sleep(60)"
    )

    async def scenario() -> tuple[WorkerExecResult, list[int], WorkerExecResult, WorkerExecResult]:
        cfg = worker_config(root_dir, isolation)
        async with PythonWorker(cfg) as victim, PythonWorker(cfg) as bystander:
            await victim.exec("x = 1", 10)
            await bystander.exec("kept = 'bystander state'", 10)
            timed_out = await victim.exec(hang, timeout_s=1.0)
            assert victim.sandbox.uid is not None
            left = uid_processes(victim.sandbox.uid, include_zombies=False)
            after = await victim.exec("x", 10)
            other = await bystander.exec("kept", 10)
            return timed_out, left, after, other

    timed_out, left, after, other = run(scenario())
    assert timed_out.timed_out and timed_out.limit_hit == "wall_time"
    assert timed_out.worker_died and timed_out.exit_code == 137
    assert 1.0 <= timed_out.duration_s < 4.0
    assert timed_out.stdout == "started\n"  # output up to the deadline is kept
    assert left == []  # the cell's helper process died with it
    assert after.worker_restarted and "deadline" in (after.restart_reason or "")
    assert "NameError: name 'x' is not defined" in after.stderr
    assert other.stdout == "'bystander state'\n" and not other.worker_restarted


@pytest.mark.parametrize(
    ("crash", "exit_code"),
    [("import os\nos._exit(3)", 3), ("import ctypes\nctypes.string_at(0)", 128 + 11)],
)
def test_a_crash_is_survived_and_reported(
    root_dir: Path, isolation: str, crash: str, exit_code: int
) -> None:
    _, crashed, after, later = run(
        cells(
            worker_config(root_dir, isolation),
            "x = 1",
            "print('before crash', flush=True)\n" + crash,
            "y = 2\ny",
            "y",
        )
    )
    assert crashed.worker_died and crashed.exit_code == exit_code
    assert crashed.stdout == "before crash\n" and not crashed.timed_out
    assert after.worker_restarted and after.exit_code == 0 and after.stdout == "2\n"
    assert str(exit_code if exit_code < 128 else exit_code - 128) in (after.restart_reason or "")
    assert later.stdout == "2\n" and not later.worker_restarted


def test_memory_bomb_fails_the_cell_but_not_the_worker(root_dir: Path, isolation: str) -> None:
    _, bomb, after = run(
        cells(
            worker_config(root_dir, isolation, memory_mb=512),
            "x = 5",
            "b = bytearray(1024**3)",
            "x",
        )
    )
    assert bomb.exit_code == 1 and "MemoryError" in bomb.stderr
    assert bomb.limit_hit == "memory" and not bomb.worker_died
    assert after.stdout == "5\n" and not after.worker_restarted


def test_output_flood_is_cut_and_ends_the_worker(root_dir: Path, isolation: str) -> None:
    cfg = worker_config(root_dir, isolation, max_output_mb=4, output_head_kb=8, output_tail_kb=8)
    flood, after = run(cells(cfg, "while True:\n    print('x' * 1000)", "1 + 1"))
    assert flood.limit_hit == "output" and flood.worker_died and flood.stdout_truncated
    assert 4 * 1024 * 1024 < flood.stdout_bytes < 64 * 1024 * 1024
    assert len(flood.stdout) < 17 * 1024 + 200
    assert after.worker_restarted and after.stdout == "2\n"


def test_cells_cannot_break_the_framing(root_dir: Path, isolation: str) -> None:
    """input() must not eat the next request; bytes shaped like a reply frame, a closed
    stdout or a replaced sys.stdout must not end or lose the next call's output."""
    forged = FRAME_HEADER.pack(b"r", 2) + b"{}"
    results = run(
        cells(
            worker_config(root_dir, isolation),
            "input()",
            f"import sys\nsys.stdout.buffer.write({forged!r})\nprint('still here')\nsys.exit(3)",
            "import sys, io\nsys.stdout = io.StringIO()\nprint('swallowed')",
            "import os\nos.close(1)",
            "print('visible')",
            "import subprocess\nsubprocess.run(['echo', 'from a subprocess'])\nNone",
        )
    )
    eof, faked, replaced, closed, visible, child = results
    assert eof.exit_code == 1 and "EOFError" in eof.stderr
    assert faked.stdout == forged.decode() + "still here\n" and faked.exit_code == 3
    assert replaced.exit_code == 0 and closed.exit_code == 0
    assert visible.stdout == "visible\n"
    assert child.stdout == "from a subprocess\n"
    assert not any(r.worker_restarted or r.worker_died for r in results)


def test_cwd_and_env_apply_and_persist_and_files_are_shared(root_dir: Path, isolation: str) -> None:
    async def scenario() -> list[WorkerExecResult]:
        async with PythonWorker(worker_config(root_dir, isolation)) as worker:
            await worker.write_file("data/input.txt", b"21")
            results = [
                await worker.exec("import os\nos.makedirs('out', exist_ok=True)", 10),
                await worker.exec(
                    "print(int(open('../data/input.txt').read()) * 2, os.environ['MODE'])",
                    10,
                    cwd="out",
                    env={"MODE": "test"},
                ),
                await worker.exec("open('result.txt', 'w').write('done')\nos.getcwd()", 10),
            ]
            assert await worker.read_file("out/result.txt") == b"done"
            return results

    _, computed, where = run(scenario())
    assert computed.stdout == "42 test\n", computed.stderr
    assert where.stdout.strip().strip("'").endswith("/out")


def test_a_worker_that_cannot_start_raises_a_start_error(root_dir: Path, isolation: str) -> None:
    cfg = worker_config(root_dir, isolation).model_copy(update={"python": "/nonexistent/python3"})
    with pytest.raises(SandboxStartError, match="exited while starting") as raised:
        run(cells(cfg, "1"))
    assert "/nonexistent/python3" in str(raised.value)  # the launcher's own message
    assert list(root_dir.glob("work-*")) == []  # the failed start released its sandbox


def test_frames_split_across_reads_are_reassembled() -> None:
    async def scenario() -> _Cell:
        route = _Route()
        cell = route.cell = _Cell(head_bytes=1024, tail_bytes=1024, budget_bytes=1 << 20)
        stream = asyncio.StreamReader()
        reader = asyncio.create_task(_read_frames(stream, route))
        reply = b'{"exit_code": 0, "state_lost": false, "reason": null}'
        payload = b"".join(
            FRAME_HEADER.pack(kind, len(data)) + data
            for kind, data in ((b"o", b"cell "), (b"e", b"warn"), (b"o", b"output"), (b"r", reply))
        )
        for i in range(0, len(payload), 3):  # three bytes per read
            stream.feed_data(payload[i : i + 3])
            await asyncio.sleep(0)
        stream.feed_eof()
        await reader
        assert route.protocol_error is None
        return cell

    cell = run(scenario())
    assert (cell.out.text(), cell.err.text()) == ("cell output", "warn")
    assert cell.reply == b'{"exit_code": 0, "state_lost": false, "reason": null}'


def test_host_and_child_agree_on_the_frame_header() -> None:
    assert FRAME_HEADER.format == CHILD_FRAME_HEADER.format


# -- a worker that breaks the protocol -----------------------------------------------------

FAKE_WORKER = """
import os, struct, sys, time
HEADER = struct.Struct("!cI")
if os.path.exists("worker-broke-once"):
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
open("worker-broke-once", "w").close()
def send(data):
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
READY = b'{"ready": true, "preload_errors": {}}'
send(HEADER.pack(b"r", len(READY)) + READY)
sys.stdin.buffer.readline()
send(bytes.fromhex(os.environ["OPD_FAKE_REPLY"]))
time.sleep(0.5)
os._exit(0)  # bubblewrap holds stdout too: only an exit ends it
"""

REPLY_OK = b'{"exit_code": 0, "state_lost": false, "reason": null}'


def _reply(payload: bytes) -> bytes:
    return FRAME_HEADER.pack(b"r", len(payload)) + payload


@pytest.fixture(scope="module")
def fake_python() -> Iterator[Path]:
    """An 'interpreter' that speaks a broken protocol once per working directory, then
    runs the real worker."""
    base = Path(tempfile.mkdtemp(prefix="opd-fake-python-"))
    base.chmod(0o755)
    script = base / "bin" / "python"
    script.parent.mkdir(mode=0o755)
    script.write_text(f"#!{sys.executable}\n{FAKE_WORKER}")
    script.chmod(0o755)
    yield script
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "frames",
    [
        _reply(b'{"exit_code": "0", "state_lost": false, "reason": null}'),
        _reply(b'{"exit_code": 1e400, "state_lost": false, "reason": null}'),
        _reply(b'{"exit_code": true, "state_lost": false, "reason": null}'),
        _reply(b'{"exit_code": 300, "state_lost": false, "reason": null}'),
        _reply(b'{"exit_code": 0, "state_lost": false, "reason": null, "more": 1}'),
        _reply(b"{}"),
        _reply(b"[1]"),
        _reply(b"not json"),
        FRAME_HEADER.pack(b"x", 1) + b"?",
        FRAME_HEADER.pack(b"o", 2**31),
        FRAME_HEADER.pack(b"o", 100) + b"cut",
    ],
    ids=["str", "inf", "bool", "range", "extra", "empty", "list", "junk", "kind", "huge", "cut"],
)
def test_a_malformed_reply_is_a_sandbox_error_and_the_next_call_works(
    root_dir: Path, isolation: str, fake_python: Path, frames: bytes
) -> None:
    cfg = worker_config(root_dir, isolation, env={"OPD_FAKE_REPLY": frames.hex()})
    cfg = cfg.model_copy(update={"python": str(fake_python)})

    async def scenario() -> WorkerExecResult:
        async with PythonWorker(cfg) as worker:
            with pytest.raises(SandboxDiedError, match="broke its protocol"):
                await worker.exec("1 + 1", 10)
            return await worker.exec("2 + 2", 10)

    after = run(scenario())
    assert after.stdout == "4\n" and after.exit_code == 0
    assert after.worker_restarted and after.restart_reason == "the worker broke its protocol"


@pytest.mark.timeout(60)
def test_a_frame_between_calls_restarts_the_worker_before_the_next_call(
    root_dir: Path, isolation: str, fake_python: Path
) -> None:
    frames = _reply(REPLY_OK) + FRAME_HEADER.pack(b"o", 5) + b"stray"
    cfg = worker_config(root_dir, isolation, env={"OPD_FAKE_REPLY": frames.hex()})
    cfg = cfg.model_copy(update={"python": str(fake_python)})

    async def scenario() -> tuple[WorkerExecResult, WorkerExecResult]:
        async with PythonWorker(cfg) as worker:
            first = await worker.exec("1 + 1", 10)
            await asyncio.sleep(0.2)  # the stray frame arrives
            return first, await worker.exec("2 + 2", 10)

    first, after = run(scenario())
    assert first.exit_code == 0 and first.stdout == ""
    assert after.stdout == "4\n" and after.worker_restarted
    assert "broke its protocol between calls" in (after.restart_reason or "")


# -- an interpreter the sandbox uid cannot reach -------------------------------------------


def test_strict_isolation_mounts_the_venv_and_the_prefix_its_python_comes_from(
    tmp_path: Path,
) -> None:
    base_python = tmp_path / "base" / "bin" / "python3.99"
    base_python.parent.mkdir(parents=True)
    base_python.touch()
    venv_python = tmp_path / "venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(base_python)
    (tmp_path / "venv" / "pyvenv.cfg").write_text(f"home = {base_python.parent}\n")
    assert _interpreter_roots(str(venv_python)) == [tmp_path / "base", tmp_path / "venv"]
    assert Path("/") not in _interpreter_roots("/bin/sh")  # never the whole host


@pytest.fixture(scope="module")
def root_only_venv() -> Iterator[Path]:
    """A venv inside a 0700 root directory, with a module of its own and a secret beside it."""
    base = Path(tempfile.mkdtemp(prefix="opd-root-only-"))
    assert base.stat().st_mode & 0o777 == 0o700
    venv = base / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    site_packages = next(venv.glob("lib/python3*/site-packages"))
    (site_packages / "opd_probe_module.py").write_text("ANSWER = 42\n")
    (base / "secret.txt").write_text("root-only secret")
    yield venv / "bin" / "python"
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.timeout(120)
def test_an_interpreter_under_a_root_only_directory_runs_the_worker(
    root_dir: Path, isolation: str, root_only_venv: Path
) -> None:
    cfg = worker_config(root_dir, isolation, preload=("opd_probe_module",))
    cfg = cfg.model_copy(update={"python": str(root_only_venv)})
    secret = root_only_venv.parent.parent.parent / "secret.txt"
    probe = (
        "import fractions, json.tool, opd_probe_module, sys\n"
        "print(opd_probe_module.ANSWER, fractions.Fraction(1, 3))\n"
        "leaks = []\n"
        "for entry in sys.path:\n"
        "    for up in range(1, 8):\n"
        "        try:\n"
        "            leaks.append(open(entry + '/..' * up + '/secret.txt').read())\n"
        "        except OSError:\n"
        "            pass\n"
        f"try:\n    leaks.append(open({str(secret)!r}).read())\nexcept OSError:\n    pass\n"
        "print(leaks)"
    )

    async def scenario() -> tuple[int, str, WorkerExecResult]:
        async with LocalSandbox(cfg.sandbox) as sandbox:  # control: the uid on its own
            control = await sandbox.exec(f"{root_only_venv} -c 'print(1)'", 10)
        async with PythonWorker(cfg) as worker:
            return control.exit_code, control.stderr, await worker.exec(probe, 30)

    control_code, control_stderr, result = run(scenario())
    assert control_code == 126 if isolation == "basic" else control_code == 127
    assert "Permission denied" in control_stderr or "No such file" in control_stderr
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "42 1/3\n[]\n"


def test_an_interpreter_named_through_dot_dot_runs_the_worker(
    root_dir: Path, isolation: str, tmp_path: Path
) -> None:
    """`cd bench && ../.venv/bin/python x.py`: sys.executable passes through a directory
    strict isolation does not mount; the worker still starts."""
    elsewhere = tmp_path / "bench"
    elsewhere.mkdir()
    executable = Path(sys.executable).absolute()
    dotted = elsewhere / os.path.relpath(executable.parent, elsewhere) / executable.name
    assert ".." in dotted.parts and dotted.exists()
    cfg = worker_config(root_dir, isolation).model_copy(update={"python": str(dotted)})
    (result,) = run(cells(cfg, "6 * 7"))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "42\n"
