"""Task, Turn and Trajectory: what a rollout produces and training consumes.

Storage is linear in trajectory length (DESIGN.md invariant 8). The trajectory keeps its
trunk once: the token ids of the context as the latest turn sees it. Turn k keeps how
much of the trunk is its context (`context_len`), the ids it sampled (`span_ids`, think
then action), and its observation. A turn whose context the trunk cannot reproduce
(template drift, invariant 1) also keeps the part that differs, and says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from enum import Enum, IntEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class TrajectoryStatus(str, Enum):
    """How a trajectory ended (invariant 5: every trajectory ends with one, and a reason)."""

    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    SANDBOX_ERROR = "sandbox_error"
    TEACHER_ERROR = "teacher_error"


INFRASTRUCTURE_STATUSES = frozenset(
    {TrajectoryStatus.SANDBOX_ERROR, TrajectoryStatus.TEACHER_ERROR, TrajectoryStatus.ABORTED}
)
"""Statuses that say the infrastructure, not the policy, ended the trajectory. The
trajectory deadline is the exception: an aborted trajectory whose reason is the deadline
counts as a timeout (a failure of the policy), not as an abort."""
DEADLINE_REASON = "trajectory deadline"


def infrastructure_abort(status: TrajectoryStatus | str, reason: str) -> bool:
    """Whether a trajectory that ended so is an abort (`opd eval`'s and the agent
    metrics' sense: the infrastructure ended it, not the policy)."""
    status = TrajectoryStatus(status)
    deadline = status == TrajectoryStatus.ABORTED and reason == DEADLINE_REASON
    return status in INFRASTRUCTURE_STATUSES and not deadline


class MaskTier(IntEnum):
    """Why a turn's action was invalid (invariant 4); VALID for ordinary turns."""

    VALID = 0
    INVALID_ACTION = 1
    """Tier 1: no tool call, unknown tool, malformed arguments."""
    SHELL_ERROR = 2
    """Tier 2: shell syntax error or command not found."""


class TrajectoryFormatError(ValueError):
    """A JSONL file that does not hold valid trajectories; names the file and line."""


class Task(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: str = Field(min_length=1)
    """Stable identifier, unique within a dataset."""
    kind: str = Field(min_length=1)
    """Task family: 'tir', 'swe', 'mini_swe', ..."""
    prompt: str
    """The problem statement the agent sees."""
    answer: str | None = None
    """Reference answer (TIR) or None where grading runs tests (SWE)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Family-specific fields (repo, base commit, tests, hint, ...)."""


class TurnTimings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_s: float = Field(default=0.0, ge=0.0)
    """Time generating this turn's span."""
    sandbox_s: float = Field(default=0.0, ge=0.0)
    """Time executing its action."""
    teacher_s: float = Field(default=0.0, ge=0.0)
    """Time the teacher spent scoring its span."""


class Turn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    context_len: int = Field(ge=0)
    """Length of the trunk prefix that is this turn's context."""
    context_suffix_ids: list[int] = Field(default_factory=list)
    """Drifted turns only: the ids of this turn's context after the shared trunk prefix."""
    span_ids: list[int] = Field(min_length=1)
    """The ids the student sampled: think then action. Never re-tokenized."""
    think_len: int = Field(ge=0)
    """span_ids[:think_len] is the think, span_ids[think_len:] the action."""
    logprobs: list[float] | None = None
    """The sampler's log-prob of each span id."""
    teacher_logprobs: list[float] | None = None
    """The teacher's log-prob of each span id, given the teacher's context."""
    teacher_topk_ids: list[list[int]] | None = None
    """The teacher's k most likely ids at each span position (when scored with top_k)."""
    teacher_topk_logprobs: list[list[float]] | None = None
    """Their log-probs (same temperature as the rollout)."""
    observation_ids: list[int] = Field(default_factory=list)
    """The tool's output tokenized on its own, for token accounting (the trunk holds it as
    the template renders it); empty when the turn got no observation."""
    mask_tier: MaskTier = MaskTier.VALID
    """Invalid-action tier; imitation losses give tiers 1 and 2 loss mask 0."""
    drift: bool = False
    """True when the next context did not extend this one token for token, or did not
    contain the sampled action ids (invariant 1)."""
    drift_reason: str | None = None
    finish_reason: str | None = None
    """Why generation stopped: 'stop' or 'length' (an engine abort ends the trajectory and
    is never recorded as a turn)."""
    timings: TurnTimings = Field(default_factory=TurnTimings)

    @property
    def context_total_len(self) -> int:
        return self.context_len + len(self.context_suffix_ids)

    @property
    def think_ids(self) -> list[int]:
        return self.span_ids[: self.think_len]

    @property
    def action_ids(self) -> list[int]:
        return self.span_ids[self.think_len :]

    @model_validator(mode="after")
    def _lengths_agree(self) -> Turn:
        span_len = len(self.span_ids)
        if self.think_len > span_len:
            raise ValueError(f"think_len ({self.think_len}) exceeds len(span_ids) ({span_len})")
        for name in ("logprobs", "teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs"):
            values = getattr(self, name)
            if values is not None and len(values) != span_len:
                raise ValueError(
                    f"{name} has {len(values)} entries but span_ids has {span_len}: "
                    "one log-prob per span id"
                )
        for name in ("span_ids", "observation_ids", "context_suffix_ids"):
            if any(token < 0 for token in getattr(self, name)):
                raise ValueError(f"{name} holds a negative token id")
        if self.context_suffix_ids and not self.drift:
            raise ValueError(
                "context_suffix_ids is set but drift is False: only a drifted turn's "
                "context differs from the trunk"
            )
        if self.drift and not self.drift_reason:
            raise ValueError("drift is True but drift_reason is empty: say what drifted")
        return self


class Trajectory(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trajectory_id: str = Field(min_length=1)
    task: Task
    sample_index: int = Field(default=0, ge=0)
    """Index within the task's group of samples."""
    think_policy: Literal["drop", "keep"] = "drop"
    """'drop' or 'keep': whether earlier think appears in later contexts."""
    trunk_ids: list[int] = Field(min_length=1)
    """The context as the latest turn sees it (system, task, actions, observations)."""
    turns: list[Turn] = Field(default_factory=list)
    status: TrajectoryStatus
    status_reason: str = Field(min_length=1)
    """Why it ended: 'boxed answer', 'submitted', 'max turns', 'sandbox died: ...'."""
    reward: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    wall_s: float = Field(default=0.0, ge=0.0)

    @model_validator(mode="after")
    def _turns_fit_trunk(self) -> Trajectory:
        if any(token < 0 for token in self.trunk_ids):
            raise ValueError("trunk_ids holds a negative token id")
        trunk_len = len(self.trunk_ids)
        previous_total = -1
        for k, turn in enumerate(self.turns):
            if turn.context_len > trunk_len:
                raise ValueError(
                    f"turns[{k}].context_len ({turn.context_len}) exceeds len(trunk_ids) "
                    f"({trunk_len})"
                )
            if turn.context_total_len == 0:
                raise ValueError(f"turns[{k}] has an empty context")
            if turn.context_total_len <= previous_total:
                raise ValueError(
                    f"turns[{k}] context ({turn.context_total_len} ids) is not longer than "
                    f"turns[{k - 1}] context ({previous_total} ids): contexts must grow"
                )
            previous_total = turn.context_total_len
        return self

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def ended_normally(self) -> bool:
        """Completed or truncated: the statuses whose turns are trained on, by the local
        trainer and on slime alike. An aborted, sandbox_error or teacher_error trajectory
        ended on something other than the policy (a deadline, the infrastructure): its
        turns are counted in the rollout metrics, not trained on, and kept out of RL's
        group statistics (on slime it becomes a removed placeholder)."""
        return self.status in (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED)

    def context_ids(self, k: int) -> list[int]:
        """The ids turn k's span was sampled after."""
        turn = self.turns[k]
        return self.trunk_ids[: turn.context_len] + turn.context_suffix_ids

    def span_ids(self, k: int) -> list[int]:
        return list(self.turns[k].span_ids)

    def span_token_count(self) -> int:
        return sum(len(turn.span_ids) for turn in self.turns)

    def to_json_line(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json_line(cls, line: str) -> Trajectory:
        return cls.model_validate_json(line)


def token_accounting(trajectory: Trajectory) -> dict[str, float]:
    """Per-turn token counts of one trajectory, and what training on it would process:
    one sequence per turn (context + span each) or one tree-packed sequence (trunk once,
    every span once, drifted turns' own context parts once)."""
    turns = trajectory.turns
    count = max(len(turns), 1)
    span_tokens = trajectory.span_token_count()
    return {
        "num_turns": float(len(turns)),
        "tokens_per_turn": span_tokens / count,
        "think_tokens_per_turn": sum(turn.think_len for turn in turns) / count,
        "action_tokens_per_turn": sum(len(turn.action_ids) for turn in turns) / count,
        "observation_tokens_per_turn": sum(len(turn.observation_ids) for turn in turns) / count,
        "trunk_tokens": float(len(trajectory.trunk_ids)),
        "span_tokens": float(span_tokens),
        "per_turn_processed_tokens": float(
            sum(turn.context_total_len + len(turn.span_ids) for turn in turns)
        ),
        "tree_packed_processed_tokens": float(
            len(trajectory.trunk_ids)
            + span_tokens
            + sum(len(turn.context_suffix_ids) for turn in turns)
        ),
    }


def repair_torn_tail(path: Path, parse: Callable[[bytes], object]) -> None:
    """Make an appended JSONL file whole after a crash: a last line without its newline is
    kept (newline added) when `parse` accepts it, cut off when it raises ValueError (a
    pydantic ValidationError included), so its record is written again."""
    if not path.is_file():
        return
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1
    if complete == len(data):
        return
    try:
        parse(data[complete:])
    except ValueError:
        with path.open("r+b") as handle:
            handle.truncate(complete)
    else:
        with path.open("ab") as handle:
            handle.write(b"\n")


def write_jsonl(path: str | Path, trajectories: Iterable[Trajectory]) -> int:
    """Append trajectories to a JSONL file; returns how many were written."""
    count = 0
    with Path(path).open("a", encoding="utf-8") as handle:
        for trajectory in trajectories:
            handle.write(trajectory.to_json_line() + "\n")
            count += 1
    return count


def read_jsonl(path: str | Path) -> Iterator[Trajectory]:
    """Yield the trajectories of a JSONL file; a bad line raises naming its number."""
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield Trajectory.from_json_line(line)
            except (ValidationError, json.JSONDecodeError) as err:
                raise TrajectoryFormatError(
                    f"{path}:{number}: not a valid trajectory: {err}"
                ) from err
