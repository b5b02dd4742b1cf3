"""The generate hook: one multi-turn trajectory per slime Sample, against slime's SGLang
router, with per-turn teacher scoring (OPSD: a hint, OPRD: reminders in the self-teacher's
contexts only); returned as per-turn Samples.

    --custom-generate-function-path slime_ext.slime.generate.generate

slime awaits `generate(args, sample, sampling_params, evaluation=...)` once per rollout
(slime/rollout/sglang_rollout.py, generate_and_rm). Sampling settings come from the job
config, which must agree with slime's (--rollout-temperature is checked); slime's
per-call `sampling_params` budget is the whole response's and is not used per turn.
"""

from __future__ import annotations

import asyncio
import functools
import os
from dataclasses import asdict, dataclass
from typing import Any

from rollout.chat import ChatRenderer
from rollout.hints import HintedTeacherContext
from rollout.policy import SGLangPolicy
from rollout.reminders import ReminderStats, ReminderTeacherContext
from rollout.runner import Runner
from rollout.trajectory import Task, Trajectory
from slime_ext.job.assembly import (
    TEACHER_RECIPES,
    harness_for,
    hinted_teacher_context,
    reminder_teacher_context,
    runner_config,
)
from slime_ext.job.config import JobConfig
from slime_ext.job.sandboxes import JobSandboxes, fleet_metrics, run_owner
from slime_ext.slime.samples import (
    FLEET_STATS_KEY,
    HINT_STATS_KEY,
    REMINDER_STATS_KEY,
    to_samples,
)
from slime_ext.slime.settings import HookConfigError, config_path, job_config, load_job
from slime_ext.turns import LossKind
from teacher_server.client import TeacherClient


@dataclass
class HookState:
    """What the hook builds once per process and event loop: clients and the runner."""

    job: JobConfig
    runner: Runner
    hints: HintedTeacherContext | None = None
    """OPSD: the self-teacher's hinted contexts (the student never sees the hint); its
    `stats` count the hints given, refused for leaking, missing and failed."""
    reminders: ReminderTeacherContext | None = None
    """OPRD: the self-teacher's reminded contexts (the student never sees a reminder)."""
    sandboxes: JobSandboxes | None = None
    """SWE: the job's sandboxes (on the sandbox-host nodes for a cluster job), opened by
    the first trajectory."""


async def generate(
    args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Any]:
    job = job_config(args)
    state = _state(
        config_path(args),
        f"http://{args.sglang_router_ip}:{args.sglang_router_port}",
        job.model.tokenizer or getattr(args, "hf_checkpoint", None),
        id(asyncio.get_running_loop()),
    )
    task = task_from_sample(sample, job.rollout.harness)
    if state.sandboxes is not None:
        await state.sandboxes.open()
    # slime's index is unique per rollout: it names the trajectory (and teacher session)
    if state.hints is not None:
        await state.hints.prepare([task])
    runner, reminder_stats = state.runner, None
    if state.reminders is not None:  # trajectories run concurrently: each counts its own
        reminder_stats = ReminderStats()
        runner = runner.with_teacher_context(state.reminders.counting(reminder_stats))
    trajectory = await runner.run_one(task, int(sample.index or 0))
    if state.hints is not None:  # the hook's counts so far travel to slime's rollout log
        trajectory.metadata[HINT_STATS_KEY] = state.hints.stats.metrics()
    if reminder_stats is not None:
        trajectory.metadata[REMINDER_STATS_KEY] = asdict(reminder_stats)
    if state.sandboxes is not None:  # the fleet's counters and load, for the rollout log
        trajectory.metadata[FLEET_STATS_KEY] = fleet_metrics(state.sandboxes.metrics())
    recipe = job.algorithm.recipe
    # packed only as the plan resolved it (`opd launch` writes packed or per_turn into
    # job.yaml and gives Megatron the tree attention); `auto` here means per turn
    packed = job.algorithm.sequence_layout == "packed" and not evaluation
    samples = to_samples(
        trajectory,
        sample,
        loss_kind=loss_kind(recipe, trajectory),
        train_kl_on_invalid=job.algorithm.train_on_invalid_turns,
        with_teacher=recipe in TEACHER_RECIPES and not evaluation,
        teacher_top_k=job.teacher.top_k if job.needs_teacher_topk else 0,
        layout="packed" if packed else "per_turn",
    )
    if evaluation:  # slime's eval reads one reward per sample; keep the whole trajectory's
        for s in samples:
            s.remove_sample = False
    return samples


