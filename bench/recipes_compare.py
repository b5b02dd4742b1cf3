"""Recipes at equal steps, each on its held-out set: OPD vs outcome RL vs SFT on teacher
traces, OPSD (the student's frozen snapshot with a reference hint) vs its no-hint
control, and OPRD (the snapshot with rule reminders, in the trainer's process).

Each recipe trains its student for `--steps` steps with `--seeds` seeds (the
seed changes sampling and data order); greedy held-out accuracy after each run; mean
and a 95% interval over seeds per recipe; for the self-teacher recipes also
rollout/opd_reverse_kl at the first step and averaged over steps (the hint is what makes
the snapshot differ).

A self-teacher helps only where its context adds something the model can use. On the
default families the reference hint ("the answer is the value of <expression>") says
nothing a model that knows the templates does not: measured, a student taught to read
hints scored lower with one (61% vs 77% held-out after 240 SFT steps) and OPSD on them
lost to its control. The self-teacher recipes therefore train and evaluate on the
`unseen` rephrasings (rollout/tasks/arithmetic.yaml): wordings no model here trained on,
whose operation only the hint names. Their model must also copy reliably: the bundled
student garbles copied numbers (300 hint-reading steps from it: 10% held-out with the hint,
2% without), so they start from the bundled teacher checkpoint (greedy 91.5% on the
default families), taught to read hints by `--hint-literate-steps` SFT steps (lr 1e-3) of
16 traces: 8 default-family ones (half hinted) and 8 `practice` rephrasings, always
hinted, in the user message exactly as the OPSD teacher sees it; some practice wordings
leave the operation open, so only the hint answers them (measured at 150 steps: 51% on
the unseen rephrasings with the hint, 1% without, 97% on the default families). That
model's held-out accuracy on the unseen rephrasings with and without the hint is printed
before the runs; a self-teacher can only pass on the difference. Measured (2026-11-29,
`--recipes opsd,opsd_nohint --seeds 3 --steps 12 --n-heldout 300`, about 50 minutes):
start 1.7% without the hint, 39.7% with it; OPSD 11.8% [5.5%, 18.1%] (15.3, 14.7, 5.3)
vs no-hint 1.6% [1.0%, 2.1%] (1.7, 1.0, 2.0); opd_reverse_kl at the first step 0.553 vs
0.000, averaged over steps 0.453 vs 0.055 (the control's snapshot drifts from the student
only as the student moves).
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

from rollout.harness.prompts import read_prompts
from rollout.hints import ReferenceHint
from rollout.tasks.arithmetic import make_tasks, rephrased_families, trace_messages
from rollout.trajectory import Task
from slime_ext.local.demo_models import trace_trajectories
from slime_ext.local.loop import LocalRun, embedded_teacher, tir_harness
from slime_ext.local.opd_demo import demo_job, heldout_scores
from slime_ext.models.refs import bundled_models


def run_recipe(
    recipe: str,
    seed: int,
    steps: int,
    heldout: list,
    teacher_dir: Path,
    student_dir: Path,
    root: Path,
    lr: float | None = None,
    families: list[str] | None = None,
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
    tasks = make_tasks(4000, "train", seed=seed, families=families)
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
        KL[(recipe, seed)] = [m.get("rollout/opd_reverse_kl", math.nan) for m in history]
    elif recipe == "oprd":
        history = asyncio.run(run.train(tasks, None))
        KL[(recipe, seed)] = [m.get("rollout/opd_reverse_kl", math.nan) for m in history]
    else:
        asyncio.run(run.train(tasks, None))
    return asyncio.run(heldout_scores(run_dir / "checkpoint", heldout))


KL: dict[tuple[str, int], list[float]] = {}
"""rollout/opd_reverse_kl of each step, per self-teacher run."""
SELF_TEACHER_RECIPES = ("opsd", "opsd_nohint", "oprd")


REFERENCE_HINT = ReferenceHint()


def with_hint(task: Task, prompts: dict[str, str]) -> Task:
    """The task as the OPSD teacher sees it: the reference hint after the problem."""
    hint = REFERENCE_HINT.text(task)
    assert hint is not None, f"{task.task_id} has no reference to hint with"
    return task.model_copy(update={"prompt": task.prompt + prompts["insert"].format(hint=hint)})


def hint_literate_student(base_dir: Path, out_dir: Path, steps: int, seed: int = 0) -> Path:
    """`base_dir`'s model after `steps` SFT steps of 16 traces: 8 default-family ones
    (half hinted, so the default skill stays) and 8 `practice` rephrasings, all hinted
    (their wording is new: the hint is the way to the expression)."""
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.chat import ChatRenderer, trajectory_from_conversation
    from rollout.trajectory import MaskTier
    from slime_ext.local.trainer import LocalTrainer, TrainerConfig

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    harness = tir_harness()
    renderer = ChatRenderer(tokenizer, harness.tools)
    prompts = read_prompts("hints")
    rng = random.Random(seed)
    known = make_tasks(steps * 8, "train", seed=1000 + seed)
    practice = make_tasks(
        steps * 8, "train", seed=1000 + seed, families=rephrased_families("practice")
    )
    pairs: list[tuple[Task, Task]] = []  # (what the model is shown, the task)
    for step in range(steps):
        for task in known[step * 8 : (step + 1) * 8]:
            pairs.append((with_hint(task, prompts) if rng.random() < 0.5 else task, task))
        for task in practice[step * 8 : (step + 1) * 8]:
            pairs.append((with_hint(task, prompts), task))
    data = []
    for view, task in pairs:
        messages = harness.initial_messages(view) + trace_messages(task)
        trajectory = trajectory_from_conversation(
            renderer, task, messages, task.task_id, reward=1.0
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
        default=150,
        help="SFT steps that teach the self-teacher recipes' student to read hints (0: off)",
    )
    parser.add_argument(
        "--self-student",
        type=Path,
        default=None,
        help="a hint-literate student made before (its directory): skips the SFT steps",
    )
    parser.add_argument(
        "--save-self-student",
        type=Path,
        default=None,
        help="keep the hint-literate student made here in this directory",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    student_dir, teacher_dir = bundled_models()
    heldout = make_tasks(args.n_heldout, "heldout", seed=1)
    unseen = rephrased_families("unseen")
    self_heldout = make_tasks(args.n_heldout, "heldout", seed=1, families=unseen)
    results: dict[str, list[float]] = {}
    recipes = args.recipes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        self_student = args.self_student or student_dir
        wanted = bool(set(recipes) & set(SELF_TEACHER_RECIPES))
        if args.self_student is None and args.hint_literate_steps and wanted:
            out = args.save_self_student or Path(tmp) / "student-hint-literate"
            self_student = hint_literate_student(teacher_dir, out, args.hint_literate_steps)
        if wanted:
            prompts = read_prompts("hints")
            hinted = [with_hint(task, prompts) for task in self_heldout]
            for name, tasks in (("without", self_heldout), ("with", hinted)):
                start = asyncio.run(heldout_scores(self_student, tasks))
                print(
                    f"self-teacher recipes' student, unseen rephrasings {name} the hint: "
                    f"{sum(start) / len(start):.1%} held-out",
                    flush=True,
                )
        for seed in range(args.seeds):  # seed-major: each seed's recipes pair up early
            for recipe in recipes:
                self_teacher = recipe in SELF_TEACHER_RECIPES
                lr = args.lr
                if self_teacher and args.self_teacher_lr is not None:
                    lr = args.self_teacher_lr
                correct = run_recipe(
                    recipe,
                    seed,
                    args.steps,
                    self_heldout if self_teacher else heldout,
                    teacher_dir,
                    self_student if self_teacher else student_dir,
                    Path(tmp),
                    lr,
                    unseen if self_teacher else None,
                )
                results.setdefault(recipe, []).append(sum(correct) / len(correct))
                print(f"{recipe} seed {seed}: {results[recipe][-1]:.1%}", flush=True)
    for recipe, accuracies in results.items():
        low, high = interval(accuracies)
        where = "unseen rephrasings" if recipe in SELF_TEACHER_RECIPES else "default families"
        print(
            f"{recipe:>11}: mean {statistics.fmean(accuracies):.1%} "
            f"[{low:.1%}, {high:.1%}] over {len(accuracies)} seeds ({where})"
        )
    for recipe in SELF_TEACHER_RECIPES:
        runs = [kls for (name, _), kls in KL.items() if name == recipe]
        if runs:
            first = statistics.fmean(kls[0] for kls in runs)
            overall = statistics.fmean(statistics.fmean(kls) for kls in runs)
            print(
                f"{recipe:>11}: opd_reverse_kl first step {first:.4f}, "
                f"mean over steps {overall:.4f}"
            )


if __name__ == "__main__":
    main()
