"""Pre-tokenized per-turn training samples on disk (SFT, SSD): JSONL or parquet.

One record per turn: the ids as the student saw and sampled them (context + span, never
re-rendered, invariant 1), the response length (the span) and its loss mask (invariant 4:
imitation drops tier-1/2 turns). Records of one trajectory share its trajectory_id.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout.masking import loss_mask_for
from rollout.trajectory import Trajectory


class TurnRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trajectory_id: str = Field(min_length=1)
    turn: int = Field(ge=0)
    tokens: list[int] = Field(min_length=2)
    """Context then span."""
    response_length: int = Field(ge=1)
    loss_mask: list[int]
    """One 0/1 per span token."""
    reward: float | None = None

    @model_validator(mode="after")
    def _lengths_agree(self) -> TurnRecord:
        if self.response_length >= len(self.tokens):
            raise ValueError(
                f"response_length {self.response_length} leaves no context in "
                f"{len(self.tokens)} tokens"
            )
        if len(self.loss_mask) != self.response_length:
            raise ValueError(
                f"loss_mask has {len(self.loss_mask)} entries for a "
                f"{self.response_length}-token span"
            )
        return self


def turn_records(trajectory: Trajectory, mask_invalid: bool = True) -> list[TurnRecord]:
    """The imitation samples of a trajectory: every turn, invalid ones (tiers 1 and 2)
    masked unless `mask_invalid` is off (the masking ablation)."""
    records = []
    for k, turn in enumerate(trajectory.turns):
        carries = loss_mask_for(turn.mask_tier, "imitation", imitate_invalid=not mask_invalid)
        records.append(
            TurnRecord(
                trajectory_id=trajectory.trajectory_id,
                turn=k,
                tokens=trajectory.context_ids(k) + list(turn.span_ids),
                response_length=len(turn.span_ids),
                loss_mask=[int(carries)] * len(turn.span_ids),
                reward=trajectory.reward,
            )
        )
    return records


def write_records(path: str | Path, records: Iterable[TurnRecord]) -> int:
    """Write records as JSONL, or parquet when the name ends in .parquet."""
    path = Path(path)
    rows = [record.model_dump() for record in records]
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with path.open("w") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
    return len(rows)


def read_records(path: str | Path) -> list[TurnRecord]:
    path = Path(path)
    rows: Sequence[dict[str, Any]]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [TurnRecord.model_validate(row) for row in rows]


def by_trajectory(records: Sequence[TurnRecord]) -> list[list[TurnRecord]]:
    """Records grouped per trajectory in first-seen order, turns in order."""
    groups: dict[str, list[TurnRecord]] = {}
    for record in records:
        groups.setdefault(record.trajectory_id, []).append(record)
    return [sorted(group, key=lambda r: r.turn) for group in groups.values()]
