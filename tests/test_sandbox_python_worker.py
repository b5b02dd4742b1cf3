"""The persistent python worker for TIR: state across calls, per-call deadlines that kill
only that call's work, crashes survived with the restart reported, output framing."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from sandbox import (
    LocalSandboxConfig,
    PythonWorker,
    PythonWorkerConfig,
    SandboxStartError,
    WorkerExecResult,
)
from sandbox.jail import find_bwrap, probe_strict
from sandbox.leases import uid_processes
from sandbox.python_worker import END_MARKER, _Cell, _read_stream
from sandbox.python_worker_child import END_MARKER as CHILD_END_MARKER

T = TypeVar("T")
UID_BASE = 302_000


def _interpreter_reachable_by_others() -> bool:
    """Basic mode runs the host's interpreter as the sandbox uid: every directory on
    the way must be open to others (a pyenv under /root is not)."""
    for path in {Path(sys.executable), Path(os.path.realpath(sys.executable))}:
        for parent in path.parents:
            if not os.stat(parent).st_mode & 0o001:
                return False
    return True


def _strict_problem() -> str | None:
    bwrap = find_bwrap()
    return "bubblewrap is not installed" if bwrap is None else probe_strict(bwrap)


def _isolation() -> str:
    return "strict" if _strict_problem() is None else "basic"


pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids need the host to be root"),
    pytest.mark.skipif(
        _strict_problem() is not None and not _interpreter_reachable_by_others(),
        reason=f"no bubblewrap ({_strict_problem()}) and {sys.executable} is not reachable "
        "by other uids, so no isolation level can run this interpreter",
    ),
]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def root_dir() -> Iterator[Path]:
    root = Path(tempfile.gettempdir()) / f"opd-sandbox-worker-{os.getpid()}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def worker_config(
    root_dir: Path, preload: tuple[str, ...] = (), **limits: Any
) -> PythonWorkerConfig:
    sandbox = LocalSandboxConfig(
        isolation=_isolation(), root_dir=root_dir, uid_base=UID_BASE, uid_count=200, **limits
    )
    return PythonWorkerConfig(sandbox=sandbox, preload_modules=list(preload))


async def cells(
    cfg: PythonWorkerConfig, *codes: str, timeout_s: float = 10.0
) -> list[WorkerExecResult]:
    async with PythonWorker(cfg) as worker:
        return [await worker.exec(code, timeout_s) for code in codes]


def test_state_persists_across_calls_like_notebook_cells(root_dir: Path) -> None:
    first, second, third, fourth = run(
        cells(
            worker_config(root_dir),
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


def test_exception_reports_a_traceback_of_the_cell_and_keeps_state(root_dir: Path) -> None:
    _, failing, after = run(
        cells(worker_config(root_dir), "total = 10", "y = 1\ntotal / 0", "total + y")
    )
    assert failing.exit_code == 1 and not failing.worker_died
    assert 'File "<cell-2>", line 2' in failing.stderr and "total / 0" in failing.stderr
    assert "ZeroDivisionError: division by zero" in failing.stderr
    assert "python_worker_child" not in failing.stderr  # the worker's frames are hidden
    assert after.stdout == "11\n" and not after.worker_restarted


def test_system_exit_gives_its_code_without_killing_the_worker(root_dir: Path) -> None:
    _, exited, after = run(
        cells(worker_config(root_dir), "kept = 'yes'", "import sys; sys.exit(4)", "kept")
    )
    assert exited.exit_code == 4 and not exited.worker_died
    assert after.stdout == "'yes'\n" and not after.worker_restarted


def test_numeric_stack_is_preloaded_and_usable(root_dir: Path) -> None:
    (result,) = run(
        cells(
            worker_config(root_dir, preload=("numpy", "sympy")),
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
) -> None:
    hang = (
        "import subprocess, time\n"
        "helper = subprocess.Popen(['sleep', '60'])\n"
        "print('started', flush=True)\n"
        "time.sleep(60)"
    )

    async def scenario() -> tuple[WorkerExecResult, list[int], WorkerExecResult, WorkerExecResult]:
        cfg = worker_config(root_dir)
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
def test_a_crash_is_survived_and_reported(root_dir: Path, crash: str, exit_code: int) -> None:
    _, crashed, after, later = run(
        cells(
            worker_config(root_dir),
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


def test_memory_bomb_fails_the_cell_but_not_the_worker(root_dir: Path) -> None:
    _, bomb, after = run(
        cells(worker_config(root_dir, memory_mb=512), "x = 5", "b = bytearray(1024**3)", "x")
    )
    assert bomb.exit_code == 1 and "MemoryError" in bomb.stderr
    assert bomb.limit_hit == "memory" and not bomb.worker_died
    assert after.stdout == "5\n" and not after.worker_restarted


def test_output_flood_is_cut_and_ends_the_worker(root_dir: Path) -> None:
    cfg = worker_config(root_dir, max_output_mb=4, output_head_kb=8, output_tail_kb=8)
    flood, after = run(cells(cfg, "while True:\n    print('x' * 1000)", "1 + 1"))
    assert flood.limit_hit == "output" and flood.worker_died and flood.stdout_truncated
    assert 4 * 1024 * 1024 < flood.stdout_bytes < 64 * 1024 * 1024
    assert len(flood.stdout) < 17 * 1024 + 200
    assert after.worker_restarted and after.stdout == "2\n"


def test_cells_cannot_break_the_framing(root_dir: Path) -> None:
    """input() must not eat the next request; a fake end marker, a closed stdout or a
    replaced sys.stdout must not end or lose the next call's output."""
    fake_marker = (END_MARKER + b"0123456789abcdef" + bytes(1)).decode()
    results = run(
        cells(
            worker_config(root_dir),
            "input()",
            f"print({fake_marker!r})\nprint('still here')",
            "import sys, io\nsys.stdout = io.StringIO()\nprint('swallowed')",
            "import os\nos.close(1)",
            "print('visible')",
            "import subprocess\nsubprocess.run(['echo', 'from a subprocess'])\nNone",
        )
    )
    eof, faked, replaced, closed, visible, child = results
    assert eof.exit_code == 1 and "EOFError" in eof.stderr
    assert faked.stdout.endswith("still here\n")
    assert replaced.exit_code == 0 and closed.exit_code == 0
    assert visible.stdout == "visible\n"
    assert child.stdout == "from a subprocess\n"
    assert not any(r.worker_restarted or r.worker_died for r in results)


