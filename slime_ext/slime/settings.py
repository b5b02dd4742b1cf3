"""What the hooks read from slime's `args`: our job config, and Megatron's parallel layout.

slime gives a hook nothing but `args`; our settings reach it through `--custom-config-path`,
whose YAML keys become attributes of `args` (slime/utils/arguments.py, slime_validate_args).
The key `opd_job_config` names our job YAML (slime_ext.job.config.JobConfig).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_ext.job.config import OPRD_ON_SLIME, JobConfig, load_config
from slime_ext.job.slime_flags import TOP_P_BELOW_ONE, refusal_reason

CONFIG_KEY = "opd_job_config"
UNSUPPORTED_SLIME_ARGS = {
    flag: refusal_reason(f"--{flag.replace('_', '-')}")
    for flag in ("group_rm", "allgather_cp", "calculate_per_token_loss")
}
"""slime arguments whose data layout or reduction our hooks cannot honour, and why."""
CONFIG_ENV = "OPD_JOB_CONFIG"


class HookConfigError(ValueError):
    """The hooks cannot find or accept the job config slime was started with."""


def config_path(args: Any) -> str:
    """The job config named by `args.opd_job_config` (or $OPD_JOB_CONFIG), absolute."""
    path = getattr(args, CONFIG_KEY, None) or os.environ.get(CONFIG_ENV)
    if not path:
        raise HookConfigError(
            f"no job config: pass --custom-config-path with a YAML holding `{CONFIG_KEY}: "
            f"/path/to/job.yaml` (or set ${CONFIG_ENV}); `opd launch` writes both"
        )
    return str(Path(path).resolve())


def job_config(args: Any) -> JobConfig:
    """The job config slime was started with, checked against slime's own arguments."""
    job = load_job(config_path(args))
    _check_against_slime(job, args)
    return job


@functools.cache
def load_job(path: str) -> JobConfig:
    # slime calls the loss once per micro-batch: parse the YAML once per process
    return load_config(path)


def _check_against_slime(job: JobConfig, args: Any) -> None:
    """Recipes the hooks run (not OPRD's shared_support failure loss); and invariant 3:
    one temperature on both sides of the KL. slime divides the student's logits by
    --rollout-temperature; the teacher server applies the temperature our rollout sends,
    which is the job's. They must be the same number."""
    if job.algorithm.recipe == "oprd" and job.algorithm.oprd_failure_loss == "shared_support":
        raise HookConfigError(OPRD_ON_SLIME)
    for flag, why in UNSUPPORTED_SLIME_ARGS.items():
        if getattr(args, flag, False):
            raise HookConfigError(f"--{flag.replace('_', '-')}: {why}")
    top_p = getattr(args, "rollout_top_p", None)
    if top_p is not None and float(top_p) != 1.0:
        raise HookConfigError(
            f"--rollout-top-p {top_p}: {TOP_P_BELOW_ONE}: set rollout.top_p 1 (and no "
            "--rollout-top-p)"
        )
    slime_temperature = getattr(args, "rollout_temperature", None)
    if slime_temperature is not None and float(slime_temperature) != job.rollout.temperature:
        raise HookConfigError(
            f"--rollout-temperature {slime_temperature} differs from the job's "
            f"rollout.temperature {job.rollout.temperature}: the student's log-probs and "
            "the teacher's would be taken at different temperatures; set them equal"
        )


@dataclass(frozen=True)
class Parallel:
    """This rank's place in Megatron's tensor- and context-parallel groups."""

    tp_group: Any = None
    tp_rank: int = 0
    tp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1


def megatron_parallel() -> Parallel:
    """Read from megatron.core's parallel_state; one process when it is not initialized."""
    try:
        from megatron.core import parallel_state as mpu
    except ImportError:
        return Parallel()
    if not mpu.model_parallel_is_initialized():
        return Parallel()
    return Parallel(
        tp_group=mpu.get_tensor_model_parallel_group(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        tp_size=mpu.get_tensor_model_parallel_world_size(),
        cp_rank=mpu.get_context_parallel_rank(),
        cp_size=mpu.get_context_parallel_world_size(),
    )
