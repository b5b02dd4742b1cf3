"""What the embedded trainer (`opd train`) runs, checked before anything is built.

`run_local_job` refuses a job with these problems, and `opd config validate` runs the same
check on a config with parallel.gpus_per_node 0. Light on purpose: no torch import.
"""

from __future__ import annotations

from slime_ext.job.config import JobConfig
from slime_ext.models.refs import bundled_name_problem

LOCAL_RECIPES = ("opd", "opsd", "oprd", "rl", "sft")
"""Recipes the local trainer runs (SSD trains on pre-tokenized data, on a cluster)."""


class UnsupportedLocalJob(ValueError):
    """A job the embedded trainer cannot run (it says what to use instead)."""


def local_job_problems(job: JobConfig) -> list[str]:
    """Every reason the local trainer refuses `job`, each with what to do instead."""
    problems = []
    if job.parallel.gpus_per_node:
        problems.append(
            "parallel.gpus_per_node > 0 is a cluster job: run it with `opd launch`, or set "
            "parallel.gpus_per_node: 0 for the local trainer"
        )
    recipe = job.algorithm.recipe
    if recipe not in LOCAL_RECIPES:
        problems.append(
            f"algorithm.recipe {recipe!r}: the local trainer runs {', '.join(LOCAL_RECIPES)}; "
            "SSD trains on a cluster (`opd launch`) from `opd ssd sample` / `opd ssd export` "
            "data in cluster.tasks_file"
        )
    models = {"model.student": job.model.student}
    if recipe == "opd" and job.teacher.kind == "embedded" and job.teacher.model:
        models["teacher.model"] = job.teacher.model
    for key, name in models.items():
        if problem := bundled_name_problem(name):
            problems.append(f"{key} {problem}")
    return problems


def local_job_warnings(job: JobConfig) -> list[str]:
    """What may go wrong on this machine without making the job wrong (said, not refused)."""
    problem = sandbox_memory_problem(job, host_memory_mb())
    return [problem] if problem else []


def host_memory_mb() -> int | None:
    """This machine's memory (the local trainer's sandboxes run here); None if unknown."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (ValueError, OSError, AttributeError):
        return None


def sandbox_memory_problem(job: JobConfig, memory_mb: int | None) -> str | None:
    """SWE sandboxes that could hold more memory at once than the host has: each may use
    sandbox.memory_mb, and min(rollout.concurrency, sandbox.max_sandboxes) run at once."""
    sandbox = job.sandbox
    if job.rollout.harness != "swe" or sandbox.backend == "e2b" or memory_mb is None:
        return None
    count = min(job.rollout.concurrency, sandbox.max_sandboxes)
    wanted = count * sandbox.memory_mb
    if wanted <= memory_mb:
        return None
    fits = max(memory_mb // sandbox.memory_mb, 1)
    return (
        f"sandbox.memory_mb {sandbox.memory_mb} x {count} sandboxes at once "
        f"(min of rollout.concurrency {job.rollout.concurrency} and sandbox.max_sandboxes "
        f"{sandbox.max_sandboxes}) = {wanted} MB, more than this machine's {memory_mb} MB: "
        "if the sandboxes use what they may, the machine runs out of memory; set "
        f"rollout.concurrency to at most {fits}, or lower sandbox.memory_mb"
    )


def check_local_job(job: JobConfig) -> None:
    problems = local_job_problems(job)
    if problems:
        raise UnsupportedLocalJob("not runnable by `opd train`:\n  " + "\n  ".join(problems))
