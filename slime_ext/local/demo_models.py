"""The demos' teachers and students: one factory model trained by SFT on worked traces;
the student is an early checkpoint of the run, the teacher its end.

- tir (`opd demo`): worked arithmetic with the python tool.
- swe (`opd demo swe`): mini-SWE repositories fixed by `mini_swe.worked_script` (list the
  files, read the module, run the tests, run the issue's example, edit, check, submit),
  each trace run for real through the swe harness in local sandboxes and kept only when
  its submission resolves the task.

Recorded recipe (reproduced by `opd demo-models build [--harness swe]`): harness, factory
preset, seed, number of training tasks, batch size, learning-rate schedule and the two
checkpoint steps; the losses are written next to the models in recipe.json.

A fixed student step is a knife-edge for a small model at a high learning rate: the nll
curve repeats to its third digit while the greedy solve rate of one checkpoint is 0% and
of the next 25%. So a recipe may choose the student by a rule instead (`select_every`):
every so many steps the model is scored greedily on selection tasks (drawn with their own
seed, none a held-out test task), and the student is the first snapshot that solves at
least `student_solves` of them. The teacher is the last step, at the end of a decayed
schedule, where the weights barely move. Every score is kept in recipe.json.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import statistics
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
from rollout.trajectory import MaskTier, Task, Trajectory
from slime_ext.local.evaluate import evaluate, tasks_apart_from_test
from slime_ext.local.opd_demo import DEMO_DEFAULTS, demo_job, heldout_scores
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
    lr_schedule: Literal["constant", "cosine"] = "constant"
    lr_warmup_steps: int = Field(default=0, ge=0)
    min_lr: float = Field(default=0.0, ge=0)
    """Where cosine ends, at teacher_step."""
    student_step: int = Field(default=500, ge=1)
    """The student is saved here: partly trained, so it errs often (without select_every)."""
    teacher_step: int = Field(default=1200, ge=1)
    snapshot_every: int = Field(default=0, ge=0)
    """Also save every this many steps (to choose the two steps); 0: only the two."""
    select_every: int = Field(default=0, ge=0)
    """Score the model every this many steps on `select_tasks` selection tasks and save
    the first snapshot solving at least `student_solves` of them as the student (instead
    of student_step); 0: the fixed student_step."""
    select_tasks: int = Field(default=40, ge=1)
    student_solves: float = Field(default=0.2, gt=0, le=1)
    teacher_margin: float = Field(default=0.2, ge=0, le=1)
    """The teacher must solve at least this share of the selection tasks more than the
    student, or the build fails (its models and scores kept) as not separating them."""

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


SELECTION_SEEDS = {"swe": -3, "tir": 3}
"""The seeds of the tasks that choose the student: neither a training seed (>= 0) nor the
held-out test split's, nor the fair-baselines bench's validation seed (-2 for swe)."""


class DemoModelsError(RuntimeError):
    """A build that did not make the pair its recipe asks for (its files are kept)."""


def selection_tasks(harness: str, count: int) -> list[Task]:
    """`count` tasks drawn with the selection seed, none with a held-out test statement."""
    n_test = DEMO_DEFAULTS[harness]["n_heldout"]
    try:
        return tasks_apart_from_test(harness, count, SELECTION_SEEDS[harness], n_test)
    except ValueError as err:
        raise DemoModelsError(f"too few selection tasks: {err}") from None


class StudentSelection:
    """Scores snapshots on the selection tasks (greedy, the demo's scoring) until one
    solves `recipe.student_solves` of them; that one becomes `out_dir/student`."""

    def __init__(self, recipe: DemoModelsRecipe, out_dir: Path, log: Callable[[str], None]):
        self.recipe, self.out_dir, self.log = recipe, out_dir, log
        self.tasks = selection_tasks(recipe.harness, recipe.select_tasks)
        self.job = (
            demo_job(out_dir / "selection", 1, harness="swe") if recipe.harness == "swe" else None
        )
        self.solved: dict[int, float] = {}
        self.student_step: int | None = None
        if (out_dir / "student").exists():  # never beside a teacher it was not chosen with
            shutil.rmtree(out_dir / "student")
            log(f"removed {out_dir / 'student'} of an earlier build")

    def score(
        self,
        model: Any,
        tokenizer: Any,
        step: int,
        candidate: bool = True,
        saved: Path | None = None,
    ) -> float:
        """The share of the selection tasks the model solves at `step`; a `candidate` (a
        step before the teacher's) that reaches the target becomes the student. `saved`:
        where this step's weights already are (teacher/, a step_N snapshot), scored there
        instead of written again."""
        where = saved or self.out_dir / "snapshot"
        if saved is None:
            model.save_pretrained(where)
            tokenizer.save_pretrained(where)
        solved = statistics.fmean(asyncio.run(heldout_scores(where, self.tasks, self.job)))
        self.solved[step] = solved
        self.log(f"step {step}: solves {solved:.1%} of {len(self.tasks)} selection tasks")
        if candidate and self.student_step is None and solved >= self.recipe.student_solves:
            self.student_step = step
            if saved is None:
                where.rename(self.out_dir / "student")
            else:
                shutil.copytree(where, self.out_dir / "student")
            self.log(f"saved student at step {step}")
        if saved is None:
            shutil.rmtree(where, ignore_errors=True)
        return solved

    def record(self) -> dict[str, Any]:
        return {
            "seed": SELECTION_SEEDS[self.recipe.harness],
            "tasks": len(self.tasks),
            "solved": {str(step): solved for step, solved in self.solved.items()},
            "student_step": self.student_step,
        }

    def problem(self, teacher_step: int) -> str | None:
        """Why the pair is not what the recipe asks for, or None."""
        if self.student_step is None:
            return (
                f"no snapshot solved {self.recipe.student_solves:.0%} of the selection tasks "
                f"by step {teacher_step}: train longer or lower student_solves"
            )
        student, teacher = self.solved[self.student_step], self.solved[teacher_step]
        if teacher < student + self.recipe.teacher_margin:
            return (
                f"the teacher solves {teacher:.1%}, not {self.recipe.teacher_margin:.0%} more "
                f"than the student's {student:.1%}: the recipe does not separate them"
            )
        return None


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
    trainer = LocalTrainer(model, trainer_config(recipe))
    selection = StudentSelection(recipe, out_dir, log) if recipe.select_every else None
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
        names = (
            [f"step_{step}"] if recipe.snapshot_every and step % recipe.snapshot_every == 0 else []
        )
        if step == recipe.teacher_step:
            names.append("teacher")
        if selection is None and step == recipe.student_step:
            names.append("student")
        for name in names:
            model.save_pretrained(out_dir / name)
            tokenizer.save_pretrained(out_dir / name)
            log(f"saved {name} at step {step}")
        if selection is not None and (
            step == recipe.teacher_step
            or (selection.student_step is None and step % recipe.select_every == 0)
        ):
            saved = out_dir / names[-1] if names else None
            selection.score(model, tokenizer, step, step < recipe.teacher_step, saved)
    summary: dict[str, Any] = {
        "recipe": recipe.model_dump(),
        "history": history,
        "wall_s": time.perf_counter() - started,
    }
    if selection is not None:
        summary["selection"] = selection.record()
    (out_dir / "recipe.json").write_text(json.dumps(summary, indent=1) + "\n")
    if selection is not None and (problem := selection.problem(recipe.teacher_step)):
        raise DemoModelsError(f"{problem} (models and scores kept in {out_dir})")
    return summary


def trainer_config(recipe: DemoModelsRecipe) -> TrainerConfig:
    decay = recipe.lr_schedule != "constant"
    return TrainerConfig(
        lr=recipe.lr,
        grad_clip=1.0,
        lr_schedule=recipe.lr_schedule,
        lr_warmup_steps=recipe.lr_warmup_steps,
        min_lr=recipe.min_lr,
        lr_decay_steps=recipe.teacher_step if decay else None,
    )
