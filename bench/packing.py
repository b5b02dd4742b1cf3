"""Tree-packed vs per-turn training cost of one long trajectory, measured in one run.

A synthetic 40-turn trajectory (think dropped): a 500-token prompt; each turn samples a
span of 150 think + 50 action tokens and gets a 137-token observation, so the context
grows to about 8k tokens. Both layouts compute the same loss (tests/test_packing.py,
tests/test_packing_hybrid.py) with one forward + backward of the factory model; printed
per trajectory length: tokens processed per trajectory and per loss token (and against
the lower bound, every distinct token once: the trunk plus each turn's think), wall (and
process CPU) time of the step, best of the repeats, which interleave the layouts; and the
per-turn / packed ratios.

    .venv/bin/python bench/packing.py [--turns 40] [--preset qwen3-tiny] [--repeats 2]
    .venv/bin/python bench/packing.py --preset qwen3_5-tiny --turns 10 40 57  # hybrid

A hybrid student (qwen3_5-tiny: Gated DeltaNet layers beside full attention) packs only
through the kv kernel (slime_ext.hybrid_tree), so the mask kernel is left out for it.

Goals (issues: tree-packed training; hybrid students packed): processed <= 1.2 x the
lower bound; wall time at least 5x better than per turn at 40 turns. Not run by CI.
"""

from __future__ import annotations

import argparse
import random
import time
import warnings
from typing import Any

import torch
import transformers

from rollout.trajectory import Task, Trajectory, TrajectoryStatus, Turn
from slime_ext.hybrid_tree import is_hybrid
from slime_ext.local.trainer import LocalTrainer, TrainerConfig
from slime_ext.models.factory import build_model, build_tokenizer
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


def timed_step(trainer: LocalTrainer, trajectory: Trajectory) -> tuple[float, float]:
    """Wall and process CPU seconds of one step. Packed: the trajectory in one forward +
    backward. Per turn: one sample per turn, accumulated (a padded batch of all 40 turns
    would need [40, heads, 8k, 8k] scores)."""
    if trainer.layout == "packed":
        parts = [trajectory]
    else:
        parts = [trajectory.model_copy(update={"turns": [turn]}) for turn in trajectory.turns]
    trainer.optimizer.zero_grad(set_to_none=True)
    wall, cpu = time.perf_counter(), time.process_time()
    for part in parts:
        loss, _ = trainer.loss([part], "opd")
        loss.backward()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, nargs="+", default=[40])
    parser.add_argument("--prompt", type=int, default=500)
    parser.add_argument("--think", type=int, default=150)
    parser.add_argument("--action", type=int, default=50)
    parser.add_argument("--observation", type=int, default=137)
    parser.add_argument("--preset", default="qwen3-tiny")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()  # the torch-kernel fallback notes
    torch.manual_seed(0)
    model = build_model(args.preset, build_tokenizer(), seed=0)
    layouts = {"packed-kv": ("packed", "kv"), "per_turn": ("per_turn", "kv")}
    if not is_hybrid(model):
        layouts["packed-mask"] = ("packed", "mask")
    print(f"model {args.preset}" + (" (hybrid: linear attention)" if is_hybrid(model) else ""))
    for turns in args.turns:
        measure(model, layouts, turns, args)


def measure(
    model: torch.nn.Module, layouts: dict[str, tuple[str, str]], turns: int, args: Any
) -> None:
    trajectory = synthetic(turns, args.prompt, args.think, args.action, args.observation)
    lower = trajectory.turns[-1].context_len + sum(t.think_len for t in trajectory.turns)
    loss_tokens = trajectory.span_token_count()
    print(
        f"trajectory: {turns} turns, last context {trajectory.turns[-1].context_len} "
        f"tokens, {loss_tokens} span tokens; lower bound {lower} tokens"
    )
    trainers, processed = {}, {}
    for name, (layout, kernel) in layouts.items():
        build = per_turn_batch if layout == "per_turn" else packed_batch
        processed[name] = build([trajectory], "kl").num_processed_tokens
        config = TrainerConfig(sequence_layout=layout, packed_kernel=kernel)  # type: ignore[arg-type]
        trainers[name] = LocalTrainer(model, config)
    # repeats interleave the layouts, so a change of machine load hits all of them
    wall: dict[str, float] = dict.fromkeys(layouts, float("inf"))
    cpu: dict[str, float] = dict.fromkeys(layouts, float("inf"))
    for _ in range(args.repeats):
        for name, trainer in trainers.items():
            seconds, cpu_seconds = timed_step(trainer, trajectory)
            wall[name], cpu[name] = min(wall[name], seconds), min(cpu[name], cpu_seconds)
    for name in layouts:
        print(
            f"  {name:11s} processed {processed[name]:7d} tokens, "
            f"{processed[name] / loss_tokens:.2f} per loss token "
            f"({processed[name] / lower:.2f}x the lower bound), forward+backward "
            f"{wall[name]:.2f} s wall, {cpu[name]:.2f} s cpu"
        )
    for name in layouts:
        if name == "per_turn":
            continue
        print(
            f"  per_turn / {name}: tokens {processed['per_turn'] / processed[name]:.1f}x, "
            f"time {wall['per_turn'] / wall[name]:.1f}x (cpu {cpu['per_turn'] / cpu[name]:.1f}x)"
        )


if __name__ == "__main__":
    main()
