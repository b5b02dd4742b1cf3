"""What a local training run prints: one plain line per step, per checkpoint written and per
evaluation. Printed lines, not a live display, so a log file (nohup, Slurm) holds them as a
terminal's scrollback does:

step 2/3  loss 0.02383  reverse_kl 0.0238  reward 0.000  tokens/s 79  elapsed 3s  eta 2s
step 2/8  loss 0.4413  reverse_kl 0.4403  reward 0.250  tokens/s 61  turns 7.4  tok/turn 41
    valid 93%  submitted 75%  aborts 0  s>t 0.38  elapsed 51s  eta 2m33s    (SWE, one line)
eval after step 2/3: held-out accuracy 12.5% [2.2%, 47.1%] (n=8, 2 s)
checkpoint written: runs/tiny/checkpoints/step_00002 (step 2/3)
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from rich.console import Console

KL_RECIPES = ("opd", "opsd", "oprd")
"""Recipes whose signal is the sampled reverse KL to the teacher (the others: reward, loss)."""


def clock(seconds: float) -> str:
    """A duration as 42s, 6m05s or 1h02m."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def accuracy_text(metrics: Mapping[str, float], seconds: float) -> str:
    """`accuracy_metrics` and the time it took as 42.2% [30.9%, 54.3%] (n=64, 12 s)."""
    return (
        f"{metrics['eval/heldout_accuracy']:.1%} "
        f"[{metrics['eval/heldout_accuracy_ci95_low']:.1%}, "
        f"{metrics['eval/heldout_accuracy_ci95_high']:.1%}] "
        f"(n={metrics['eval/heldout_problems']:.0f}, {seconds:.0f} s)"
    )


def step_fields(recipe: str, metrics: Mapping[str, float]) -> list[str]:
    """Loss, the recipe's signal and throughput of one step's metrics, as `name value`."""
    trained = metrics.get("train/trajectories_trained", 0.0)
    fields = [f"loss {metrics['train/loss']:.4g}" if trained else "loss - (nothing trained)"]
    if recipe in KL_RECIPES:
        kl = metrics.get("rollout/opd_reverse_kl")
        fields.append(f"reverse_kl {kl:.4f}" if kl is not None else "reverse_kl -")
    fields.append(f"reward {metrics.get('rollout/reward', 0.0):.3f}")
    if "train/lr" in metrics:
        fields.append(f"lr {metrics['train/lr']:.2e}")
    step_time = metrics.get("perf/step_time", 0.0)
    if step_time > 0:  # loss-carrying tokens per second of the step's wall time
        fields.append(f"tokens/s {metrics.get('train/loss_tokens', 0.0) / step_time:.0f}")
    return fields


def agent_fields(recipe: str, metrics: Mapping[str, float]) -> list[str]:
    """What a SWE agent did in one step's rollouts (the report's agent metrics): turns per
    trajectory, tokens per turn, share of valid tool calls, share submitted, aborts (the
    infrastructure ended them, as `opd eval` counts them), and for KL recipes how often the
    student was more sure than the teacher."""
    fields = [
        f"turns {metrics.get('rollout/num_turns', 0.0):.1f}",
        f"tok/turn {metrics.get('rollout/tokens_per_turn', 0.0):.0f}",
        f"valid {metrics.get('rollout/valid_action_frac', 0.0):.0%}",
        f"submitted {metrics.get('rollout/submitted_frac', 0.0):.0%}",
        f"aborts {metrics.get('rollout/aborted', 0.0):.0f}",
    ]
    if recipe in KL_RECIPES and "rollout/student_gt_teacher_frac" in metrics:
        fields.append(f"s>t {metrics['rollout/student_gt_teacher_frac']:.2f}")
    return fields


class TrainingReport:
    """Prints a run's progress on `console`; elapsed and ETA count from its creation."""

    def __init__(
        self, console: Console, recipe: str, first_step: int, total: int, agent: bool = False
    ) -> None:
        """`agent`: step lines carry `agent_fields` too (SWE)."""
        self.console = console
        self.agent = agent
        self.recipe = recipe
        self.first_step = first_step
        self.total = total
        self.started = time.monotonic()

    def line(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def step(self, done: int, metrics: Mapping[str, float]) -> None:
        """After `done` steps of `total`: the step that just ended."""
        elapsed = time.monotonic() - self.started
        per_step = elapsed / max(done - self.first_step, 1)
        fields = [f"step {done}/{self.total}", *step_fields(self.recipe, metrics)]
        if self.agent:
            fields += agent_fields(self.recipe, metrics)
        fields += [f"elapsed {clock(elapsed)}", f"eta {clock(per_step * (self.total - done))}"]
        self.line("  ".join(fields))

    def evaluation(self, done: int, metrics: Mapping[str, float], seconds: float) -> None:
        text = accuracy_text(metrics, seconds)
        self.line(f"eval after step {done}/{self.total}: held-out accuracy {text}")

    def checkpoint(self, path: Path, done: int) -> None:
        self.line(f"checkpoint written: {path} (step {done}/{self.total})")
