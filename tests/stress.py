"""Run the multi-process and service tests again and again under a CPU hog (issue 38: each
of them 20 times with no failure), and keep the tally across sessions.

Each round runs every chosen test file once, alone (`pytest FILE -n 0`), while `--hogs`
busy processes keep the cores full (at the tests' own priority). Rounds go file by file,
round-robin, so every file's count grows evenly; a file already run `--rounds` times (by
this or an earlier invocation: the tally is `--out`/tally.jsonl, committed) is not run
again, so a killed or time-limited invocation goes on where it stopped. A failing run's
output is kept in `--out`/failures/. The summary says, per file, its runs, failures and slowest run.

    .venv/bin/python tests/stress.py [--rounds 20] [--hogs 2] [--minutes 60]
        [--files tests/test_fleet.py,...] [--out bench/results/stress]

The default files are the suite's multi-process and service tests (processes, servers,
Ray, Slurm, ssh, Docker): DEFAULT_FILES. Not part of the suite (it runs for hours).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_FILES = (
    # ordered short first: a time-limited invocation covers the most files
    "tests/test_fleet.py",
    "tests/test_teacher_connections.py",
    "tests/test_teacher_service.py",
    "tests/test_teacher_server.py",
    "tests/test_teacher_bounds.py",
    "tests/test_teacher_session_cache.py",
    "tests/test_teacher_sessions.py",
    "tests/test_teacher_reload.py",
    "tests/test_teacher_snapshot_sync.py",
    "tests/test_teacher_cli.py",
    "tests/test_sglang_router.py",
    "tests/test_sglang_abort.py",
    "tests/test_slime_real.py",
    "tests/test_launch.py",
    "tests/test_local_training.py",
    "tests/test_determinism.py",
    "tests/test_sandbox_python_worker.py",
    "tests/test_sandbox_worker_attacks.py",
    "tests/test_sandbox_docker.py",
    "tests/test_fleet_job.py",
    "tests/test_ssh_nodes.py",
    "tests/test_slurm_cluster.py",
    "tests/test_slime_hooks.py",
    "tests/test_slime_loop.py",
    "tests/test_slime_train.py",
    "tests/test_launch_slurm.py",
    "tests/test_launch_ssh.py",
    "tests/test_rehearsal.py",
)


def hog() -> None:
    """A busy loop (a CPU hog), until killed."""
    n = 0
    while True:
        n = (n * 1103515245 + 12345) % 2**31


def tally(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(rows: list[dict]) -> str:
    by_file: dict[str, list[dict]] = collections.defaultdict(list)
    for row in rows:
        by_file[row["file"]].append(row)
    lines = [f"{'file':45s} {'runs':>5s} {'failed':>6s} {'slowest s':>9s}"]
    for name, runs in sorted(by_file.items()):
        failed = sum(not r["passed"] for r in runs)
        slowest = max(r["wall_s"] for r in runs)
        lines.append(f"{name:45s} {len(runs):5d} {failed:6d} {slowest:9.0f}")
    failures = sum(not r["passed"] for r in rows)
    lines.append(f"{len(rows)} runs of {len(by_file)} files, {failures} failed")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--hogs", type=int, default=2, help="busy processes beside the tests")
    parser.add_argument(
        "--beside", default="", help="the machine's other work meanwhile (kept in the tally)"
    )
    parser.add_argument("--minutes", type=float, help="start no run after this many minutes")
    parser.add_argument("--files", help="comma-separated test files (default: DEFAULT_FILES)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/stress")
    parser.add_argument("--summary", action="store_true", help="print the tally and stop")
    args = parser.parse_args()
    files = args.files.split(",") if args.files else list(DEFAULT_FILES)
    for name in files:
        if not (ROOT / name).is_file():
            raise SystemExit(f"no such test file: {name}")
    args.out.mkdir(parents=True, exist_ok=True)
    record = args.out / "tally.jsonl"
    if args.summary:
        print(summary(tally(record)))
        return
    deadline = time.monotonic() + 60 * args.minutes if args.minutes else None
    hogs = [multiprocessing.Process(target=hog, daemon=True) for _ in range(args.hogs)]
    for process in hogs:
        process.start()
    env = dict(os.environ, CI="true", WANDB_MODE="offline")
    try:
        while True:
            done = collections.Counter(r["file"] for r in tally(record))
            todo = [f for f in files if done[f] < args.rounds]
            if not todo:
                break
            name = min(todo, key=lambda f: (done[f], files.index(f)))
            if deadline is not None and time.monotonic() > deadline:
                print(f"--minutes {args.minutes} reached", flush=True)
                break
            started = time.perf_counter()
            command = [sys.executable, "-m", "pytest", name, "-n", "0", "-q", "-p"]
            command += ["no:cacheprovider", "-W", "ignore", "--durations=0", "-x"]
            result = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True, check=False
            )
            wall = time.perf_counter() - started
            passed = result.returncode == 0
            row = {
                "file": name,
                "round": done[name] + 1,
                "passed": passed,
                "wall_s": round(wall, 1),
                "hogs": args.hogs,
                "beside": args.beside,
                "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "last_line": result.stdout.strip().splitlines()[-1] if result.stdout else "",
            }
            if not passed:
                failures = args.out / "failures"
                failures.mkdir(exist_ok=True)
                stem = f"{Path(name).stem}-{row['round']}"
                (failures / f"{stem}.log").write_text(result.stdout + result.stderr)
            with record.open("a") as out:
                out.write(json.dumps(row) + "\n")
            status = "passed" if passed else "FAILED"
            print(f"{name} round {row['round']}: {status} in {wall:.0f} s", flush=True)
    finally:
        for process in hogs:
            process.kill()
    print(summary(tally(record)))


if __name__ == "__main__":
    main()
