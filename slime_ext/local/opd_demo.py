"""`opd demo [swe]`: per-turn OPD on one machine that visibly learns.

Greedy held-out accuracy of the bundled student, a few minutes of per-turn OPD against
the bundled teacher (served by `opd-teacher` on 127.0.0.1), greedy accuracy again; a
before/after table with a paired 95% interval, a PNG of accuracy and opd_reverse_kl
over steps, and runs/demo/summary.json.

- tir (`opd demo`): math with a python tool; accuracy is the share of correct answers.
- swe (`opd demo swe`): mini-SWE repositories in the job's sandboxes; accuracy is the
  share of held-out tasks resolved (hidden tests), and the summary carries what the agent
  did before and after (turns, tokens per turn, valid tool calls, submissions, aborts);
  every evaluation trajectory is kept in eval/.

The SWE demo's sandboxes are local by default; `sandbox="docker"` runs them as containers
of an image that must already be present (the demo pulls nothing), checked before any
model loads. The summary records the backend and image: in a container the agent sees
another python and working directory, so the numbers are those of that backend.
"""

from __future__ import annotations

import asyncio
import json
import os
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
from rollout.runner import rollout_metrics
from rollout.tasks import mini_swe
from rollout.tasks.arithmetic import make_tasks
from rollout.trajectory import Trajectory, write_jsonl
from sandbox.base import SandboxUnavailableError
from sandbox.docker import DOCKER_FAILURES, docker_client
from sandbox.fleet.images import has_image
from slime_ext.job.assembly import harness_for
from slime_ext.job.config import JobConfig, load_config
from slime_ext.job.sandboxes import JobSandboxes, run_owner
from slime_ext.local.evaluate import (
    accuracy_metrics,
    correct,
    evaluate,
    heldout_tasks,
    paired_difference,
)
from slime_ext.local.loop import LocalRun, embedded_teacher, load_metrics, tir_harness
from slime_ext.local.progress import accuracy_text, agent_fields
from slime_ext.local.wandb_log import WandbLogger
from slime_ext.models.refs import bundled_models

DEMO_CONFIGS = {"tir": "demo.yaml", "swe": "demo-swe.yaml"}
DEMO_DEFAULTS = {"tir": {"steps": 24, "n_heldout": 300}, "swe": {"steps": 16, "n_heldout": 100}}
"""`opd demo`'s steps and held-out count per harness."""
SWE_TRAIN_TASKS = 2000
"""mini-SWE tasks the SWE demo draws its training steps from (seed model.seed)."""
SWE_DOCKER_IMAGE = "opd-sandbox-swe-base:latest"
"""The SWE demo's image under Docker (git, python, pytest: docker/sandbox-swe-base.Dockerfile)."""
SWE_DOCKER_IMAGE_BUILD = (
    "DOCKER_BUILDKIT=0 docker build -f docker/sandbox-swe-base.Dockerfile "
    f"-t {SWE_DOCKER_IMAGE} docker/"
)


class DemoSandboxError(ValueError):
    """Sandbox options the demo cannot run with, and what to pass instead."""


def demo_job(
    run_dir: Path,
    steps: int,
    eval_every_steps: int = 0,
    seed: int | None = None,
    harness: str = "tir",
    sandbox: str = "local",
    image: str | None = None,
) -> JobConfig:
    """launch/configs/demo.yaml (demo-swe.yaml) with this run's directory, step count,
    evaluations and (when given) seed: the order of training problems and every sampled
    token. SWE: `sandbox` local or docker (of `image`, default SWE_DOCKER_IMAGE); TIR's
    python tool always runs in a local sandbox, so it takes neither."""
    if harness != "swe" and sandbox != "local":
        raise DemoSandboxError(
            f"--sandbox {sandbox} applies to `opd demo swe`: the tir demo's python tool "
            "always runs in a local sandbox (drop --sandbox)"
        )
    if sandbox != "docker" and image is not None:
        raise DemoSandboxError(
            "--image names the image of Docker sandboxes: add --sandbox docker (with `opd "
            "demo swe`) or drop --image"
        )
    path = Path(str(resources.files("launch.configs").joinpath(DEMO_CONFIGS[harness])))
    overrides = [
        f"logging.run_dir={run_dir}",
        f"logging.eval_every_steps={eval_every_steps}",
        f"algorithm.steps={steps}",
    ]
    if seed is not None:
        overrides.append(f"model.seed={seed}")
    if sandbox == "docker":  # quoted: an override's value is read as YAML
        overrides.append("sandbox.backend=docker")
        overrides.append(f"sandbox.image={json.dumps(image or SWE_DOCKER_IMAGE)}")
    return load_config(path, overrides)


