"""Keep the newest `logging.keep_checkpoints` of a cluster run's Megatron checkpoints: a
background step of `opd launch`'s plan on the head node, beside training.

    python3 -m launch.prune_checkpoints --save-dir DIR --keep N \
        [--protect 4,9 --sync-state RUN/teacher_sync/state.json] [--interval-s 60]

Megatron writes `iter_{i:07d}/` and then names i in latest_checkpointed_iteration.txt, so
a directory above the tracker's iteration is still being written: it is never touched.
Of the complete ones (at or below it) the newest `keep` stay, the tracker's own always
among them, so a relaunch can always resume. An iteration in --protect (those the
teacher's snapshot sync converts) stays until the sync's state file lists it as applied
(slime saves after step s as iteration s - 1). A checkpoint is removed by renaming it out
of the iter_ namespace first, so a crash mid-delete leaves no half checkpoint under an
iter_ name; what such a crash left is removed on the next pass. On SIGTERM (the job's end)
it makes one last pass and exits 0.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from teacher_server.snapshot_sync import TRACKER

ITERATION = re.compile(r"^iter_(\d{7})$")
PRUNING = ".pruning-"


def complete_iteration(save_dir: Path) -> int | None:
    """The tracker's iteration (None: no tracker yet, or a 'release' checkpoint; where
    snapshot_sync.saved_iteration refuses that, the pruner and the relaunch go on)."""
    try:
        text = (save_dir / TRACKER).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def iterations(save_dir: Path) -> list[int]:
    found = []
    for path in save_dir.iterdir() if save_dir.is_dir() else []:
        match = ITERATION.match(path.name)
        if match and path.is_dir():
            found.append(int(match.group(1)))
    return sorted(found)


def synced_iterations(state: Path | None) -> set[int]:
    """Iterations the snapshot sync has applied (its state.json lists steps: iteration + 1)."""
    if state is None:
        return set()
    try:
        applied = json.loads(state.read_text()).get("applied", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {int(step) - 1 for step in applied if isinstance(step, int)}


def doomed(
    save_dir: Path, keep: int, protect: Iterable[int] = (), state: Path | None = None
) -> list[int]:
    """The iterations a pass removes: complete, not among the newest `keep` complete ones,
    not a protected one the sync has not applied yet."""
    latest = complete_iteration(save_dir)
    if latest is None:
        return []
    complete = [i for i in iterations(save_dir) if i <= latest]
    kept = set(complete[-keep:]) | {latest}
    waiting = set(protect) - synced_iterations(state)
    return [i for i in complete if i not in kept and i not in waiting]


def prune(
    save_dir: Path, keep: int, protect: Iterable[int] = (), state: Path | None = None
) -> list[int]:
    """One pass: remove what `doomed` names, and leftovers of an interrupted pass."""
    for leftover in save_dir.glob(f"{PRUNING}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    removed = []
    for iteration in doomed(save_dir, keep, protect, state):
        path = save_dir / f"iter_{iteration:07d}"
        aside = save_dir / f"{PRUNING}{path.name}"
        try:
            path.rename(aside)
        except OSError:
            continue  # gone already (another pruner), or not ours to move: next pass
        shutil.rmtree(aside, ignore_errors=True)
        removed.append(iteration)
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save-dir", type=Path, required=True)
    parser.add_argument("--keep", type=int, required=True)
    parser.add_argument("--protect", default="", help="Iterations the snapshot sync needs.")
    parser.add_argument("--sync-state", type=Path, help="The snapshot sync's state.json.")
    parser.add_argument("--interval-s", type=float, default=60.0)
    parser.add_argument("--once", action="store_true", help="One pass, then exit.")
    args = parser.parse_args(argv)
    if args.keep < 1:
        parser.error("--keep must be at least 1 (the newest checkpoint always stays)")
    protect = [int(i) for i in args.protect.split(",") if i.strip()]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(
        f"keeping the newest {args.keep} checkpoint(s) in {args.save_dir}"
        + (f", and iterations {protect} until the snapshot sync has them" if protect else ""),
        flush=True,
    )
    while True:
        last = args.once or stop.is_set()
        removed = prune(args.save_dir, args.keep, protect, args.sync_state)
        if removed:
            stamp = time.strftime("%H:%M:%S")
            print(f"{stamp} removed iterations {removed} of {args.save_dir}", flush=True)
        if last:
            return 0
        stop.wait(args.interval_s)


if __name__ == "__main__":
    raise SystemExit(main())
