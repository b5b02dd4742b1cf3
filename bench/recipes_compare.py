"""Recipes at equal steps on the same held-out set: OPD vs outcome RL vs SFT on teacher
traces, OPSD (the student's frozen snapshot with a reference hint) vs its no-hint
control, and OPRD (the snapshot with rule reminders, in the trainer's process).

Each recipe trains the bundled student for `--steps` steps with `--seeds` seeds (the
seed changes sampling and data order); greedy held-out accuracy after each run; mean
and a 95% interval over seeds per recipe; for the self-teacher recipes also the first
step's rollout/opd_reverse_kl (the hint is what makes the snapshot differ).
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

from rollout.tasks.arithmetic import make_tasks
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
) -> list[float]:
    run_dir = root / f"{recipe}-{seed}"
    job = demo_job(run_dir, steps).model_copy(deep=True)
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
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    student_dir, teacher_dir = bundled_models()
    heldout = make_tasks(args.n_heldout, "heldout", seed=1)
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes.split(","):
            for seed in range(args.seeds):
                correct = run_recipe(
                    recipe, seed, args.steps, heldout, teacher_dir, student_dir, Path(tmp)
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
