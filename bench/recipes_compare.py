"""Recipes at equal steps on the same held-out set: OPD vs outcome RL vs SFT on teacher
traces, OPSD (the student's frozen snapshot with a reference hint) vs its no-hint
control, and OPRD (the snapshot with rule reminders, in the trainer's process).

Each recipe trains the bundled student for `--steps` steps with `--seeds` seeds (the
seed changes sampling and data order); greedy held-out accuracy after each run; mean
and a 95% interval over seeds per recipe; for the self-teacher recipes also the first
step's rollout/opd_reverse_kl (the hint is what makes the snapshot differ).

A self-teacher helps only if the model can use what its context adds. The bundled
student never saw a hint in its SFT data, and its hinted snapshot is a worse teacher than
itself (OPSD at 20 steps: 0% held-out, seed 0). An LLM reads a hint by following
instructions; the bench gives the small student that skill first: `--hint-literate-steps`
SFT steps (lr 1e-3) on worked traces, half of them with the reference hint in the user
message exactly as the OPSD teacher sees it. The self-teacher recipes (opsd, opsd_nohint,
oprd) all start from that student, and its own held-out accuracy is printed.
Not run by CI (tens of minutes on 2 cores).

    .venv/bin/python bench/recipes_compare.py [--steps 20] [--seeds 3] [--n-heldout 300]
        [--recipes opd,rl,sft_traces,opsd,opsd_nohint,oprd]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
import warnings
from pathlib import Path

from rollout.tasks.arithmetic import make_tasks, trace_messages
from slime_ext.local.demo_models import trace_trajectories
from slime_ext.local.loop import LocalRun, embedded_teacher, tir_harness
from slime_ext.local.opd_demo import _accuracy, bundled_models, demo_job


def run_recipe(
    recipe: str,
    seed: int,
    steps: int,
    heldout: list,
    teacher_dir: Path,
    student_dir: Path,
    root: Path,
    lr: float | None = None,
) -> list[float]:
    run_dir = root / f"{recipe}-{seed}"
    job = demo_job(run_dir, steps).model_copy(deep=True)
    if lr is not None:
        job.algorithm.lr = lr
    job.model.seed = seed
    job.algorithm.recipe = {"sft_traces": "sft", "opsd_nohint": "opsd"}.get(recipe, recipe)  # type: ignore[assignment]
    if recipe.startswith("opsd"):
        job.teacher.kind = "self"
        job.teacher.hint = "none" if recipe == "opsd_nohint" else "reference"
    if recipe == "oprd":  # in-process snapshot with rule reminders, refreshed 20/40/60/80%
        job.teacher.kind = "self"
        job.teacher.hint = "none"
        job.teacher.snapshot = "refresh"
    job.logging.wandb_mode = "disabled"
    tasks = make_tasks(4000, "train", seed=seed)
    run = LocalRun(job, student_dir, run_dir)
    if recipe == "sft_traces":
        # SFT on the teacher's kind of data: worked traces, no rollouts.
        harness = tir_harness()
        from rollout.chat import ChatRenderer

        renderer = ChatRenderer(run.tokenizer, harness.tools)
        traces = trace_trajectories(renderer, harness, steps * job.rollout.tasks_per_step, seed)
        per_step = job.rollout.tasks_per_step
        for step in range(steps):
            run.trainer.step(traces[step * per_step : (step + 1) * per_step], "sft")
        run.save()
    elif recipe == "opd":
        with embedded_teacher(teacher_dir, run_dir / "teacher.log") as url:
            asyncio.run(run.train(tasks, url))
    elif recipe.startswith("opsd"):  # the teacher: a frozen snapshot of the student
        with embedded_teacher(student_dir, run_dir / "teacher.log") as url:
            history = asyncio.run(run.train(tasks, url))
        FIRST_KL[(recipe, seed)] = history[0].get("rollout/opd_reverse_kl", float("nan"))
    elif recipe == "oprd":
        history = asyncio.run(run.train(tasks, None))
        FIRST_KL[(recipe, seed)] = history[0].get("rollout/opd_reverse_kl", float("nan"))
    else:
        asyncio.run(run.train(tasks, None))
    return asyncio.run(_accuracy(run_dir / "checkpoint", heldout))


FIRST_KL: dict[tuple[str, int], float] = {}
SELF_TEACHER_RECIPES = ("opsd", "opsd_nohint", "oprd")


def hint_literate_student(student_dir: Path, out_dir: Path, steps: int, seed: int = 0) -> Path:
    """The bundled student after `steps` SFT steps on traces, half of them hinted."""
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.chat import ChatRenderer, trajectory_from_conversation
    from rollout.harness.prompts import read_prompts
    from rollout.trajectory import MaskTier
    from slime_ext.local.trainer import LocalTrainer, TrainerConfig

    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    model = AutoModelForCausalLM.from_pretrained(student_dir)
    harness = tir_harness()
    renderer = ChatRenderer(tokenizer, harness.tools)
    prompts = read_prompts("hints")
    rng = random.Random(seed)
    data = []
    for task in make_tasks(steps * 16, "train", seed=1000 + seed):
        messages = harness.initial_messages(task)
        if rng.random() < 0.5:  # the teacher's view: the hint after the task
            hint = prompts["reference_expression"].format(expression=task.metadata["expression"])
            messages[-1] = {
                **messages[-1],
                "content": messages[-1]["content"] + prompts["insert"].format(hint=hint),
            }
        trajectory = trajectory_from_conversation(
            renderer, task, messages + trace_messages(task), task.task_id, reward=1.0
        )
        trajectory.turns[-1].mask_tier = MaskTier.VALID
        data.append(trajectory)
    trainer = LocalTrainer(model, TrainerConfig(lr=1e-3, grad_clip=1.0))
    for step in range(steps):
        trainer.step(data[step * 16 : (step + 1) * 16], "sft")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def interval(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0
    return mean - half, mean + half


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--n-heldout", type=int, default=300)
    parser.add_argument("--recipes", default="opd,rl,sft_traces")
    parser.add_argument("--lr", type=float, default=None, help="default: the demo's (1e-3)")
    parser.add_argument(
        "--self-teacher-lr",
        type=float,
        default=None,
        help="the self-teacher recipes' learning rate (default: --lr)",
    )
    parser.add_argument(
        "--hint-literate-steps",
        type=int,
        default=60,
        help="SFT steps that teach the self-teacher recipes' student to read hints (0: off)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    student_dir, teacher_dir = bundled_models()
    heldout = make_tasks(args.n_heldout, "heldout", seed=1)
    results: dict[str, list[float]] = {}
    recipes = args.recipes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        self_student = student_dir
        if args.hint_literate_steps and set(recipes) & set(SELF_TEACHER_RECIPES):
            self_student = hint_literate_student(
                student_dir, Path(tmp) / "student-hint-literate", args.hint_literate_steps
            )
            start = asyncio.run(_accuracy(self_student, heldout))
            print(f"hint-literate student: {sum(start) / len(start):.1%} held-out", flush=True)
        for recipe in recipes:
            for seed in range(args.seeds):
                start_dir = self_student if recipe in SELF_TEACHER_RECIPES else student_dir
                lr = args.lr
                if recipe in SELF_TEACHER_RECIPES and args.self_teacher_lr is not None:
                    lr = args.self_teacher_lr
                correct = run_recipe(
                    recipe, seed, args.steps, heldout, teacher_dir, start_dir, Path(tmp), lr
                )
                results.setdefault(recipe, []).append(sum(correct) / len(correct))
                print(f"{recipe} seed {seed}: {results[recipe][-1]:.1%}", flush=True)
    for recipe, accuracies in results.items():
        low, high = interval(accuracies)
        print(
            f"{recipe:>10}: mean {statistics.fmean(accuracies):.1%} "
            f"[{low:.1%}, {high:.1%}] over {len(accuracies)} seeds"
        )
    for recipe in ("opsd", "opsd_nohint", "oprd"):
        kls = [v for (r, _), v in FIRST_KL.items() if r == recipe]
        if kls:
            print(f"{recipe:>11}: first-step opd_reverse_kl mean {statistics.fmean(kls):.4f}")


if __name__ == "__main__":
    main()
