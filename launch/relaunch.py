"""A cluster run launched again: the same run goes on, or the launch stops before anything
starts. A step of `opd launch`'s plan on the head node, after the plan wrote the new job
config beside the run's own:

    python3 -m launch.relaunch --run-dir RUN [--allow-changed KEY ...]

RUN/job.yaml is the config the run was launched with, RUN/job.next.yaml the one this
launch brings. Nothing recorded: a first launch (the new config becomes RUN/job.yaml),
refused when cluster.save_dir already holds checkpoints (slime would resume another run's).
Recorded: the settings are compared as `opd train` compares a resumed run's, and a
change is accepted when it is about where and how the job runs (nodes, ports, the
launch's own options), when `--allow-changed` names it, or refused, naming each change
and the flag that accepts it, exit 2, RUN/job.yaml untouched. slime resumes from the
newest checkpoint in cluster.save_dir itself (--load); this step says which.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from launch.prune_checkpoints import complete_iteration
from slime_ext.job.config import ConfigError, JobConfig, config_from_dict
from slime_ext.local.checkpoints import (
    SAFE_CHANGES,
    RunDirError,
    check_allowed_keys,
    compare_settings,
    recorded_settings,
)

JOB = "job.yaml"
NEXT = "job.next.yaml"
WHERE_IT_RUNS = "where and how the job runs, not what it trains"
RUNS_WHERE = (
    "cluster.executor", "cluster.head", "cluster.workers", "cluster.sandbox_hosts",
    "cluster.ssh_command", "cluster.remote_shell", "cluster.slime_dir", "cluster.megatron_dir",
    "cluster.env", "cluster.ray_port", "cluster.dashboard_port", "cluster.ray_start_args",
    "cluster.ray_wait_s", "cluster.secret_env", "cluster.sbatch_options", "cluster.srun_options",
    "teacher.node", "teacher.url", "teacher.port", "teacher.api_key_env",
    "teacher.unauthenticated", "teacher.request_timeout_s", "teacher.serve_args", "teacher.tp",
    "sandbox.max_sandboxes", "sandbox.hosts", "sandbox.fleet_file",
)  # fmt: skip
CLUSTER_SAFE_CHANGES: dict[str, str] = {
    **{k: v for k, v in SAFE_CHANGES.items() if not k.startswith("cluster")},
    **dict.fromkeys(RUNS_WHERE, WHERE_IT_RUNS),
}
"""What a relaunch may change without --allow-changed, and why."""


def check(run_dir: Path, allowed: Sequence[str] = ()) -> list[str]:
    """Compare RUN/job.next.yaml with the run's RUN/job.yaml; on success make it the run's
    config and return what to say; RunDirError when a change is refused."""
    next_path, path = run_dir / NEXT, run_dir / JOB
    job = config_from_dict(yaml.safe_load(next_path.read_text()), source=str(next_path))
    check_allowed_keys(job, allowed)
    notes = []
    if path.is_file():
        notes += _compare(path, job, allowed)
    elif (step := _resumed_step(job)) is not None:
        raise RunDirError(
            f"cannot start a new run in {run_dir}: cluster.save_dir {job.cluster.save_dir} "
            f"holds checkpoints (the newest after step {step}) of a run this directory did "
            "not record, and slime would resume from them (--load). Give the new run its "
            "own cluster.save_dir, or launch it with the run's own logging.run_dir"
        )
    else:
        notes.append(f"a new run in {run_dir}")
    os.replace(next_path, path)
    return [*notes, _resume_note(job)]


def _compare(path: Path, job: JobConfig, allowed: Sequence[str]) -> list[str]:
    step = _resumed_step(job) or 0
    before = recorded_settings(path)
    accepted, refused = compare_settings(before, job, step, allowed, CLUSTER_SAFE_CHANGES)
    if refused:
        flags = " ".join(f"--allow-changed {key}" for key in refused)
        raise RunDirError(
            f"cannot relaunch {path.parent}: the run there was launched with other settings "
            f"({path})\n" + "\n".join(refused.values()) + "\nlaunch it with another "
            f"logging.run_dir (and cluster.save_dir) to start a new run, or go on with the "
            f"new settings anyway: opd launch ... {flags}"
        )
    return [f"relaunching with a changed setting: {change}" for change in accepted]


def _resumed_step(job: JobConfig) -> int | None:
    """The training step slime resumes after: its newest complete checkpoint's iteration
    + 1 (slime saves after step s as iteration s - 1); None before the first."""
    save = job.cluster.save_dir
    iteration = complete_iteration(Path(save)) if save else None
    return None if iteration is None else iteration + 1


def _resume_note(job: JobConfig) -> str:
    step = _resumed_step(job)
    if step is None:
        return f"no checkpoint in {job.cluster.save_dir} yet: training starts at step 0"
    return (
        f"slime resumes from the checkpoint after step {step} in {job.cluster.save_dir} "
        f"(step {step} of {job.algorithm.steps})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--allow-changed", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        for note in check(args.run_dir, args.allow_changed):
            print(note, flush=True)
    except (RunDirError, ConfigError, OSError) as err:
        print(err, file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
