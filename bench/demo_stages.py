"""The `opd demo` stages before and after rounds, prefix reuse and the lean decode, side
by side in one run: "before" decodes each turn alone and encodes its whole context
(`rollout.rounds: false`, no prefix reuse: the demo until 2026-12-06), "rounds" decodes in
rounds (rollout/rounds.py), "reuse" in rounds with each trajectory's prefix reused
(rollout/prefixes.py: the demo until 2026-12-07), "now" also decodes into key/value
buffers allocated once per batch, with finished rows leaving the batch (rollout/policy.py
`_decode_cache`, `drop_finished`: the default). Measured: greedy evaluation (held-out
problems per second), the training steps' generation (generated tokens per second of
rollout time), their rollout, training and whole step times.

The training steps are the demo's (32 problems, per-turn OPD against the bundled teacher
served on 127.0.0.1, the trainer's tree-packed step), `--steps` of them per mode from the
same start, in fresh run directories; the evaluation is the demo's on the first
`--problems` held-out problems. Modes interleave and each keeps the faster of `--repeats`
passes (machines are noisy). Prints a table and the now / before and now / reuse ratios.

    .venv/bin/python bench/demo_stages.py [--steps 3] [--problems 96] [--repeats 1]

The ratios are per second for rates and per step for times: a time ratio under 1 is
faster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import rollout.policy
from rollout.policy import HFPolicy
from rollout.prefixes import DEFAULT_MAX_BYTES, PrefixStore
from rollout.tasks.arithmetic import make_tasks
from slime_ext.job.config import JobConfig
from slime_ext.local.evaluate import evaluate, heldout_tasks
from slime_ext.local.loop import LocalRun, embedded_teacher, tir_harness
from slime_ext.local.opd_demo import demo_job
from slime_ext.models.refs import bundled_models

MODES = {
    "before": (False, False, False),
    "rounds": (True, False, False),
    "reuse": (True, True, False),
    "now": (True, True, True),
}
"""(rounds, prefix reuse, lean decode) of each mode."""


@contextlib.contextmanager
def decode(lean: bool) -> Iterator[None]:
    """Without `lean`: the local policy's decode as it was until 2026-12-07 (transformers'
    DynamicCache, concatenated every step; `drop_finished` is the policy's)."""
    kept = rollout.policy._decode_cache
    if not lean:

        def dynamic(config: Any, capacity: int) -> Any:
            return DynamicCache(config=config)

        rollout.policy._decode_cache = dynamic
    try:
        yield
    finally:
        rollout.policy._decode_cache = kept


def _job(run_dir: Path, steps: int, rounds: bool) -> JobConfig:
    job = demo_job(run_dir, steps)
    return job.model_copy(update={"rollout": job.rollout.model_copy(update={"rounds": rounds})})


def evaluation_rate(student: Path, problems: int, rounds: bool, reuse: bool, lean: bool) -> float:
    """Held-out problems per second of the demo's greedy evaluation."""
    tokenizer = AutoTokenizer.from_pretrained(student)
    model = AutoModelForCausalLM.from_pretrained(student).eval()
    tasks = heldout_tasks(problems)
    started = time.perf_counter()
    policy = HFPolicy(
        model,
        tokenizer.eos_token_id,
        prefix_cache_bytes=DEFAULT_MAX_BYTES * reuse,
        drop_finished=lean,
    )
    with decode(lean):
        asyncio.run(evaluate(policy, tokenizer, tasks, tir_harness(), rounds=rounds))
    return problems / (time.perf_counter() - started)


def training_stages(
    student: Path, teacher_url: str, steps: int, rounds: bool, reuse: bool, lean: bool
) -> dict[str, float]:
    """Per step, averaged over `steps` demo steps: generated tokens per second of rollout
    time, and the rollout, training and step seconds (the loop's own perf/ metrics)."""
    with tempfile.TemporaryDirectory(prefix="opd-stages-") as directory:
        run_dir = Path(directory)
        run = LocalRun(_job(run_dir, steps, rounds), student, run_dir, Console(quiet=True))
        if not reuse:  # a store that keeps nothing: every context encoded whole
            run.policy.prefixes = PrefixStore(max_bytes=0)
        run.policy.drop_finished = lean
        with decode(lean):
            asyncio.run(run.train(make_tasks(4000, "train", seed=1), teacher_url))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = sum(r["rollout/turns"] * r["rollout/tokens_per_turn"] for r in rows)
    rollout_s = sum(r["perf/rollout_time"] for r in rows)
    return {
        "generation tokens/s": tokens / rollout_s,
        "rollout s/step": rollout_s / len(rows),
        "train s/step": sum(r["perf/train_time"] for r in rows) / len(rows),
        "step s": sum(r["perf/step_time"] for r in rows) / len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--problems", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    student, teacher = bundled_models()
    best: dict[str, dict[str, float]] = {mode: {} for mode in MODES}
    faster = {"eval problems/s": max, "generation tokens/s": max}
    with (
        tempfile.TemporaryDirectory(prefix="opd-stages-teacher-") as directory,
        embedded_teacher(teacher, Path(directory) / "teacher.log") as teacher_url,
    ):
        for _ in range(args.repeats):
            for mode, (rounds, reuse, lean) in MODES.items():
                rate = evaluation_rate(student, args.problems, rounds, reuse, lean)
                measured = {"eval problems/s": rate}
                measured |= training_stages(student, teacher_url, args.steps, rounds, reuse, lean)
                for name, value in measured.items():
                    pick = faster.get(name, min)
                    best[mode][name] = pick(best[mode].get(name, value), value)
    ratios = ("before", "reuse")
    print(
        f"{'stage':<22}"
        + "".join(f"{mode:>10}" for mode in MODES)
        + "".join(f"{'now/' + base:>12}" for base in ratios)
    )
    for name in best["before"]:
        values = [best[mode][name] for mode in MODES]
        print(
            f"{name:<22}"
            + "".join(f"{v:>10.2f}" for v in values)
            + "".join(f"{best['now'][name] / best[base][name]:>11.2f}x" for base in ratios)
        )


if __name__ == "__main__":
    main()
