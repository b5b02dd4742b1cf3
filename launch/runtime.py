"""The rollout side of a job config: harness, sampling and runner settings, built one way
for the local trainer and for the slime hooks."""

from __future__ import annotations

from launch.config import JobConfig
from rollout.harness.base import Harness
from rollout.harness.swe import SWEHarness, SWEHarnessConfig
from rollout.harness.tir import TIRConfig, TIRHarness
from rollout.policy import SamplingParams
from rollout.runner import RunnerConfig

TEACHER_RECIPES = ("opd", "opsd", "oprd")
"""Recipes whose rollouts are scored by a teacher, turn by turn."""


def teacher_in_process(job: JobConfig) -> bool:
    """OPRD with the shared-support KL: the teacher is a frozen copy of the student in the
    trainer's process (both full distributions), so rollouts are not scored by a service."""
    return job.algorithm.recipe == "oprd" and job.algorithm.oprd_failure_loss == "shared_support"


def sampling_params(job: JobConfig) -> SamplingParams:
    rollout = job.rollout
    return SamplingParams(
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
    )


def runner_config(job: JobConfig) -> RunnerConfig:
    rollout = job.rollout
    return RunnerConfig(
        concurrency=rollout.concurrency,
        max_turns=rollout.max_turns,
        max_new_tokens=rollout.max_new_tokens,
        max_context_tokens=rollout.max_context_tokens,
        trajectory_timeout_s=rollout.trajectory_timeout_s,
        sampling=sampling_params(job),
        teacher_scoring="per_turn"
        if job.algorithm.recipe in TEACHER_RECIPES and not teacher_in_process(job)
        else "none",
        teacher_top_k=job.teacher.top_k,
    )


def harness_for(job: JobConfig) -> Harness:
    """The job's harness with its default task families (local sandboxes)."""
    if job.rollout.harness == "tir":
        return TIRHarness(TIRConfig(max_tool_calls=job.rollout.max_turns))
    return SWEHarness(
        SWEHarnessConfig(
            step_limit=job.rollout.max_turns, command_timeout_s=job.sandbox.command_timeout_s
        )
    )
