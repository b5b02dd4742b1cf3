"""What the TIR python tool's sandbox lifecycle costs the trainer's process, before and
after 2026-12-06's changes, side by side in one run (local strict sandboxes, root host).

"before": every holder of a sandbox uid sweeps the host's scratch directories and IPC
objects when it takes and gives back the uid, and a close forks a kill as the uid as soon
as it sees the uid's processes still dying. "now": a strict holder clears only the uid's
keys (`sandbox.leftovers`), and its close waits for its pid namespaces' teardown before
it would fork a kill (`sandbox.leases.kill_uid_processes(dying=True)`). The episode's
worker start in the background (rollout/harness/tir.py) is in both.

Measured: (1) `--workers` python workers started, given one cell and closed together,
`--cycles` times: the trainer process's own CPU milliseconds per worker and the kills
forked; (2) the `opd demo` greedy evaluation on the first `--problems` held-out problems
(the bundled student, rounds and prefix reuse), problems per second. Modes interleave,
each keeps its best of `--repeats` passes, and the table ends with now / before.

    .venv/bin/python bench/sandbox_lifecycle.py [--workers 32] [--cycles 5] [--problems 300]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import time
from collections.abc import Iterator
from typing import Any

from demo_stages import evaluation_rate  # bench/ is the script's directory

from sandbox import leases, leftovers
from sandbox.python_worker import PythonWorker, PythonWorkerConfig
from slime_ext.models.refs import bundled_models


@contextlib.contextmanager
def mode(name: str, kills: list[int]) -> Iterator[None]:
    """The library as it was ("before") or as it is ("now"); forked kills counted."""
    sweep, kill, spawn = (
        leases.remove_uid_leftovers,
        leases.kill_uid_processes,
        leases.asyncio.create_subprocess_exec,
    )

    async def counted(*args: Any, **kwargs: Any) -> Any:
        if args == leases.KILL_ALL_ARGV:
            kills.append(1)
        return await spawn(*args, **kwargs)

    def sweep_all(uid: int, remove_at: Any, host_scratch: bool = True) -> None:
        leftovers.remove_uid_leftovers(uid, remove_at, True)

    async def kill_at_once(uid: int, wait_s: float = 5.0, dying: bool = False) -> None:
        await kill(uid, wait_s, False)

    leases.asyncio.create_subprocess_exec = counted  # type: ignore[assignment]
    if name == "before":
        leases.remove_uid_leftovers = sweep_all  # type: ignore[assignment]
        leases.kill_uid_processes = kill_at_once  # type: ignore[assignment]
    try:
        yield
    finally:
        leases.remove_uid_leftovers = sweep
        leases.kill_uid_processes = kill
        leases.asyncio.create_subprocess_exec = spawn  # type: ignore[assignment]


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _cycle(workers: int) -> None:
    pool = [PythonWorker(PythonWorkerConfig(preload_modules=[])) for _ in range(workers)]
    await asyncio.gather(*(worker.start() for worker in pool))
    await asyncio.gather(*(worker.exec("x = 6 * 7\nprint(x)", timeout_s=10) for worker in pool))
    await asyncio.gather(*(worker.close() for worker in pool))


def lifecycle(name: str, workers: int, cycles: int) -> dict[str, float]:
    kills: list[int] = []
    with mode(name, kills):
        cpu, started = _own_cpu_s(), time.perf_counter()
        for _ in range(cycles):
            asyncio.run(_cycle(workers))
        cpu, wall = _own_cpu_s() - cpu, time.perf_counter() - started
    count = workers * cycles
    return {
        "trainer CPU ms/worker": 1000 * cpu / count,
        "wall ms/worker": 1000 * wall / count,
        "kills forked/worker": len(kills) / count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--problems", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    student = bundled_models()[0]
    modes = ("before", "now")
    best: dict[str, dict[str, float]] = {name: {} for name in modes}
    higher = {"eval problems/s"}
    for _ in range(args.repeats):
        for name in modes:
            measured = lifecycle(name, args.workers, args.cycles)
            if args.problems:
                kills: list[int] = []
                with mode(name, kills):
                    measured["eval problems/s"] = evaluation_rate(
                        student, args.problems, rounds=True, reuse=True
                    )
            for key, value in measured.items():
                pick = max if key in higher else min
                best[name][key] = pick(best[name].get(key, value), value)
    print(f"{'measure':<24}{'before':>10}{'now':>10}{'now/before':>12}")
    for key in best["before"]:
        before, now = best["before"][key], best["now"][key]
        ratio = f"{now / before:>11.2f}x" if before else f"{'-':>12}"
        print(f"{key:<24}{before:>10.2f}{now:>10.2f}{ratio}")


if __name__ == "__main__":
    main()
