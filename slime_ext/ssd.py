"""Simple self-distillation (SSD): sample the student's own trajectories at a truncated
temperature, keep every one of them (positive and negative: no rejection sampling), and
export them as pre-tokenized per-turn SFT records whose loss covers only the sampled
spans (think + tool call), invalid turns (tiers 1 and 2) masked.

Sampling appends each trajectory to a JSONL file as it ends, so an interrupted run
resumes: (task, sample index) pairs already in the file are not sampled again. Export
reads one or more such files and writes `slime_ext.sft_data` records (parquet or JSONL),
which slime's SFT rollout function and `read_records` load unchanged.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from rollout.masking import MaskStats
from rollout.runner import Runner
from rollout.tasks import mini_swe
from rollout.tasks.arithmetic import make_tasks
from rollout.trajectory import (
    MaskTier,
    Task,
    Trajectory,
    TrajectoryStatus,
    read_jsonl,
    repair_torn_tail,
    write_jsonl,
)
from slime_ext.sft_data import TurnRecord, turn_records, write_records

ARITHMETIC_PREFIX = "arithmetic:"
MINI_SWE_PREFIX = "mini_swe:"
EXPORTED_STATUSES = (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED)
"""Trajectories that ended normally; the others are counted and left out of the export."""
RECORD_SUFFIXES = (".parquet", ".jsonl")
TIER_NAMES = {
    MaskTier.VALID: "valid",
    MaskTier.INVALID_ACTION: "tier1",
    MaskTier.SHELL_ERROR: "tier2",
}


class SSDInputError(ValueError):
    """A task spec, task file or output path that SSD cannot use (says what is expected)."""


def load_tasks(spec: str, seed: int = 0) -> list[Task]:
    """`arithmetic:N` (N synthetic TIR training problems), `mini_swe:N` (N mini-SWE
    repositories, for the swe harness) or a JSONL file of Task rows."""
    for prefix in (ARITHMETIC_PREFIX, MINI_SWE_PREFIX):
        if spec.startswith(prefix):
            count = spec.removeprefix(prefix)
            if not count.isdigit() or int(count) < 1:
                raise SSDInputError(f"{spec!r}: write {prefix}N with N a positive integer")
            if prefix == MINI_SWE_PREFIX:
                return mini_swe.generate_tasks(int(count), seed=seed)
            return make_tasks(int(count), "train", seed=seed)
    path = Path(spec)
    if not path.is_file():
        raise SSDInputError(f"{spec!r} is neither arithmetic:N nor a JSONL file of tasks")
    tasks: list[Task] = []
    seen: set[str] = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            task = Task.model_validate_json(line)
        except ValidationError as err:
            raise SSDInputError(f"{path}:{number}: not a valid task: {err}") from err
        if task.task_id in seen:  # resuming keys samples by task_id
            raise SSDInputError(f"{path}:{number}: task_id {task.task_id!r} appears twice")
        seen.add(task.task_id)
        tasks.append(task)
    if not tasks:
        raise SSDInputError(f"{path} holds no tasks")
    return tasks


def done_samples(path: Path) -> set[tuple[str, int]]:
    """(task_id, sample_index) of every trajectory already in `path`.

    A last line cut short by a crash is removed (its trajectory is sampled again); a bad
    line elsewhere raises TrajectoryFormatError naming it.
    """
    if not path.is_file():
        return set()
    repair_torn_tail(path, lambda line: Trajectory.from_json_line(line.decode(errors="replace")))
    return {(t.task.task_id, t.sample_index) for t in read_jsonl(path)}


def pending_samples(
    tasks: Sequence[Task], samples_per_task: int, done: set[tuple[str, int]]
) -> list[tuple[Task, int]]:
    """The (task, sample index) pairs still to sample, in task order."""
    return [
        (task, index)
        for task in tasks
        for index in range(samples_per_task)
        if (task.task_id, index) not in done
    ]


def resume_seed(seed: int, done: int) -> int:
    """The sampler seed of a run that finds `done` trajectories: a fresh stream, so a
    resumed run does not replay the first run's draws on the same contexts."""
    if done == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}-{done}".encode()).digest()[:8], "big")


