"""Teacher service throughput, measured in one run (ratios only; machines are noisy).

1. Micro-batching: N concurrent stateless score requests through the hf backend with
   max_batch_size 32 vs max_batch_size 1 (one forward per request), for short requests
   (per-call overhead dominates) and long ones (compute-bound on a CPU). Goal: >= 3x.
2. Prefix reuse: T trajectories scored turn by turn (all trajectories' turn k at once),
   with a session per trajectory vs stateless: wall time and tokens the model computed.

    .venv/bin/python bench/teacher_throughput.py [--preset qwen3-small] [--requests 256]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
import warnings
from pathlib import Path

from slime_ext.models.factory import build_checkpoint
from teacher_server.api import ScoreItem
from teacher_server.hf_backend import HFBackend
from teacher_server.metrics import ServerMetrics


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(800) for _ in range(n)]


async def _run(backend: HFBackend, batches: list[list[ScoreItem]]) -> float:
    """Submit each batch's items as concurrent single-item requests; batches in order."""
    await backend.start()
    started = time.perf_counter()
    for batch in batches:
        await asyncio.gather(*(backend.score([item]) for item in batch))
    elapsed = time.perf_counter() - started
    await backend.stop()
    return elapsed


def batching(model_dir: Path, requests: int, context: int, span: int) -> dict[str, float]:
    rng = random.Random(0)
    items = [
        ScoreItem(input_ids=_ids(rng, context + span), span_start=context) for _ in range(requests)
    ]
    times = {}
    for size in (1, 32):
        backend = HFBackend(model_dir, ServerMetrics(), max_batch_size=size, max_queue=10**6)
        asyncio.run(_run(backend, [items[:8]]))  # warm-up
        times[size] = asyncio.run(_run(backend, [items]))
    return {
        "one_at_a_time_items_per_s": requests / times[1],
        "batched_items_per_s": requests / times[32],
        "ratio": times[1] / times[32],
    }


def reuse(model_dir: Path, trajectories: int, turns: int) -> dict[str, float]:
    rng = random.Random(1)
    contexts = [_ids(rng, 128) for _ in range(trajectories)]
    per_turn: list[list[tuple[int, list[int], int]]] = []
    for _ in range(turns):
        row = []
        for index in range(trajectories):
            think, action, observation = _ids(rng, 48), _ids(rng, 16), _ids(rng, 64)
            row.append((index, contexts[index] + think + action, len(contexts[index])))
            contexts[index] = contexts[index] + action + observation
        per_turn.append(row)
    results = {}
    for mode in ("stateless", "session"):
        metrics = ServerMetrics()
        backend = HFBackend(model_dir, metrics, max_context=8192, max_queue=10**6)
        batches = [
            [
                ScoreItem(
                    input_ids=ids,
                    span_start=start,
                    session_id=f"t{index}" if mode == "session" else None,
                )
                for index, ids, start in row
            ]
            for row in per_turn
        ]
        results[f"{mode}_s"] = asyncio.run(_run(backend, batches))
        results[f"{mode}_tokens_computed"] = metrics.tokens_computed_total
    results["time_ratio"] = results["stateless_s"] / results["session_s"]
    results["tokens_ratio"] = (
        results["stateless_tokens_computed"] / results["session_tokens_computed"]
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="qwen3-small")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--span", type=int, default=64)
    parser.add_argument("--short-context", type=int, default=32)
    parser.add_argument("--short-span", type=int, default=16)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--turns", type=int, default=20)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(args.preset, Path(tmp) / args.preset)
        for context, span in ((args.short_context, args.short_span), (args.context, args.span)):
            batch = batching(model_dir, args.requests, context, span)
            print(
                f"micro-batching ({args.preset}, {args.requests} stateless requests of "
                f"{context}+{span} ids): one at a time "
                f"{batch['one_at_a_time_items_per_s']:.1f}/s, batched "
                f"{batch['batched_items_per_s']:.1f}/s, ratio {batch['ratio']:.2f}x "
                f"({'PASS' if batch['ratio'] >= 3 else 'MISS'} goal >= 3x)"
            )
        reuse_result = reuse(model_dir, args.trajectories, args.turns)
        print(
            f"prefix reuse ({args.trajectories} trajectories x {args.turns} turns): "
            f"stateless {reuse_result['stateless_s']:.2f}s / "
            f"{reuse_result['stateless_tokens_computed']} tokens computed, sessions "
            f"{reuse_result['session_s']:.2f}s / {reuse_result['session_tokens_computed']}"
            f" tokens; time ratio {reuse_result['time_ratio']:.2f}x, tokens ratio "
            f"{reuse_result['tokens_ratio']:.2f}x"
        )


if __name__ == "__main__":
    main()
