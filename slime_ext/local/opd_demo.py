"""`opd demo`: per-turn OPD on one machine that visibly learns.

Greedy held-out accuracy of the bundled student, a few minutes of per-turn OPD against
the bundled teacher (served by `opd-teacher` on 127.0.0.1), greedy accuracy again; a
before/after table with a paired 95% interval, a PNG of accuracy and opd_reverse_kl
over steps, and runs/demo/summary.json.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from importlib import resources
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from rollout.policy import HFPolicy
from rollout.tasks.arithmetic import make_tasks
from slime_ext.job.config import JobConfig, load_config
from slime_ext.local.evaluate import (
    accuracy_metrics,
    correct,
    evaluate,
    heldout_tasks,
    paired_difference,
)
from slime_ext.local.loop import LocalRun, embedded_teacher, load_metrics, tir_harness
from slime_ext.local.progress import accuracy_text
from slime_ext.local.wandb_log import WandbLogger
from slime_ext.models.refs import bundled_models


def demo_job(
    run_dir: Path, steps: int, eval_every_steps: int = 0, seed: int | None = None
) -> JobConfig:
    """launch/configs/demo.yaml with this run's directory, step count, evaluations and
    (when given) seed: the order of training problems and every sampled token."""
    path = Path(str(resources.files("launch.configs").joinpath("demo.yaml")))
    overrides = [
        f"logging.run_dir={run_dir}",
        f"logging.eval_every_steps={eval_every_steps}",
        f"algorithm.steps={steps}",
    ]
    if seed is not None:
        overrides.append(f"model.seed={seed}")
    return load_config(path, overrides)


async def _accuracy(model_dir: Path, tasks: list[Any]) -> list[float]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    policy = HFPolicy(model, tokenizer.eos_token_id)
    return correct(await evaluate(policy, tokenizer, tasks, tir_harness()))


def _scored(console: Console, label: str, model_dir: Path, tasks: list[Any]) -> list[float]:
    """Greedy scores of `model_dir` on `tasks`, announced and printed as a line each (the
    spinner alone shows nothing in a log file)."""
    started = time.perf_counter()
    doing = f"evaluating {label} on {len(tasks)} held-out problems (greedy)"
    if not console.is_terminal:
        console.print(doing, highlight=False)
    with console.status(doing):
        scores = asyncio.run(_accuracy(model_dir, tasks))
    text = accuracy_text(accuracy_metrics(scores), time.perf_counter() - started)
    console.print(f"{label}: held-out accuracy {text}", highlight=False, markup=False)
    return scores


def run_opd_demo(
    out: Path = Path("runs/demo"),
    steps: int = 24,
    n_heldout: int = 300,
    console: Console | None = None,
    fresh: bool = True,
    eval_every_steps: int = 0,
    seed: int | None = None,
) -> dict[str, Any]:
    console = console or Console()
    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    student_dir, teacher_dir = bundled_models()
    heldout = heldout_tasks(n_heldout)
    train_tasks = make_tasks(4000, "train", seed=1)
    job = demo_job(out, steps, eval_every_steps, seed)
    console.print(
        f"[bold]opd demo[/bold]: per-turn OPD on math TIR, {n_heldout} held-out "
        f"problems, {steps} steps of {job.rollout.tasks_per_step} problems"
    )
    before = _scored(console, "student before", student_dir, heldout)
    logger = WandbLogger(job, out, "opd-demo")
    run = LocalRun(job, student_dir, out, console)
    with embedded_teacher(teacher_dir, out / "teacher.log") as teacher_url:
        asyncio.run(
            run.train(
                train_tasks,
                teacher_url,
                on_step=lambda step, metrics: logger.log(metrics, step),
                heldout=heldout[: job.logging.eval_problems],
            )
        )
    after = _scored(console, "student after", out / "checkpoint", heldout)
    history = load_metrics(out)
    if history:  # the final evaluation under the names of the periodic ones, at its step
        logger.log(accuracy_metrics(after), int(history[-1]["step"]))
    logger.finish()
    mean, low, high = paired_difference(before, after)
    summary = {
        "accuracy_before": sum(before) / len(before),
        "accuracy_after": sum(after) / len(after),
        "n_heldout": len(heldout),
        "diff": mean,
        "diff_ci95": [low, high],
        "opd_reverse_kl_first": history[0].get("rollout/opd_reverse_kl") if history else None,
        "opd_reverse_kl_last": history[-1].get("rollout/opd_reverse_kl") if history else None,
        "steps": len(history),
        "seed": job.model.seed,
        "wall_s": time.perf_counter() - started,
    }
    summary["plot"] = str(_plot(history, summary, out / "demo.png"))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print_table(console, summary)
    return summary


def _plot(history: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [row["step"] for row in history]
    right.plot(
        steps,
        [row.get("rollout/opd_reverse_kl", float("nan")) for row in history],
        label="opd_reverse_kl",
    )
    right.plot(
        steps,
        [row.get("rollout/reward", float("nan")) for row in history],
        label="rollout reward (sampled)",
    )
    right.set_xlabel("step")
    right.legend()
    right.set_title("training")
    left.bar(
        ["before", "after"],
        [summary["accuracy_before"], summary["accuracy_after"]],
        color=["tab:gray", "tab:blue"],
    )
    left.set_ylim(0, 1)
    left.set_title(f"greedy held-out accuracy (n={summary['n_heldout']})")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _print_table(console: Console, summary: dict[str, Any]) -> None:
    table = Table(title="opd demo")
    table.add_column("")
    table.add_column("value", justify="right")
    low, high = summary["diff_ci95"]
    kl_first, kl_last = summary["opd_reverse_kl_first"], summary["opd_reverse_kl_last"]
    rows = [
        ("held-out accuracy before", f"{summary['accuracy_before']:.1%}"),
        ("held-out accuracy after", f"{summary['accuracy_after']:.1%}"),
        ("paired difference (95% CI)", f"{summary['diff']:+.1%} [{low:+.1%}, {high:+.1%}]"),
        (
            "opd_reverse_kl first -> last",
            f"{kl_first:.3f} -> {kl_last:.3f}" if kl_first is not None else "n/a",
        ),
        ("steps", str(summary["steps"])),
        ("wall time", f"{summary['wall_s']:.0f} s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(f"wrote {summary['plot']} and summary.json", highlight=False)