def test_cwd_and_env_apply_and_persist_and_files_are_shared(root_dir: Path) -> None:
    async def scenario() -> list[WorkerExecResult]:
        async with PythonWorker(worker_config(root_dir)) as worker:
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


def test_a_worker_that_cannot_start_raises_a_start_error(root_dir: Path) -> None:
    cfg = worker_config(root_dir).model_copy(update={"python": "/nonexistent/python3"})
    with pytest.raises(SandboxStartError, match="exited while starting") as raised:
        run(cells(cfg, "1"))
    assert "/nonexistent/python3" in str(raised.value)  # the launcher's own message
    assert list(root_dir.glob("work-*")) == []  # the failed start released its sandbox


def test_marker_split_across_reads_still_ends_the_cell() -> None:
    async def scenario() -> tuple[_Cell, _Cell]:
        cell = _Cell(head_bytes=1024, tail_bytes=1024, budget_bytes=1 << 20)
        marker = END_MARKER + b"feedface" + b"\x00"
        cell.marker = marker
        stream = asyncio.StreamReader()
        reader = asyncio.create_task(_read_stream(stream, "stdout", cell))
        payload = b"cell output" + marker + b'{"exit_code": 0}\nnext call'
        for i in range(0, len(payload), 3):  # three bytes per read
            stream.feed_data(payload[i : i + 3])
            await asyncio.sleep(0)
        stream.feed_eof()
        await reader
        return cell, cell.successor()

    cell, following = run(scenario())
    assert cell.out.text() == "cell output"
    assert cell.reply == {"exit_code": 0} and cell.ended["stdout"]
    assert following.out.text() == "next call"


def test_host_and_child_agree_on_the_end_marker() -> None:
    assert END_MARKER == CHILD_END_MARKER