async def sample_trajectories(
    runner: Runner,
    jobs: Sequence[tuple[Task, int]],
    out: Path,
    console: Console | None = None,
    show_progress: bool = True,
) -> int:
    """Run every (task, sample index) pair and append each trajectory to `out` as it ends,
    whatever its reward; returns how many were written. (Runner.run takes whole tasks x
    samples; a resumed run needs single pairs, so this drives Runner.run_one itself.)"""
    gate = asyncio.Semaphore(runner.config.concurrency)
    positives = 0
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not show_progress,
        transient=True,
    ) as progress:
        bar = progress.add_task("ssd sample", total=len(jobs))

        async def one(task: Task, index: int) -> None:
            nonlocal positives
            async with gate:
                trajectory = await runner.run_one(task, index)
            write_jsonl(out, [trajectory])
            positives += (trajectory.reward or 0.0) > 0
            progress.update(bar, advance=1, description=f"ssd sample ({positives} positive)")

        await asyncio.gather(*(one(task, index) for task, index in jobs))
    return len(jobs)


class TokenCounts(BaseModel):
    span: int = 0
    """Sampled tokens (think + action) of every turn."""
    think: int = 0
    action: int = 0
    observation: int = 0
    """Tool outputs, tokenized on their own."""
    trunk: int = 0
    """Each trajectory's context ids once (system, task, actions, observations)."""


class SampleSummary(BaseModel):
    """What a trajectories file holds: outcomes, masking and tokens."""

    model_config = ConfigDict(extra="forbid")

    trajectories: int = 0
    tasks: int = 0
    statuses: dict[str, int] = Field(default_factory=dict)
    not_completed_reasons: dict[str, int] = Field(default_factory=dict)
    """'status: reason' of every trajectory that did not complete."""
    positives: int = 0
    """reward > 0."""
    negatives: int = 0
    """reward <= 0 (kept: SSD trains on both)."""
    unrewarded: int = 0
    """No reward (aborted, sandbox or teacher error)."""
    positive_share: float = 0.0
    """positives / trajectories."""
    turns: int = 0
    turns_per_tier: dict[str, int] = Field(default_factory=dict)
    masked_share: float = 0.0
    """Tier-1 and tier-2 turns over all turns (imitation gives them loss mask 0)."""
    tokens: TokenCounts = Field(default_factory=TokenCounts)
    drifted_turns: int = 0
    sampled_this_run: int = 0
    skipped_done: int = 0
    """(task, sample) pairs found in the file and not sampled again."""
    sampling: dict[str, float | int | str] = Field(default_factory=dict)
    """The sampler and the run's settings (this run's; earlier runs may have differed)."""


def summarize_trajectories(trajectories: Iterable[Trajectory]) -> SampleSummary:
    summary = SampleSummary()
    statuses: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    tasks: set[str] = set()
    masks = MaskStats()
    tokens = summary.tokens
    for trajectory in trajectories:
        summary.trajectories += 1
        tasks.add(trajectory.task.task_id)
        statuses[trajectory.status.value] += 1
        if trajectory.status is not TrajectoryStatus.COMPLETED:
            reasons[f"{trajectory.status.value}: {trajectory.status_reason}"] += 1
        if trajectory.reward is None:
            summary.unrewarded += 1
        elif trajectory.reward > 0:
            summary.positives += 1
        else:
            summary.negatives += 1
        masks.add(trajectory)
        tokens.trunk += len(trajectory.trunk_ids)
        for turn in trajectory.turns:
            tokens.span += len(turn.span_ids)
            tokens.think += turn.think_len
            tokens.action += len(turn.action_ids)
            tokens.observation += len(turn.observation_ids)
            summary.drifted_turns += turn.drift
    summary.tasks = len(tasks)
    summary.statuses = dict(statuses)
    summary.not_completed_reasons = dict(reasons)
    summary.positive_share = summary.positives / max(summary.trajectories, 1)
    summary.turns = masks.total
    summary.turns_per_tier = {TIER_NAMES[tier]: count for tier, count in masks.turns.items()}
    summary.masked_share = masks.metrics()["masked_turn_frac"]
    return summary


