"""The rollout side of a job config: harness, sampling and runner settings, teacher
contexts, built one way for the local trainer, the slime hooks and the CLI (the sandboxes
in `slime_ext.job.sandboxes`)."""

from __future__ import annotations

import os
from typing import Any

from rollout.chat import ChatRenderer
from rollout.harness.base import Harness
from rollout.harness.swe import SWEHarness, SWEHarnessConfig
from rollout.harness.tir import TIRConfig, TIRHarness
from rollout.hints import HINTS_AFTER_ATTEMPT, HintedTeacherContext, StudentHint, hint_source
from rollout.policy import Policy, SamplingParams
from rollout.reminders import ReminderTeacherContext, read_reminder_file, reminder_source
from rollout.runner import RunnerConfig
from slime_ext.job.config import JobConfig
from slime_ext.job.sandboxes import JobSandboxes

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


def hint_after_attempt(job: JobConfig) -> bool:
    """OPSD whose hint is written from the finished trajectory (critic or student)."""
    return job.algorithm.recipe == "opsd" and job.teacher.hint in HINTS_AFTER_ATTEMPT


def runner_config(job: JobConfig) -> RunnerConfig:
    rollout = job.rollout
    scored = job.algorithm.recipe in TEACHER_RECIPES and not teacher_in_process(job)
    return RunnerConfig(
        concurrency=rollout.concurrency,
        max_turns=rollout.max_turns,
        max_new_tokens=rollout.max_new_tokens,
        max_context_tokens=rollout.max_context_tokens,
        trajectory_timeout_s=rollout.trajectory_timeout_s,
        sampling=sampling_params(job),
        # a hint that reads the attempt exists only once the trajectory ended
        teacher_scoring=("after" if hint_after_attempt(job) else "per_turn") if scored else "none",
        teacher_top_k=job.teacher.top_k,
    )


def hinted_teacher_context(
    job: JobConfig, renderer: ChatRenderer, initial_messages: Any, policy: Policy
) -> HintedTeacherContext | None:
    """OPSD: the self-teacher's hinted view of the student's contexts, from the job's hint
    source (`policy`: the one sampling the rollouts, which writes `student` hints); None
    for other recipes and for the no-hint control."""
    teacher = job.teacher
    if job.algorithm.recipe != "opsd":
        return None
    student = None
    if teacher.hint == "student":
        sampling = sampling_params(job).model_copy(
            update={"max_new_tokens": teacher.hint_max_new_tokens}
        )
        student = StudentHint(policy, renderer, sampling, job.rollout.max_context_tokens)
    key_env = teacher.critic_api_key_env
    source = hint_source(
        teacher.hint,
        teacher.critic_url,
        teacher.critic_model,
        critic_api_key=os.environ.get(key_env) if key_env else None,
        student=student,
    )
    if source is None:
        return None
    return HintedTeacherContext(renderer, initial_messages, source, teacher.hint_attempt_tokens)


def reminder_teacher_context(
    job: JobConfig, renderer: ChatRenderer
) -> ReminderTeacherContext | None:
    """OPRD: the self-teacher's reminded view of the student's contexts, from the job's
    reminder source and file; None for other recipes."""
    teacher = job.teacher
    if job.algorithm.recipe != "oprd":
        return None
    return ReminderTeacherContext(
        renderer,
        reminder_source(teacher.reminders, teacher.reminders_file),
        read_reminder_file(teacher.reminders_file),
    )


def harness_for(job: JobConfig, sandboxes: JobSandboxes | None = None) -> Harness:
    """The job's harness with its default task families; a SWE harness takes its sandboxes
    from `sandboxes` (the job's, opened before the first trajectory starts)."""
    if job.rollout.harness == "tir":
        return TIRHarness(TIRConfig(max_tool_calls=job.rollout.max_turns))
    if sandboxes is None:
        raise ValueError("a SWE harness needs the job's sandboxes (JobSandboxes)")
    return SWEHarness(
        SWEHarnessConfig(
            step_limit=job.rollout.max_turns, command_timeout_s=job.sandbox.command_timeout_s
        ),
        sandbox_factory=sandboxes.sandbox,
    )
