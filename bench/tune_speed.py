"""The fair-baselines bench's tune part, this tree against an earlier commit, side by side.

Runs `bench/baselines.py tune` at one reduced scale twice per recipe, once with the code
of `--before` (checked out into a temporary git worktree, imported ahead of the installed
package through PYTHONPATH) and once with this tree, alternating recipe by recipe so that
the machine's load falls on both alike. Each side writes its own --out; the bundled models
are the same files for both. Prints each part's wall time, the runs it trained and the
ratio of wall times (issue 38: the tune part at least 2x faster than before).

    .venv/bin/python bench/tune_speed.py [--before 4870b09^] [--recipes opd,rl]
        [--steps 3 --n-test 40 --n-val 40]

The default `--before` is the commit before the round-batched decode (4870b09^): the
code as it was when issue 38 was filed, as far as the tune part is concerned.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_tune(tree: Path, recipe: str, out: Path, scale: list[str]) -> tuple[float, int]:
    """Wall seconds of one tune part for one recipe, and the runs it left in `out`."""
    env = dict(
        os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")
    )
    cmd = [sys.executable, str(tree / "bench/baselines.py"), "tune", "--recipes", recipe]
    # every part ends by writing the report: into the run's own folder, not the repo's docs
    cmd += ["--out", str(out), "--report-dir", str(out / "report"), *scale]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, len(list(out.glob("runs/*/result.json")))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", default="4870b09^", help="the earlier commit")
    parser.add_argument("--recipes", default="opd,rl")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--n-test", type=int, default=40)
    parser.add_argument("--n-val", type=int, default=40)
    args = parser.parse_args()
    scale = ["--steps", str(args.steps), "--eval-every", str(args.steps)]
    scale += ["--n-test", str(args.n_test), "--n-val", str(args.n_val), "--seeds", "1"]
    with tempfile.TemporaryDirectory(prefix="tune-speed-") as tmp:
        old = Path(tmp) / "before"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-f", str(old), args.before],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            totals = {"before": 0.0, "now": 0.0}
            for recipe in args.recipes.split(","):
                for side, tree in (("before", old), ("now", ROOT)):
                    out = Path(tmp) / f"out-{side}-{recipe}"
                    wall, runs = run_tune(tree, recipe, out, scale)
                    totals[side] += wall
                    print(
                        f"{recipe:4s} {side:6s} {wall:7.1f} s  {runs} runs"
                        f"  ({wall / runs:.1f} s a run)",
                        flush=True,
                    )
            ratio = totals["before"] / totals["now"]
            print(
                f"tune part: before {totals['before']:.0f} s, now {totals['now']:.0f} s:"
                f" {ratio:.2f}x faster"
            )
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False
            )


if __name__ == "__main__":
    main()
