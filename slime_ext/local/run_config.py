"""`opd train CONFIG.yaml` on one machine: resolve the models, start the embedded teacher
when the job asks for one, run the local loop (resuming from the run directory, or
starting it over: checkpoints.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from transformers.utils import logging as hf_logging

from rollout.tasks import mini_swe
from rollout.tasks.arithmetic import make_tasks
from rollout.trajectory import Task
from slime_ext.job.assembly import teacher_in_process
from slime_ext.job.config import JobConfig
from slime_ext.local.checkpoints import ResumeOptions
from slime_ext.local.evaluate import heldout_tasks
from slime_ext.local.loop import LocalRun, embedded_teacher
from slime_ext.local.preflight import UnsupportedLocalJob, check_local_job
from slime_ext.local.wandb_log import WandbLogger
from slime_ext.models.refs import resolve_model

TRAIN_TASKS = 4000


def training_tasks(job: JobConfig) -> list[Task]:
    """What `opd train` draws each step's tasks from: synthetic arithmetic (tir) or mini-SWE
    repositories (swe), by the job's seed."""
    if job.rollout.harness == "swe":
        return mini_swe.generate_tasks(TRAIN_TASKS, seed=job.model.seed)
    return make_tasks(TRAIN_TASKS, "train", seed=job.model.seed)


@contextlib.contextmanager
def teacher_url(job: JobConfig, run_dir: Path) -> Iterator[tuple[str | None, str | None]]:
    """(url, api key) of the teacher service the job uses, started here when embedded; for
    OPSD (and OPRD with teacher_topk or sampled) a frozen snapshot of the student's initial
    checkpoint; none for OPRD's in-process teacher."""
    recipe, teacher = job.algorithm.recipe, job.teacher
    if teacher_in_process(job):
        yield None, None
        return
    if recipe in ("opsd", "oprd") and teacher.kind == "self":
        snapshot = resolve_model(job.model.student, run_dir / "models", seed=job.model.seed)
        key = secrets.token_hex(16)  # reloads (ema / refresh) need an authenticated service
        with embedded_teacher(snapshot, run_dir / "teacher.log", api_key=key) as url:
            yield url, key
        return
    if recipe != "opd":
        yield None, None
        return
    if teacher.kind == "remote":
        api_key = os.environ.get(teacher.api_key_env) if teacher.api_key_env else None
        yield teacher.url, api_key
        return
    if teacher.kind != "embedded" or teacher.model is None:
        raise UnsupportedLocalJob(
            f"teacher kind {teacher.kind!r} is not run by the local trainer yet"
        )
    model_dir = resolve_model(teacher.model, run_dir / "models", seed=job.model.seed + 1)
    with embedded_teacher(model_dir, run_dir / "teacher.log") as url:
        yield url, None


def run_local_job(
    job: JobConfig, console: Console | None = None, resume: ResumeOptions | None = None
) -> list[dict[str, Any]]:
    """Train `job` in its logging.run_dir; RunDirError (before anything is trained) when
    that directory holds a run with other settings or lacks the checkpoint to resume."""
    check_local_job(job)  # what `opd config validate` checks for `opd train`
    hf_logging.disable_progress_bar()  # a bar per checkpoint save, as \r noise in a log
    run_dir = Path(job.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    student_dir = resolve_model(job.model.student, run_dir / "models", seed=job.model.seed)
    tasks = training_tasks(job)
    heldout = None
    if job.logging.eval_every_steps:
        heldout = heldout_tasks(job.logging.eval_problems, job.rollout.harness)
    run = LocalRun(job, student_dir, run_dir, console, resume)  # refuses before W&B starts
    logger = WandbLogger(job, run_dir, name=run_dir.name)
    try:
        with teacher_url(job, run_dir) as (url, api_key):
            return asyncio.run(
                run.train(
                    tasks,
                    url,
                    api_key=api_key,
                    on_step=lambda step, m: logger.log(m, step),
                    heldout=heldout,
                )
            )
    finally:
        logger.finish()
