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


def check_local_job(job: JobConfig) -> None:
    problems = local_job_problems(job)
    if problems:
        raise UnsupportedLocalJob("not runnable by `opd train`:\n  " + "\n  ".join(problems))
