"""The teacher's top-k on slime: per response token, its k most likely ids and their
log-probs, carried from the generate hook to our loss.

slime's data path copies a fixed list of keys from samples to the loss (at the pinned
commit, tests/slime_cpu.py SLIME_COMMIT), and the per-token top-k is not among them. Our
hooks extend it in three places, each checked against slime's code when installed:

1. rollout process. `samples.to_samples` puts each sample's rows in
   `sample.train_metadata[TOPK_KEY]` (slime's field for "metadata used during training";
   its converter copies it into train data but never splits it by DP rank). The rollout
   log hook, which `RolloutManager.generate` calls on the step's flattened samples just
   before converting them, records them (`record_step`), and `RolloutManager.
   _split_train_data_by_dp` calls `tensorize_rollout_data_for_training(rollout_data)` once
   per DP rank with `rollout_data["partition"]`, the rank's indices into those samples: our
   wrapper of it adds the rank's rows under TOPK_IDS and TOPK_LOGPROBS. They travel with
   the rank's other data (one object per rank in Ray's store).
2. Megatron ranks (`--custom-megatron-init-path slime_ext.slime.tree.init`, or `init`): the training
   step's `get_batch` is wrapped to fetch our two keys with the others, and slime's
   train-side rollout log to skip them (it logs the mean of every key it does not know).
3. the loss (`slime_ext.slime.loss`) receives them whole per sample, [R, k] each, and cuts
   them to its context-parallel positions like the loss masks (`rows_for`).

Ids are global vocabulary ids, as the teacher service returns them; each tensor-parallel
rank gathers the ones its vocabulary shard holds (`slime_ext.vocab_parallel.gather_ids`).
Rows the loss never reads (positions inside a response that no span covers, placeholders)
hold FILLER: a uniform teacher over ids 0..k-1, finite whatever a loss computes from it.
Cost: k x 8 bytes per response token (int32 id, fp32 log-prob), k=32: 256 B.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slime_ext.slime.extend import before_rank_split, logged_without, require_source, wrap
from slime_ext.slime.settings import HookConfigError

TOPK_KEY = "opd_teacher_topk"
"""sample.train_metadata[TOPK_KEY]: {"ids": int32 [R, k], "logprobs": fp32 [R, k]}."""
TOPK_IDS = "opd_teacher_topk_ids"
TOPK_LOGPROBS = "opd_teacher_topk_logprobs"
"""The keys of a DP rank's rollout data and of the loss's batch: per sample [R, k]."""
BATCH_KEYS = (TOPK_IDS, TOPK_LOGPROBS)
TAG = "topk"
_TRAIN_STEP_KEY = "teacher_log_probs"
"""The training step fetches our keys when it fetches this one (slime's forward_step)."""


class TopKError(ValueError):
    """The top-k rows do not fit the samples they travel with (lengths, k, the step)."""


@dataclass(frozen=True)
class TopKRows:
    """One sample's top-k: ids int32 [R, k] (global vocabulary ids), logprobs fp32 [R, k]."""

    ids: Tensor
    logprobs: Tensor

    def as_metadata(self) -> dict[str, Tensor]:
        return {"ids": self.ids, "logprobs": self.logprobs}


def filler(rows: int, k: int) -> TopKRows:
    """Rows no loss reads: a uniform teacher over ids 0..k-1."""
    ids = torch.arange(k, dtype=torch.int32).expand(rows, k).contiguous()
    return TopKRows(ids, torch.full((rows, k), -math.log(k), dtype=torch.float32))


def rows_from_turn(
    ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]], k: int
) -> TopKRows:
    """A turn's top-k lists as tensors, each row exactly k wide."""
    if len(ids) != len(logprobs):
        raise TopKError(f"{len(ids)} rows of top-k ids and {len(logprobs)} of log-probs")
    if any(len(row) != k for row in ids) or any(len(row) != k for row in logprobs):
        raise TopKError(f"a top-k row is not {k} wide (teacher.top_k)")
    return TopKRows(
        torch.tensor(ids, dtype=torch.int32).reshape(len(ids), k),
        torch.tensor(logprobs, dtype=torch.float32).reshape(len(logprobs), k),
    )


def of_sample(sample: Any) -> TopKRows | None:
    meta = sample.train_metadata or {}
    if TOPK_KEY not in meta:
        return None
    return TopKRows(meta[TOPK_KEY]["ids"], meta[TOPK_KEY]["logprobs"])


# 1. the rollout process ------------------------------------------------------------------

_step_lock = threading.Lock()
_step_rows: list[TopKRows | None] | None = None


def record_step(samples: Sequence[Any]) -> None:
    """Called by the rollout log hook with the step's flattened samples (the list slime
    converts next): keeps their rows for the DP split, and installs the split's wrapper."""
    global _step_rows
    rows = [of_sample(s) for s in samples]
    with _step_lock:
        if not any(r is not None for r in rows):
            _step_rows = None
            return
        install_rollout_side()
        _step_rows = rows