def docker_sandbox_problem(job: JobConfig) -> str | None:
    """Why the Docker sandboxes of a docker-backed `job` cannot start here (no daemon
    answers at DOCKER_HOST or the local socket; its image is not present: the demo pulls
    nothing), or None (also for other backends)."""
    if job.sandbox.backend != "docker":
        return None
    image = job.sandbox.image or SWE_DOCKER_IMAGE
    try:
        client = docker_client(timeout_s=10)
    except DOCKER_FAILURES as exc:
        where = os.environ.get("DOCKER_HOST") or "the local socket"
        return (
            f"--sandbox docker: no Docker daemon answers at {where} ({exc}); start dockerd, "
            "or run with --sandbox local"
        )
    try:
        if has_image(client, image):
            return None
    except DOCKER_FAILURES as exc:
        return f"--sandbox docker: cannot inspect the image {image} ({exc})"
    finally:
        client.close()
    build = (
        f"build it with `{SWE_DOCKER_IMAGE_BUILD}`"
        if image == SWE_DOCKER_IMAGE
        else "pull or build it"
    )
    return f"--sandbox docker: the image {image} is not present here: {build} (docker/README.md)"


async def _trajectories(model_dir: Path, tasks: list[Any], job: JobConfig) -> list[Trajectory]:
    """Greedy trajectories of `model_dir` on `tasks` (SWE: in the job's sandboxes, within
    its rollout limits; TIR: the math demo's fixed limits)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    policy = HFPolicy(model, tokenizer.eos_token_id)
    if job.rollout.harness != "swe":
        return await evaluate(policy, tokenizer, tasks, tir_harness(), rounds=job.rollout.rounds)
    rollout = job.rollout
    async with JobSandboxes.of_job(job, run_owner(job.logging.run_dir)) as sandboxes:
        return await evaluate(
            policy,
            tokenizer,
            tasks,
            harness_for(job, sandboxes),
            concurrency=rollout.concurrency,
            max_turns=rollout.max_turns,
            max_new_tokens=rollout.max_new_tokens,
            max_context_tokens=rollout.max_context_tokens,
            rounds=rollout.rounds,
        )


async def heldout_scores(
    model_dir: Path, tasks: list[Any], job: JobConfig | None = None
) -> list[float]:
    """1.0 per task `model_dir` solves greedily, 0.0 per other (`job`: a SWE job's
    sandboxes and limits; None: math TIR as `opd demo` scores it)."""
    job = job or demo_job(Path("runs/demo"), steps=1)
    return correct(await _trajectories(model_dir, tasks, job))


def _scored(
    console: Console, label: str, model_dir: Path, tasks: list[Any], job: JobConfig
) -> list[Trajectory]:
    """Greedy trajectories of `model_dir` on `tasks`, announced and printed as a line each
    (the spinner alone shows nothing in a log file); SWE: written to eval/<label>.jsonl."""
    started = time.perf_counter()
    unit = "tasks" if job.rollout.harness == "swe" else "problems"
    doing = f"evaluating {label} on {len(tasks)} held-out {unit} (greedy)"
    if not console.is_terminal:
        console.print(doing, highlight=False)
    with console.status(doing):
        trajectories = asyncio.run(_trajectories(model_dir, tasks, job))
    seconds = time.perf_counter() - started
    text = accuracy_text(accuracy_metrics(correct(trajectories)), seconds)
    line = f"{label}: held-out accuracy {text}"
    if job.rollout.harness == "swe":
        path = job.logging.run_dir / "eval" / f"{label.replace(' ', '_')}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        write_jsonl(path, trajectories)
        line += "  " + "  ".join(agent_fields("opd", rollout_metrics(trajectories)))
    console.print(line, highlight=False, markup=False)
    return trajectories


AGENT_KEYS = (
    "rollout/num_turns",
    "rollout/tokens_per_turn",
    "rollout/valid_action_frac",
    "rollout/submitted_frac",
    "rollout/masked_turn_frac",
)
"""What the SWE summary reports of each evaluation's agent (as eval_before / eval_after)."""


def agent_summary(trajectories: list[Trajectory]) -> dict[str, float]:
    """The agent metrics of one evaluation's trajectories, with the count of aborts (the
    infrastructure ended them, as `opd eval` counts them; the step limit is not one)."""
    metrics = rollout_metrics(trajectories)
    summary = {key.removeprefix("rollout/"): metrics[key] for key in AGENT_KEYS}
    summary["aborts"] = metrics["rollout/aborted"]
    return summary


