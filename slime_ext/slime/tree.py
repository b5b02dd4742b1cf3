"""The trees of tree-packed samples (`samples.packed_sample`), carried from the generate
hook to the tree attention (`tree_attention.TreeCoreAttention`) through slime's data path,
the way `topk` carries the teacher's top-k:

1. rollout process: the rollout log hook records the step's trees (`record_step`); the
   wrapper of slime's tensorize_rollout_data_for_training adds each DP rank's trees, by
   its partition, under TREE_ROWS.
2. Megatron ranks (`init`, slime's --custom-megatron-init-path): get_batch fetches
   TREE_ROWS with the tokens (for the log-prob forward and the training step alike) and
   hangs the micro-batch's trees on its packed_seq_params (TREE_ATTRIBUTE), which Megatron
   hands every layer's core attention, activation recomputation included; the train-side
   rollout log skips them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from slime_ext.slime import topk
from slime_ext.slime.extend import before_rank_split, logged_without, require_source, wrap
from slime_ext.slime.samples import TREE_KEY
from slime_ext.slime.settings import HookConfigError
from slime_ext.slime.tree_attention import TREE_ATTRIBUTE

TAG = "tree"
TREE_ROWS = "opd_tree_rows"
"""The key of a DP rank's rollout data and of get_batch's micro-batch: per sample [3, L]."""


class TreeError(ValueError):
    """Trees that do not fit the samples they travel with."""


def of_sample(sample: Any) -> Tensor | None:
    return (sample.train_metadata or {}).get(TREE_KEY)


# 1. the rollout process ------------------------------------------------------------------

_step_lock = threading.Lock()
_step_trees: list[Tensor] | None = None


def record_step(samples: Sequence[Any]) -> None:
    """The step's flattened samples (the list slime converts and splits next): keep their
    trees for the DP split, and install the split's wrapper. All or none carry one."""
    global _step_trees
    trees = [of_sample(s) for s in samples]
    carried = sum(t is not None for t in trees)
    if carried and carried != len(trees):
        raise TreeError(
            f"{carried} of the step's {len(trees)} samples are tree-packed: a step is packed "
            "throughout or not at all (algorithm.sequence_layout)"
        )
    with _step_lock:
        if not carried:
            _step_trees = None
            return
        install_rollout_side()
        _step_trees = [t for t in trees if t is not None]


def add_rank_trees(rollout_data: dict[str, Any]) -> None:
    """The DP rank's trees, by its partition, under TREE_ROWS (a no-op for a step without)."""
    with _step_lock:
        trees = _step_trees
    if trees is None or "partition" not in rollout_data:
        return
    picked = []
    for position, index in enumerate(rollout_data["partition"]):
        index = int(index)
        if not 0 <= index < len(trees):
            raise TreeError(
                f"sample {index} of a step of {len(trees)}: the rollout log hook saw another "
                "list of samples than slime split (slime_ext.slime.tree)"
            )
        length = len(rollout_data["tokens"][position])
        if trees[index].shape != (3, length):
            raise TreeError(
                f"sample {index}: a tree of {tuple(trees[index].shape)} for {length} tokens"
            )
        picked.append(trees[index])
    rollout_data[TREE_ROWS] = picked


def install_rollout_side() -> None:
    """Wrap slime.ray.rollout's tensorize_rollout_data_for_training (once)."""
    before_rank_split(add_rank_trees, TAG, _drifted)


# 2. the Megatron ranks -------------------------------------------------------------------


_expect_trees = False
"""The job trains tree-packed samples: a micro-batch without trees is an error."""


def init(args: Any) -> None:
    """--custom-megatron-init-path: every extension of the training side (the trees, the
    teacher's top-k), installed on each Megatron rank."""
    global _expect_trees
    if args is not None:
        from slime_ext.slime.settings import config_path, load_job

        _expect_trees = load_job(config_path(args)).algorithm.sequence_layout == "packed"
    install_train_side()
    topk.install_train_side()


def install_train_side() -> None:
    from slime.backends.megatron_utils import data, model
    from slime.observability import train_metric_utils

    require_source(
        data.get_batch,
        ('batch["packed_seq_params"] = packed_seq_params', "data_iterator.get_next(keys)"),
        "slime.backends.megatron_utils.data.get_batch",
        _drifted,
    )
    wrap(model, "get_batch", _with_trees, TAG, _drifted)
    wrap(train_metric_utils, "log_rollout_data", logged_without((TREE_ROWS,)), TAG, _drifted)


def _with_trees(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_batch(data_iterator: Any, keys: Sequence[str], *args: Any, **kwargs: Any) -> Any:
        if "tokens" not in keys:
            return original(data_iterator, keys, *args, **kwargs)
        batch = original(data_iterator, [*keys, TREE_ROWS], *args, **kwargs)
        trees = batch.pop(TREE_ROWS, None)
        if trees is None and _expect_trees:
            # without its tree a packed sample is attended causally: a silently wrong model
            raise TreeError(
                "a micro-batch of a tree-packed job arrived without its trees: slime's DP "
                "split did not carry them (slime_ext.slime.tree, step 1)"
            )
        if trees is not None:
            allgather_cp = kwargs.get("allgather_cp", args[1] if len(args) > 1 else False)
            if allgather_cp:
                raise HookConfigError("tree-packed samples do not take --allgather-cp")
            setattr(batch["packed_seq_params"], TREE_ATTRIBUTE, list(trees))
        return batch

    return get_batch


def _drifted(name: str, what: str) -> str:
    return (
        f"tree-packed samples cannot reach the attention: {name} {what}; "
        "slime_ext.slime.tree extends slime's data path as it is at the commit "
        "tests/slime_cpu.py pins (SLIME_COMMIT); use that slime or "
        "algorithm.sequence_layout: per_turn"
    )
