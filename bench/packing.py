"""Tree-packed vs per-turn training cost of one long trajectory, measured in one run.

A synthetic 40-turn trajectory (think dropped): a 500-token prompt; each turn samples a
span of 150 think + 50 action tokens and gets a 137-token observation, so the context
grows to about 8k tokens. Both layouts compute the same loss (tests/test_packing.py) with
one forward + backward of the factory model; printed: tokens processed per trajectory
(and against the lower bound, every distinct token once: the trunk plus each turn's
think), wall time of the step, and the per-turn / packed ratios.

    .venv/bin/python bench/packing.py [--turns 40] [--preset qwen3-tiny] [--repeats 2]

Goals (issue: tree-packed training): processed <= 1.2 x the lower bound; wall time at
least 5x better than per turn. Not run by CI.
"""

from __future__ import annotations

import argparse
import random
import time
import warnings

import torch

from rollout.trajectory import Task, Trajectory, TrajectoryStatus, Turn
from slime_ext.local.factory import build_model, build_tokenizer
from slime_ext.local.trainer import LocalTrainer, TrainerConfig
from slime_ext.turns import packed_batch, per_turn_batch


def synthetic(turns: int, prompt: int, think: int, action: int, observation: int) -> Trajectory:
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(5, 800) for _ in range(n)]

    trunk = ids(prompt)
    steps = []
    for _ in range(turns):
        span = ids(think + action)
        steps.append(
            Turn(
                context_len=len(trunk),
                span_ids=span,
                think_len=think,
                logprobs=[-1.0] * len(span),
                teacher_logprobs=[-1.5] * len(span),
            )
        )
        trunk = trunk + span[think:] + ids(observation)
    return Trajectory(
        trajectory_id="bench",
        task=Task(task_id="bench", kind="synthetic", prompt="p"),
        trunk_ids=trunk,
        turns=steps,
        status=TrajectoryStatus.COMPLETED,
        status_reason="done",
        reward=1.0,
    )


def timed_step(trainer: LocalTrainer, trajectory: Trajectory, repeats: int) -> float:
    """Packed: the trajectory in one forward + backward. Per turn: one sample per turn,
    accumulated (a padded batch of all 40 turns would need [40, heads, 8k, 8k] scores)."""
    if trainer.layout == "packed":
        parts = [trajectory]
    else:
        parts = [trajectory.model_copy(update={"turns": [turn]}) for turn in trajectory.turns]
    best = float("inf")
    for _ in range(repeats):
        trainer.optimizer.zero_grad(set_to_none=True)
        started = time.perf_counter()
        for part in parts:
            loss, _ = trainer.loss([part], "opd")
            loss.backward()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--prompt", type=int, default=500)
    parser.add_argument("--think", type=int, default=150)
    parser.add_argument("--action", type=int, default=50)
    parser.add_argument("--observation", type=int, default=137)
    parser.add_argument("--preset", default="qwen3-tiny")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    trajectory = synthetic(args.turns, args.prompt, args.think, args.action, args.observation)
    model = build_model(args.preset, build_tokenizer(), seed=0)
    lower = trajectory.turns[-1].context_len + sum(t.think_len for t in trajectory.turns)
    print(
        f"trajectory: {args.turns} turns, last context {trajectory.turns[-1].context_len} "
        f"tokens, {trajectory.span_token_count()} span tokens; lower bound {lower} tokens"
    )
    results = {}
    for name, layout, kernel in (
        ("packed-kv", "packed", "kv"),
        ("packed-mask", "packed", "mask"),
        ("per_turn", "per_turn", "kv"),
    ):
        build = per_turn_batch if layout == "per_turn" else packed_batch
        processed = build([trajectory], "kl").num_processed_tokens
        config = TrainerConfig(sequence_layout=layout, packed_kernel=kernel)  # type: ignore[arg-type]
        seconds = timed_step(LocalTrainer(model, config), trajectory, args.repeats)
        results[name] = (processed, seconds)
        print(
            f"{name:11s} processed {processed:7d} tokens ({processed / lower:.2f}x the lower "
            f"bound), forward+backward {seconds:.2f} s",
            flush=True,
        )
    turn_tokens, turn_s = results["per_turn"]
    for name in ("packed-kv", "packed-mask"):
        tokens, seconds = results[name]
        print(
            f"per_turn / {name}: tokens {turn_tokens / tokens:.1f}x, time {turn_s / seconds:.1f}x"
        )


if __name__ == "__main__":
    main()
