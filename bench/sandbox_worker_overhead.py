"""Per-call overhead of the persistent TIR python worker against a fresh interpreter per call.

A TIR trajectory calls python up to 16 times, thousands of trajectories per step, so the
cost of a call that does nothing is pure overhead. Measured in one process, same sandbox
settings (strict when bubblewrap works here, else basic), on a cell that does no work
(`x = 1`):

- worker:        `PythonWorker.exec` on one warm worker (numpy and sympy preloaded);
- fresh:         `LocalSandbox.exec("python -I -c 'x = 1'")`, a new interpreter per call;
- fresh+numeric: the same, importing numpy and sympy first, which is what a fresh
                 interpreter pays to offer the numeric stack the worker has loaded.

Reported per variant: calls, median and p99 (nearest rank) wall time per call in ms, and
the ratio of each median to the worker's. Goal: worker median <= 5 ms.

Run (about 30 s on 2 cores; --quick: a few seconds):

    .venv/bin/python bench/sandbox_worker_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

from sandbox import LocalSandbox, LocalSandboxConfig, PythonWorker, PythonWorkerConfig
from sandbox.base import ExecResult
from sandbox.python_worker import SINGLE_THREADED_ENV


async def _time_calls(call: Callable[[], Awaitable[ExecResult]], calls: int) -> list[float]:
    """Wall seconds of each of `calls` calls, after two warm-up calls."""
    for _ in range(2):
        await call()
    seconds = []
    for _ in range(calls):
        started = time.perf_counter()
        result = await call()
        seconds.append(time.perf_counter() - started)
        if result.exit_code != 0:
            raise RuntimeError(f"benchmark call failed: {result.stderr}")
    return seconds


def _p99(seconds: list[float]) -> float:
    ordered = sorted(seconds)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


async def main(quick: bool) -> None:
    worker_calls, fresh_calls, numeric_calls = (300, 30, 5) if quick else (3000, 200, 20)
    python = shlex.quote(sys.executable)
    async with PythonWorker(PythonWorkerConfig()) as worker:
        isolation = worker.sandbox.isolation
        timings = {"worker": await _time_calls(lambda: worker.exec("x = 1", 10), worker_calls)}
    async with LocalSandbox(LocalSandboxConfig(env=SINGLE_THREADED_ENV)) as sandbox:
        timings["fresh"] = await _time_calls(
            lambda: sandbox.exec(f"{python} -I -c 'x = 1'", 30), fresh_calls
        )
        timings["fresh+numeric"] = await _time_calls(
            lambda: sandbox.exec(f"{python} -I -c 'import numpy, sympy; x = 1'", 60),
            numeric_calls,
        )

    base = statistics.median(timings["worker"])
    print(f"isolation: {isolation}; per-call wall time of a no-op cell")
    print(f"{'variant':<15}{'calls':>7}{'median ms':>12}{'p99 ms':>10}{'median / worker':>18}")
    for name, seconds in timings.items():
        median = statistics.median(seconds)
        print(
            f"{name:<15}{len(seconds):>7}{median * 1e3:>12.3f}{_p99(seconds) * 1e3:>10.3f}"
            f"{median / base:>17.1f}x"
        )
    verdict = "meets" if base <= 0.005 else "MISSES"
    print(f"worker median {base * 1e3:.3f} ms {verdict} the <= 5 ms goal")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls, a few seconds")
    asyncio.run(main(parser.parse_args().quick))
