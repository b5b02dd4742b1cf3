"""A rollout function that feeds pre-tokenized per-turn samples (SFT, SSD) to slime.

    --rollout-function-path slime_ext.slime.sft_rollout.generate_rollout
    (custom config key opd_sft_data: a .jsonl or .parquet of slime_ext.sft_data records)

slime's own SFT rollout re-renders chat messages through its loss-mask generator
(re-tokenizing, and under Qwen3 templates dropping earlier think); this one hands slime the
ids as they were sampled. slime calls `generate_rollout(args, rollout_id, data_source,
evaluation=False)` (slime/rollout/base_types.py, call_rollout_fn) and accepts nested
lists of Samples; the samples of one trajectory share a rollout_id. Batch `rollout_id`
is a fixed function of the step, so a resumed job continues with the next batch.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

from slime_ext.sft_data import TurnRecord, by_trajectory, read_records
from slime_ext.slime.samples import METADATA_KEY

DATA_KEY = "opd_sft_data"


class SFTDataError(ValueError):
    """The pre-tokenized data cannot be served (missing, empty, evaluation asked)."""


def generate_rollout(
    args: Any,
    rollout_id: int,
    data_source: Any,
    evaluation: bool = False,
    sample_class: Any = None,
) -> list[list[list[Any]]]:
    if evaluation:
        raise SFTDataError(
            "pre-tokenized SFT data has no evaluation rollouts: set --eval-function-path "
            "to slime's default rollout with our generate hook"
        )
    path = getattr(args, DATA_KEY, None)
    if not path:
        raise SFTDataError(f"set {DATA_KEY} (through --custom-config-path) to the records file")
    trajectories = _trajectories(str(Path(path).resolve()))
    batch_size = int(args.rollout_batch_size)
    Sample = sample_class or _slime_sample()
    groups = []
    for slot in range(batch_size):
        position = rollout_id * batch_size + slot
        records = trajectories[_order(len(trajectories), position, int(getattr(args, "seed", 0)))]
        groups.append([[_sample(Sample, record, position) for record in records]])
    return groups


def _order(count: int, position: int, seed: int) -> int:
    """Epochs walk seeded permutations of the trajectories."""
    epoch, offset = divmod(position, count)
    order = list(range(count))
    random.Random(f"{seed}-{epoch}").shuffle(order)
    return order[offset]


def _sample(Sample: Any, record: TurnRecord, position: int) -> Any:
    return Sample(
        index=position,
        group_index=position,
        rollout_id=position,
        tokens=list(record.tokens),
        response_length=record.response_length,
        loss_mask=list(record.loss_mask),
        reward=float(record.reward or 0.0),
        status=Sample.Status.COMPLETED,
        metadata={METADATA_KEY: {"trajectory_id": record.trajectory_id, "turn": record.turn}},
    )


@functools.cache
def _trajectories(path: str) -> list[list[TurnRecord]]:
    if not Path(path).is_file():
        raise SFTDataError(f"{DATA_KEY} {path} does not exist")
    grouped = by_trajectory(read_records(path))
    if not grouped:
        raise SFTDataError(f"{path} holds no records")
    return grouped


def _slime_sample() -> Any:
    from slime.utils.types import Sample

    return Sample