def loss_kind(recipe: str, trajectory: Trajectory) -> LossKind:
    """Which loss mask a trajectory's samples carry: imitation (invalid turns masked) for
    SFT / SSD and for OPRD's successes (reward > 0, trained with NLL), KL otherwise. So an
    OPRD trajectory's per-rollout mask sum is its branch's token count, the denominator of
    its token mean in the local trainer too."""
    if recipe in ("ssd", "sft") or (recipe == "oprd" and (trajectory.reward or 0.0) > 0):
        return "imitation"
    return "kl"


def task_from_sample(sample: Any, harness: str) -> Task:
    """slime's data row -> our Task: `metadata["task"]` when the dataset stores one (our
    task files do), else the prompt, label and metadata slime read."""
    metadata = dict(sample.metadata or {})
    if isinstance(metadata.get("task"), dict):
        return Task.model_validate(metadata["task"])
    prompt = sample.prompt
    if isinstance(prompt, list):  # chat messages: the task is the last user turn
        users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
        if not users:
            raise HookConfigError("the sample's prompt messages hold no user message")
        prompt = users[-1]
    task_id = metadata.get("task_id") or metadata.get("instance_id") or f"sample-{sample.index}"
    return Task(
        task_id=str(task_id),
        kind=str(metadata.get("kind", "arithmetic" if harness == "tir" else "mini_swe")),
        prompt=str(prompt),
        answer=None if sample.label is None else str(sample.label),
        metadata=metadata,
    )


@functools.cache
def _state(path: str, router: str, checkpoint: str | None, loop_id: int) -> HookState:
    # slime loads hooks by path and gives them no place to keep clients: one set per
    # process and event loop (httpx clients belong to the loop that made them)
    del loop_id
    from transformers import AutoTokenizer

    job = load_job(path)
    if not checkpoint:
        raise HookConfigError("no tokenizer: set model.tokenizer or slime's --hf-checkpoint")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    sandboxes = None
    if job.rollout.harness == "swe":
        sandboxes = JobSandboxes.of_job(job, run_owner(job.logging.run_dir))
    harness = harness_for(job, sandboxes)
    renderer = ChatRenderer(
        tokenizer,
        harness.tools,
        think_policy=job.rollout.think_policy,
        tool_call_format=job.rollout.tool_call_format,
    )
    policy = SGLangPolicy(router, max_concurrency=max(job.rollout.concurrency, 1))
    teacher = None
    if job.algorithm.recipe in TEACHER_RECIPES:
        if not job.teacher.url:
            raise HookConfigError(
                f"recipe {job.algorithm.recipe!r} on slime needs teacher.url (the opd-teacher "
                "service on the teacher node)"
            )
        api_key = os.environ.get(job.teacher.api_key_env) if job.teacher.api_key_env else None
        teacher = TeacherClient(job.teacher.url, api_key, timeout_s=job.teacher.request_timeout_s)
    # OPSD: the hint goes into the self-teacher's contexts (hint student: slime's router
    # writes it, the same policy that sampled the trajectory)
    hints = hinted_teacher_context(job, renderer, harness.initial_messages, policy)
    reminders = reminder_teacher_context(job, renderer)  # OPRD
    runner = Runner(
        harness,
        policy,
        renderer,
        runner_config(job),
        teacher=teacher,
        teacher_context=hints if hints is not None else reminders,
    )
    return HookState(job, runner, hints, reminders, sandboxes)
