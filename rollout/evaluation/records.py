"""One evaluation run's results on disk: what was asked (`run.json`) and one graded record
per (benchmark, instance, sample) in `results.jsonl`, appended as each one is graded.

Resuming: a run directory remembers its settings; reopening it with the same settings
skips every record already there (a last line torn by a crash is dropped and redone), with
different settings it is refused, so two configurations never mix in one table.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout.trajectory import (
    DEADLINE_REASON,
    Trajectory,
    TrajectoryStatus,
    infrastructure_abort,
    repair_torn_tail,
)

RESULTS_FILE = "results.jsonl"
RUN_FILE = "run.json"


class EvalResultsError(ValueError):
    """A run directory that cannot be resumed (other settings, a corrupt line)."""


class EvalRecord(BaseModel):
    """One graded trajectory."""

    model_config = ConfigDict(extra="forbid")

    benchmark: str = Field(min_length=1)
    instance_id: str = Field(min_length=1)
    sample: int = Field(default=0, ge=0)
    solved: bool
    """Resolved (SWE) or a correct final answer (math)."""
    status: TrajectoryStatus
    status_reason: str
    outcome: Literal["graded", "aborted", "timeout"]
    """graded: the trajectory ended on the policy's terms (answer, submit, a step or turn
    limit) and was graded; aborted: the infrastructure ended it (sandbox, server, grading
    sandbox): excluded from the net pass rate; timeout: the trajectory deadline."""
    num_turns: int = Field(ge=0)
    tool_calls: int = Field(default=0, ge=0)
    """Actions that ran a tool (bash or python)."""
    reason: str = ""
    """Why it was (not) solved: the grader's reason, or the status reason."""
    answer: str | None = None
    """The final answer (math) or the submitted patch (SWE)."""
    temperature: float | None = None
    wall_s: float = Field(default=0.0, ge=0.0)
    details: dict[str, Any] = Field(default_factory=dict)
    """What the harness's episode reported (grade details, tests)."""

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.benchmark, self.instance_id, self.sample)


def record_of(benchmark: str, trajectory: Trajectory, temperature: float | None) -> EvalRecord:
    """The record of a finished trajectory (`trajectory.metadata["episode"]` holds what the
    harness's episode reported: answer, patch, grade)."""
    episode: dict[str, Any] = dict(trajectory.metadata.get("episode") or {})
    status = trajectory.status
    outcome: Literal["graded", "aborted", "timeout"] = "graded"
    if status == TrajectoryStatus.ABORTED and trajectory.status_reason == DEADLINE_REASON:
        outcome = "timeout"
    elif infrastructure_abort(status, trajectory.status_reason):
        outcome = "aborted"
    solved = outcome == "graded" and (trajectory.reward or 0.0) > 0
    reason = str(episode.pop("reason", "")) if outcome == "graded" else trajectory.status_reason
    return EvalRecord(
        benchmark=benchmark,
        instance_id=trajectory.task.task_id,
        sample=trajectory.sample_index,
        solved=solved,
        status=status,
        status_reason=trajectory.status_reason,
        outcome=outcome,
        num_turns=len(trajectory.turns),
        tool_calls=int(episode.pop("tool_calls", 0)),
        reason=reason or trajectory.status_reason,
        answer=episode.pop("answer", None),
        temperature=temperature,
        wall_s=trajectory.wall_s,
        details=episode,
    )


class ResultStore:
    """`results.jsonl` and `run.json` of one run directory; see the module docstring."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.results_path = run_dir / RESULTS_FILE
        self.run_path = run_dir / RUN_FILE

    def open(self, settings: Mapping[str, Any]) -> list[EvalRecord]:
        """Start or resume the run with `settings` (JSON); returns the records already
        graded. Raises EvalResultsError if the directory holds a run with other settings."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        wanted = json.loads(json.dumps(dict(settings), sort_keys=True, default=str))
        if self.run_path.is_file():
            previous = json.loads(self.run_path.read_text(encoding="utf-8"))
            if previous.get("settings") != wanted:
                raise EvalResultsError(
                    f"{self.run_dir} holds a run with other settings ("
                    + _differences(previous.get("settings") or {}, wanted)
                    + "): pass another output directory, or delete this one to start over"
                )
        else:
            self.run_path.write_text(
                json.dumps({"settings": wanted}, indent=2, sort_keys=True) + "\n", encoding="utf-8"
            )
        return self.read()

    def settings(self) -> dict[str, Any]:
        if not self.run_path.is_file():
            raise EvalResultsError(f"{self.run_dir} is not an evaluation run (no {RUN_FILE})")
        settings: dict[str, Any] = json.loads(self.run_path.read_text(encoding="utf-8"))["settings"]
        return settings

    def read(self) -> list[EvalRecord]:
        """Every record; a torn last line (a crash mid-write) is cut off the file."""
        if not self.results_path.is_file():
            return []
        repair_torn_tail(self.results_path, EvalRecord.model_validate_json)
        text = self.results_path.read_text(encoding="utf-8")
        records: list[EvalRecord] = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(EvalRecord.model_validate_json(line))
            except ValidationError as err:
                raise EvalResultsError(
                    f"{self.results_path}:{number}: not an evaluation record: {err}"
                ) from err
        return records

    def append(self, records: Iterable[EvalRecord]) -> None:
        """Append and flush to disk: a kill after this keeps them."""
        with self.results_path.open("a", encoding="utf-8") as handle:
            for record in records:
                handle.write(record.model_dump_json() + "\n")
            handle.flush()
            os.fsync(handle.fileno())


def latest_records(records: Iterable[EvalRecord]) -> list[EvalRecord]:
    """One record per key (the last written wins), in first-seen order."""
    by_key: dict[tuple[str, str, int], EvalRecord] = {}
    for record in records:
        by_key[record.key] = record
    return list(by_key.values())


def _differences(before: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    keys = sorted(set(before) | set(now))
    changed = [
        f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in keys if before.get(k) != now.get(k)
    ]
    shown = "; ".join(changed[:4])
    return shown + (f"; and {len(changed) - 4} more" if len(changed) > 4 else "")
