"""The demo's teacher and student: one factory model trained by SFT on worked arithmetic
traces; the student is an early checkpoint of the run, the teacher its end.

Recorded recipe (reproduced by `opd demo-models build`): factory preset, seed, number of
training tasks, batch size, learning rate and the two checkpoint steps; the losses and
the held-out accuracy at each checkpoint are written next to the models in recipe.json.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollout.chat import ChatRenderer, trajectory_from_conversation
from rollout.harness.tir import TIRHarness
from rollout.tasks.arithmetic import make_tasks, trace_messages
from rollout.trajectory import MaskTier, Trajectory
from slime_ext.local.trainer import LocalTrainer, TrainerConfig
from slime_ext.models.factory import build_model, build_tokenizer


class DemoModelsRecipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    preset: str = "qwen3-small"
    seed: int = 0
    train_tasks: int = 4000
    batch_size: int = Field(default=16, ge=1)
    lr: float = 3e-3
    student_step: int = Field(default=500, ge=1)
    """The student is saved here: partly trained, so it errs often."""
    teacher_step: int = Field(default=1200, ge=1)
    snapshot_every: int = Field(default=0, ge=0)
    """Also save every this many steps (to choose the two steps); 0: only the two."""


def trace_trajectories(
    renderer: ChatRenderer, harness: TIRHarness, count: int, seed: int
) -> list[Trajectory]:
    trajectories = []
    for task in make_tasks(count, "train", seed=seed):
        messages = harness.initial_messages(task) + trace_messages(task)
        trajectory = trajectory_from_conversation(
            renderer, task, messages, task.task_id, reward=1.0
        )
        # The last turn answers without a tool call: parsing calls that tier 1, the TIR
        # harness calls it a valid final answer, and so must the traces.
        trajectory.turns[-1].mask_tier = MaskTier.VALID
        trajectories.append(trajectory)
    return trajectories


def build_demo_models(
    out_dir: Path, recipe: DemoModelsRecipe | None = None, log: Callable[[str], None] = print
) -> dict[str, Any]:
    recipe = recipe or DemoModelsRecipe()
    tokenizer = build_tokenizer()
    harness = TIRHarness()
    renderer = ChatRenderer(tokenizer, harness.tools)
    data = trace_trajectories(renderer, harness, recipe.train_tasks, recipe.seed)
    model = build_model(recipe.preset, tokenizer, seed=recipe.seed)
    trainer = LocalTrainer(model, TrainerConfig(lr=recipe.lr, grad_clip=1.0))
    rng = random.Random(recipe.seed)
    history: list[dict[str, float]] = []
    started = time.perf_counter()
    for step in range(1, recipe.teacher_step + 1):
        batch = rng.sample(data, recipe.batch_size)
        metrics = trainer.step(batch, "sft")
        history.append({"step": step, "nll": metrics["train/nll"]})
        if step % 50 == 0:
            log(
                f"step {step}: nll {metrics['train/nll']:.4f} "
                f"({time.perf_counter() - started:.0f} s)"
            )
        names = [
            name
            for name, at in (("student", recipe.student_step), ("teacher", recipe.teacher_step))
            if step == at
        ]
        if recipe.snapshot_every and step % recipe.snapshot_every == 0:
            names.append(f"step_{step}")
        for name in names:
            model.save_pretrained(out_dir / name)
            tokenizer.save_pretrained(out_dir / name)
            log(f"saved {name} at step {step}")
    summary = {
        "recipe": recipe.model_dump(),
        "history": history,
        "wall_s": time.perf_counter() - started,
    }
    (out_dir / "recipe.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