def run_opd_demo(
    out: Path | None = None,
    steps: int | None = None,
    n_heldout: int | None = None,
    console: Console | None = None,
    fresh: bool = True,
    eval_every_steps: int = 0,
    seed: int | None = None,
    harness: str = "tir",
    sandbox: str = "local",
    image: str | None = None,
) -> dict[str, Any]:
    """The demo of `harness` (tir or swe); None: the harness's default run directory
    (runs/demo, runs/demo-swe), steps and held-out count (DEMO_DEFAULTS). Raises
    DemoSandboxError for sandbox options it cannot run with, and SandboxUnavailableError
    when Docker sandboxes cannot start here, before anything is loaded or removed."""
    console = console or Console()
    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    out = out or Path("runs/demo" if harness == "tir" else f"runs/demo-{harness}")
    steps = steps if steps is not None else DEMO_DEFAULTS[harness]["steps"]
    n_heldout = n_heldout if n_heldout is not None else DEMO_DEFAULTS[harness]["n_heldout"]
    job = demo_job(out, steps, eval_every_steps, seed, harness, sandbox, image)
    if problem := docker_sandbox_problem(job):
        raise SandboxUnavailableError(problem)
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    student_dir, teacher_dir = bundled_models(harness)
    heldout = heldout_tasks(n_heldout, harness)
    if harness == "swe":
        train_tasks = mini_swe.generate_tasks(SWE_TRAIN_TASKS, seed=job.model.seed)
        backend = job.sandbox.backend
        where = f"Docker ({job.sandbox.image})" if backend == "docker" else backend
        what = f"per-turn OPD on mini-SWE in {where} sandboxes, {n_heldout} held-out tasks"
    else:
        train_tasks = make_tasks(4000, "train", seed=1)
        what = f"per-turn OPD on math TIR, {n_heldout} held-out problems"
    unit = "tasks" if harness == "swe" else "problems"
    console.print(
        f"[bold]opd demo[/bold]: {what}, {steps} steps of {job.rollout.tasks_per_step} {unit}"
    )
    before_run = _scored(console, "student before", student_dir, heldout, job)
    before = correct(before_run)
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
    after_run = _scored(console, "student after", out / "checkpoint", heldout, job)
    after = correct(after_run)
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
    }
    if harness == "swe":
        summary["harness"] = harness
        summary["sandbox"] = {"backend": job.sandbox.backend, "image": job.sandbox.image}
        summary["eval_before"] = agent_summary(before_run)
        summary["eval_after"] = agent_summary(after_run)
        summary["training"] = training_summary(history)
    summary["wall_s"] = time.perf_counter() - started
    summary["plot"] = str(_plot(history, summary, out / "demo.png"))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print_table(console, summary)
    return summary


TRAINING_KEYS = (*AGENT_KEYS, "rollout/opd_reverse_kl", "rollout/student_gt_teacher_frac")


def training_summary(history: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The agent metrics of the first and last training step's rollouts."""
    if not history:
        return {}
    return {
        which: {key.removeprefix("rollout/"): row[key] for key in TRAINING_KEYS if key in row}
        for which, row in (("first_step", history[0]), ("last_step", history[-1]))
    }


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
    swe = summary.get("harness") == "swe"
    measure = "resolved" if swe else "accuracy"
    table = Table(title="opd demo swe" if swe else "opd demo")
    table.add_column("")
    table.add_column("value", justify="right")
    low, high = summary["diff_ci95"]
    kl_first, kl_last = summary["opd_reverse_kl_first"], summary["opd_reverse_kl_last"]
    rows = [
        (f"held-out {measure} before", f"{summary['accuracy_before']:.1%}"),
        (f"held-out {measure} after", f"{summary['accuracy_after']:.1%}"),
        ("paired difference (95% CI)", f"{summary['diff']:+.1%} [{low:+.1%}, {high:+.1%}]"),
        (
            "opd_reverse_kl first -> last",
            f"{kl_first:.3f} -> {kl_last:.3f}" if kl_first is not None else "n/a",
        ),
        ("steps", str(summary["steps"])),
        ("wall time", f"{summary['wall_s']:.0f} s"),
    ]
    if "eval_before" in summary:  # SWE: what the agent did, before -> after
        before, after = summary["eval_before"], summary["eval_after"]
        rows[2:2] = [
            (f"held-out {name}", f"{form(before[key])} -> {form(after[key])}")
            for name, key, form in (
                ("turns per task", "num_turns", "{:.1f}".format),
                ("tokens per turn", "tokens_per_turn", "{:.0f}".format),
                ("valid tool calls", "valid_action_frac", "{:.0%}".format),
                ("tasks submitted", "submitted_frac", "{:.0%}".format),
                ("aborts", "aborts", "{:.0f}".format),
            )
        ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(f"wrote {summary['plot']} and summary.json", highlight=False)
