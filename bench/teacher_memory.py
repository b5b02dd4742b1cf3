"""The hf teacher's memory and throughput on requests of mixed lengths, new batcher vs old.

1. Memory: one request of n stateless items (n = 1, 2, 4, ..., 32) with lengths drawn
   from 64..max_context (the longest at max_context), against the longest item scored
   alone. Each measurement runs in a fresh subprocess: it loads the model, pins glibc to
   mmap allocations over 128 KiB (freed tensors leave the resident set at once), warms up
   on a tiny request, records its resident memory, resets the kernel's high-water mark
   (/proc/self/clear_refs) and reads it back after the request (ru_maxrss): growth = peak -
   resident before. Printed per n: ratio = growth / ((total ids / longest ids) x growth of
   the longest alone); the goal is <= 1.5. The old batcher (every stateless item of a
   micro-batch in one left-padded forward with an attention mask, kept here as
   `LeftPaddedBatches` for the comparison) is measured the same way.
2. Throughput on the same mixed load: the requests of every n at once, as concurrent
   clients (the micro-batcher merges their items), new batcher vs old, each in its own
   subprocess (glibc's allocator left as it is: pinned to mmap, every tensor would cost
   page faults), after a warm-up, fastest of --repeats passes; printed as items/s and
   their ratio.

Run (about 3 minutes on 2 cores; the mmap-pinned memory children are slow):

    .venv/bin/python bench/teacher_memory.py [--preset qwen3-tiny] [--max-context 2048]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from loss_memory import peak_resident_bytes, reset_peak, resident_bytes, set_malloc
from torch import Tensor

from slime_ext.models.factory import build_checkpoint
from teacher_server.api import ScoreItem, ScoreResult
from teacher_server.hf_backend import HFBackend, HFScorer, ScoreJob
from teacher_server.metrics import ServerMetrics

MIB = 2**20
GOAL = 1.5
SIZES = (1, 2, 4, 8, 16, 32)
MIN_LENGTH = 64


class LeftPaddedBatches:
    """The batcher before bucketing, for comparison only: every item of a micro-batch in
    one forward, left-padded to the longest, with an attention mask (stateless items)."""

    def __init__(self, scorer: HFScorer) -> None:
        self.scorer = scorer

    @torch.no_grad()
    def score_batch(self, jobs: list[ScoreJob]) -> list[ScoreResult | Exception]:
        items = [job.item for job in jobs]
        assert all(item.session_id is None for item in items), "stateless items only"
        width = max(len(item.input_ids) for item in items)
        keep = max(len(item.input_ids) - item.span_start + 1 for item in items)
        input_ids = torch.zeros((len(items), width), dtype=torch.long)
        attention = torch.zeros((len(items), width), dtype=torch.long)
        for row, item in enumerate(items):
            input_ids[row, width - len(item.input_ids) :] = torch.tensor(item.input_ids)
            attention[row, width - len(item.input_ids) :] = 1
        padding: dict[str, Tensor] = {}
        if not bool(attention.all()):
            padding["attention_mask"] = attention
            padding["position_ids"] = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = self.scorer.model(
            input_ids=input_ids, use_cache=False, logits_to_keep=keep, **padding
        ).logits
        results: list[ScoreResult | Exception] = []
        for row, item in enumerate(items):
            span = len(item.input_ids) - item.span_start
            start = keep - span - 1
            results.append(self.scorer._span_result(logits[row, start : start + span], item, 0))
        return results


def request_lengths(n: int, max_context: int, seed: int) -> list[int]:
    """n lengths in MIN_LENGTH..max_context, the first at max_context (n > 1)."""
    rng = random.Random(seed)
    if n == 1:
        return [max_context]
    return [max_context] + [rng.randint(MIN_LENGTH, max_context) for _ in range(n - 1)]


def items_of(lengths: list[int], seed: int) -> list[ScoreItem]:
    rng = random.Random(seed)
    return [
        ScoreItem(
            input_ids=[rng.randrange(800) for _ in range(length)],
            span_start=length - min(256, length // 2),
        )
        for length in lengths
    ]


def _backend(spec: dict[str, Any]) -> HFBackend:
    backend = HFBackend(
        spec["model_dir"], ServerMetrics(), max_context=spec["max_context"], max_queue=10**6
    )
    if spec["batcher"] == "old":
        backend.batcher.run_batch = LeftPaddedBatches(backend.scorer).score_batch
    return backend


async def _score_all(backend: HFBackend, requests: list[list[ScoreItem]]) -> float:
    started = time.perf_counter()
    await asyncio.gather(*(backend.score(items) for items in requests))
    return time.perf_counter() - started


async def _child_run(spec: dict[str, Any]) -> dict[str, float]:
    backend = _backend(spec)
    requests = [items_of(lengths, seed) for seed, lengths in enumerate(spec["requests"])]
    await backend.start()
    try:
        await _score_all(backend, [items_of([MIN_LENGTH, MIN_LENGTH + 1], 99)])  # warm-up
        if spec["repeats"]:
            return {
                "seconds": min(
                    [await _score_all(backend, requests) for _ in range(spec["repeats"])]
                )
            }
        before = resident_bytes()
        if not reset_peak():
            raise SystemExit("needs Linux >= 4.0 (/proc/self/clear_refs) to reset the peak")
        await _score_all(backend, requests)
        return {"growth_mib": (peak_resident_bytes() - before) / MIB}
    finally:
        await backend.stop()


def child(spec_json: str) -> None:
    warnings.filterwarnings("ignore")
    spec = json.loads(spec_json)
    if not spec["repeats"] and not set_malloc(128 * 1024, 128 * 1024):
        raise SystemExit("needs glibc (mallopt) so that freed tensors leave the resident set")
    print("RESULT " + json.dumps(asyncio.run(_child_run(spec))))


def measure(
    model_dir: Path, max_context: int, batcher: str, requests: list[list[int]], repeats: int = 0
) -> Any:
    """Peak RSS growth of scoring `requests` at once (repeats 0), else the fastest of
    `repeats` passes, in a fresh subprocess."""
    spec = {
        "model_dir": str(model_dir),
        "max_context": max_context,
        "batcher": batcher,
        "requests": requests,
        "repeats": repeats,
    }
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    raise RuntimeError(f"{batcher} child failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="qwen3-tiny")
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--repeats", type=int, default=3, help="throughput passes per batcher")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    warnings.filterwarnings("ignore")
    sizes = [int(size) for size in args.sizes.split(",")]
    context = args.max_context
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(args.preset, Path(tmp) / args.preset)
        alone = measure(model_dir, context, "new", [[context]])["growth_mib"]
        print(
            f"teacher memory ({args.preset}, max context {context}): peak RSS growth of one "
            f"request of n items, lengths {MIN_LENGTH}..{context}; the longest "
            f"({context} ids) alone: {alone:.1f} MiB\n"
            f"ratio = growth / ((total ids / longest ids) x longest alone), goal <= {GOAL}"
        )
        print(
            f"{'n':>3} {'total ids':>9} | {'new MiB':>8} {'ratio':>6} | {'old MiB':>8} {'ratio':>6}"
        )
        worst = 0.0
        load: list[list[int]] = []
        for n in sizes:
            lengths = request_lengths(n, context, seed=n)
            load.append(lengths)
            scale = sum(lengths) / max(lengths)
            row = [f"{n:>3} {sum(lengths):>9}"]
            for batcher in ("new", "old"):
                growth = measure(model_dir, context, batcher, [lengths])["growth_mib"]
                ratio = growth / (scale * alone)
                if batcher == "new":
                    worst = max(worst, ratio)
                row.append(f"{growth:>8.1f} {ratio:>6.2f}")
            print(" | ".join(row))
        print(
            f"new batcher: worst ratio {worst:.2f} "
            f"({'PASS' if worst <= GOAL else 'MISS'} goal <= {GOAL})"
        )
        items = sum(len(lengths) for lengths in load)
        ids = sum(map(sum, load))
        seconds = {
            batcher: measure(model_dir, context, batcher, load, args.repeats)["seconds"]
            for batcher in ("new", "old")
        }
        print(
            f"throughput ({len(load)} concurrent requests, {items} items, {ids} ids): new "
            f"{items / seconds['new']:.1f} items/s, old {items / seconds['old']:.1f} items/s, "
            f"ratio {seconds['old'] / seconds['new']:.2f}x"
        )


if __name__ == "__main__":
    main()