def add_rank_rows(rollout_data: dict[str, Any]) -> None:
    """The DP rank's rows, by its partition, under BATCH_KEYS (a no-op for a step without
    top-k)."""
    with _step_lock:
        rows = _step_rows
    if rows is None or "partition" not in rollout_data:
        return
    ids, logprobs = [], []
    for position, index in enumerate(rollout_data["partition"]):
        index = int(index)
        if not 0 <= index < len(rows):
            raise TopKError(
                f"sample {index} of a step of {len(rows)}: the rollout log hook saw "
                "another list of samples than slime split (slime_ext.slime.topk)"
            )
        row = rows[index]
        if row is None:
            raise TopKError(f"sample {index} of the step carries no teacher top-k")
        length = int(rollout_data["response_lengths"][position])
        if row.ids.shape[0] != length:
            raise TopKError(
                f"sample {index}: {row.ids.shape[0]} top-k rows for a response of {length}"
            )
        ids.append(row.ids)
        logprobs.append(row.logprobs)
    rollout_data[TOPK_IDS] = ids
    rollout_data[TOPK_LOGPROBS] = logprobs


def install_rollout_side() -> None:
    """Wrap slime.ray.rollout's tensorize_rollout_data_for_training (once)."""
    before_rank_split(add_rank_rows, TAG, _drifted)


# 2. the Megatron ranks -------------------------------------------------------------------


def init(args: Any) -> None:
    """--custom-megatron-init-path: slime calls it on every Megatron rank after init."""
    del args
    install_train_side()


def install_train_side() -> None:
    """Wrap the training step's get_batch and the train-side rollout log (once)."""
    from slime.backends.megatron_utils import model
    from slime.observability import train_metric_utils

    require_source(
        model.train_one_step,
        ("get_batch(", f'"{_TRAIN_STEP_KEY}"'),
        "slime.backends.megatron_utils.model.train_one_step",
        _drifted,
    )
    wrap(model, "get_batch", _with_batch_keys, TAG, _drifted)
    wrap(train_metric_utils, "log_rollout_data", logged_without(BATCH_KEYS), TAG, _drifted)


def _with_batch_keys(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_batch(data_iterator: Any, keys: Sequence[str], *args: Any, **kwargs: Any) -> Any:
        if _TRAIN_STEP_KEY in keys:
            keys = [*keys, *(k for k in BATCH_KEYS if k not in keys)]
        return original(data_iterator, keys, *args, **kwargs)

    return get_batch


# 3. the loss -----------------------------------------------------------------------------


def rows_for(
    batch: dict[str, Any], response_index: Sequence[Sequence[int]], k: int, device: Any
) -> tuple[Tensor, Tensor]:
    """The micro-batch's rows at this rank's response positions (`response_index[i]` of
    sample i, as `cp.response_slices` gives them): ids [N, k] long, log-probs [N, k]."""
    ids, logprobs = batch.get(TOPK_IDS), batch.get(TOPK_LOGPROBS)
    if ids is None or logprobs is None:
        raise HookConfigError(
            "the batch has no teacher top-k: run slime with --custom-megatron-init-path "
            "slime_ext.slime.tree.init (`opd launch` passes it when the loss needs top-k) "
            "and teacher.top_k > 0"
        )
    picked_ids, picked_logprobs = [], []
    lengths = batch["response_lengths"]
    for i, (sample_ids, sample_logprobs, index) in enumerate(
        zip(ids, logprobs, response_index, strict=True)
    ):
        if sample_ids.shape != sample_logprobs.shape or sample_ids.dim() != 2:
            raise TopKError(f"sample {i}: top-k ids {tuple(sample_ids.shape)} and "
                            f"log-probs {tuple(sample_logprobs.shape)}")  # fmt: skip
        if sample_ids.shape[0] != int(lengths[i]) or sample_ids.shape[1] != k:
            raise TopKError(
                f"sample {i}: top-k rows {tuple(sample_ids.shape)} for a response of "
                f"{int(lengths[i])} tokens and teacher.top_k {k}"
            )
        where = torch.tensor(index, dtype=torch.long)
        picked_ids.append(sample_ids[where])
        picked_logprobs.append(sample_logprobs[where])
    return (
        torch.cat(picked_ids).to(device=device, dtype=torch.long),
        torch.cat(picked_logprobs).to(device=device, dtype=torch.float32),
    )


def _drifted(name: str, what: str) -> str:
    return (
        f"the teacher's top-k cannot reach the loss: {name} {what}; slime_ext.slime.topk "
        "extends slime's data path as it is at the commit tests/slime_cpu.py pins "
        "(SLIME_COMMIT); use that slime or opd_loss: sampled"
    )
