"""The demos' teachers and students: one factory model trained by SFT on worked traces;
the student is an early checkpoint of the run, the teacher its end.

- tir (`opd demo`): worked arithmetic with the python tool.
- swe (`opd demo swe`): mini-SWE repositories fixed by `mini_swe.worked_script` (list the
  files, read the module, run the tests, run the issue's example, edit, check, submit),
  each trace run for real through the swe harness in local sandboxes and kept only when
  its submission resolves the task.

Recorded recipe (reproduced by `opd demo-models build [--harness swe]`): harness, factory
preset, seed, number of training tasks, batch size, learning rate and the two checkpoint
steps; the losses are written next to the models in recipe.json.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout.chat import ChatRenderer, trajectory_from_conversation
from rollout.harness.swe import SWEHarness, SWEHarnessConfig
from rollout.harness.swe_scripts import ScriptedSWEPolicy
from rollout.harness.tir import TIRHarness
from rollout.tasks import mini_swe
from rollout.tasks.arithmetic import make_tasks, trace_messages
from rollout.trajectory import MaskTier, Trajectory
from slime_ext.local.evaluate import evaluate
from slime_ext.local.trainer import LocalTrainer, TrainerConfig
from slime_ext.models.factory import build_model, build_tokenizer


class DemoModelsRecipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    harness: Literal["tir", "swe"] = "tir"
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

    @classmethod
    def for_harness(cls, harness: str, **fields: Any) -> DemoModelsRecipe:
        """The recorded recipe of a harness's bundled models, with `fields` changed."""
        return cls.model_validate({**RECORDED[harness], **fields})


RECORDED: dict[str, dict[str, Any]] = {
    "tir": {"harness": "tir"},
    "swe": {
        "harness": "swe",
        "train_tasks": 800,
        "batch_size": 8,
        "lr": 3e-3,
        "student_step": 500,
        "teacher_step": 700,
    },
}
"""The recipes the bundled models were built with (`opd demo-models build`)."""
SWE_TRACE_SEED_OFFSET = 1000
"""mini-SWE training traces use tasks of seed recipe.seed + this: never the held-out set
(seed -1) nor the tasks a demo trains on (its model.seed)."""


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


def worked_trajectories(
    renderer: ChatRenderer, harness: SWEHarness, count: int, seed: int, concurrency: int = 4
) -> list[Trajectory]:
    """`count` mini-SWE tasks solved by their worked scripts through `harness` (commands
    and grading in its sandboxes); refuses a script that does not resolve its task."""
    tasks = mini_swe.generate_tasks(count, seed=seed)
    scripts = {task.task_id: mini_swe.worked_script(task) for task in tasks}
    policy = ScriptedSWEPolicy("worked", renderer, scripts)
    run = evaluate(
        policy,
        renderer.tokenizer,
        tasks,
        harness,
        concurrency=concurrency,
        max_turns=max(len(script) for script in scripts.values()),
        max_new_tokens=SWE_TRACE_MAX_NEW_TOKENS,
        max_context_tokens=SWE_TRACE_MAX_CONTEXT,
    )
    trajectories = asyncio.run(run)
    if failed := [t for t in trajectories if not (t.reward or 0) > 0]:
        first = failed[0]
        raise RuntimeError(
            f"{len(failed)} of {count} worked scripts did not resolve their task; first: "
            f"{first.task.task_id} ({first.status.value}: {first.status_reason})"
        )
    return trajectories


SWE_TRACE_MAX_NEW_TOKENS = 256
SWE_TRACE_MAX_CONTEXT = 8192


def demo_harness(recipe: DemoModelsRecipe, step_limit: int = 10) -> TIRHarness | SWEHarness:
    if recipe.harness == "swe":
        return SWEHarness(SWEHarnessConfig(step_limit=step_limit, command_timeout_s=30))
    return TIRHarness()


def build_demo_models(
    out_dir: Path, recipe: DemoModelsRecipe | None = None, log: Callable[[str], None] = print
) -> dict[str, Any]:
    recipe = recipe or DemoModelsRecipe()
    tokenizer = build_tokenizer()
    harness = demo_harness(recipe)
    renderer = ChatRenderer(tokenizer, harness.tools)
    started = time.perf_counter()
    if isinstance(harness, SWEHarness):
        log(f"running {recipe.train_tasks} worked mini-SWE scripts in local sandboxes")
        seed = recipe.seed + SWE_TRACE_SEED_OFFSET
        data = worked_trajectories(renderer, harness, recipe.train_tasks, seed)
        log(f"traces: {len(data)} resolved ({time.perf_counter() - started:.0f} s)")
    else:
        data = trace_trajectories(renderer, harness, recipe.train_tasks, recipe.seed)
    model = build_model(recipe.preset, tokenizer, seed=recipe.seed)
    trainer = LocalTrainer(model, TrainerConfig(lr=recipe.lr, grad_clip=1.0))
    rng = random.Random(recipe.seed)
    history: list[dict[str, float]] = []
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