class ExportSummary(BaseModel):
    """What an export wrote and what it left out."""

    model_config = ConfigDict(extra="forbid")

    inputs: list[str] = Field(default_factory=list)
    output: str = ""
    records: int = 0
    """Per-turn records written (after dedup)."""
    trajectories: int = 0
    """Trajectories with at least one record written."""
    positive_trajectories: int = 0
    skipped: dict[str, int] = Field(default_factory=dict)
    """Trajectories left out, by status (aborted, sandbox_error, teacher_error)."""
    empty_trajectories: int = 0
    """Completed or truncated with no turn: nothing to export."""
    duplicates_dropped: int = 0
    """Records whose (tokens, loss_mask) an earlier record already had."""
    renamed_trajectory_ids: int = 0
    """A trajectory_id seen in an earlier input got a suffix (records group by it)."""
    turns_per_tier: dict[str, int] = Field(default_factory=dict)
    """Of the records written."""
    masked_turns: int = 0
    """Tier-1/2 records (their loss mask is 0 unless the export kept them)."""
    masked_share: float = 0.0
    mask_invalid: bool = True
    """Whether tier-1/2 turns were masked (off: the masking ablation)."""
    loss_tokens: int = 0
    """Span tokens with loss mask 1."""
    response_tokens: int = 0
    """Span tokens of every record written."""
    tokens_total: int = 0
    """Context + span tokens of every record (what per-turn training processes)."""


def export_records(paths: Sequence[Path], out: Path, mask_invalid: bool = True) -> ExportSummary:
    """Per-turn imitation records of the completed and truncated trajectories in `paths`,
    identical (tokens, loss_mask) records once, written to `out` (.parquet or .jsonl);
    tier-1/2 turns carry no loss unless `mask_invalid` is off (the masking ablation)."""
    if out.suffix not in RECORD_SUFFIXES:
        raise SSDInputError(f"{out}: the export is written as .parquet or .jsonl")
    summary = ExportSummary(
        inputs=[str(p) for p in paths], output=str(out), mask_invalid=mask_invalid
    )
    records: list[TurnRecord] = []
    seen_records: set[bytes] = set()
    seen_ids: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    tiers: Counter[MaskTier] = Counter()
    for path in paths:
        for trajectory in read_jsonl(path):
            if trajectory.status not in EXPORTED_STATUSES:
                skipped[trajectory.status.value] += 1
                continue
            if not trajectory.turns:
                summary.empty_trajectories += 1
                continue
            repeat = seen_ids[trajectory.trajectory_id]
            seen_ids[trajectory.trajectory_id] += 1
            if repeat:  # another run's trajectory with the same id: keep the groups apart
                trajectory = trajectory.model_copy(
                    update={"trajectory_id": f"{trajectory.trajectory_id}~{repeat}"}
                )
            kept = 0
            records_of = turn_records(trajectory, mask_invalid)
            for record, turn in zip(records_of, trajectory.turns, strict=True):
                key = _record_key(record)
                if key in seen_records:
                    summary.duplicates_dropped += 1
                    continue
                seen_records.add(key)
                records.append(record)
                tiers[turn.mask_tier] += 1
                kept += 1
            if kept:
                summary.trajectories += 1
                summary.renamed_trajectory_ids += bool(repeat)
                summary.positive_trajectories += (trajectory.reward or 0.0) > 0
    out.parent.mkdir(parents=True, exist_ok=True)
    summary.records = write_records(out, records)
    summary.skipped = dict(skipped)
    summary.turns_per_tier = {name: tiers[tier] for tier, name in TIER_NAMES.items()}
    summary.masked_turns = tiers[MaskTier.INVALID_ACTION] + tiers[MaskTier.SHELL_ERROR]
    summary.masked_share = summary.masked_turns / max(summary.records, 1)
    summary.loss_tokens = sum(sum(r.loss_mask) for r in records)
    summary.response_tokens = sum(r.response_length for r in records)
    summary.tokens_total = sum(len(r.tokens) for r in records)
    return summary


def _record_key(record: TurnRecord) -> bytes:
    payload = json.dumps([record.tokens, record.loss_mask], separators=(",", ":"))
    return hashlib.blake2b(payload.encode(), digest_size=16).digest()


def summary_path(out: Path) -> Path:
    """Where the summary of `out` goes: next to it, `<name>.summary.json`."""
    return out.with_name(out.name + ".summary.json")


def write_summary(out: Path, summary: BaseModel) -> Path:
    path = summary_path(out)
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(summary.model_dump_json(indent=2) + "\n")
    os.replace(staging, path)
    return path
