"""A Trajectory -> slime Samples: one per turn (think dropped), or one per trajectory
(think kept), or, tree-packed, one per trajectory whatever the think policy (every token
once: `packed_sample`), or a removable placeholder when the trajectory did not end normally.

Samples are copies of the Sample slime handed to the generate hook (`dataclasses.replace`),
so this module never imports slime and keeps whatever fields slime adds. Every sample of
one trajectory carries the same rollout_id: slime keeps siblings in one training step and
divides by their summed loss tokens (the per-trajectory normalization, invariant 7).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from rollout.masking import loss_mask_for
from rollout.runner import trajectory_summary
from rollout.trajectory import Trajectory, TrajectoryStatus
from slime_ext.slime.topk import TOPK_KEY, TopKError, TopKRows, filler, rows_from_turn
from slime_ext.turns import Layout, LossKind, PackedSequence, pack

METADATA_KEY = "opd"
"""Sample.metadata[METADATA_KEY]: what our metrics read back (trajectory and turn)."""
HINT_STATS_KEY = "hint_stats"
"""OPSD: the generate hook's hint counts (rollout/hint_*, since the run started) when the
trajectory finished; the rollout log reports the latest of a step's samples."""
TREE_KEY = "opd_tree"
"""sample.train_metadata[TREE_KEY] (packed layout): int32 [3, len(tokens)], each token's
position, branch (-1 on the trunk) and visible trunk length (`PackedSequence`), what the
tree attention reads (`slime_ext.slime.tree`)."""
REMINDER_STATS_KEY = "reminder_stats"
"""OPRD: the reminder counts of the trajectory's own teacher contexts (ReminderStats as a
dict); the rollout log adds up a step's trajectories."""
FLEET_STATS_KEY = "fleet_stats"
"""SWE: the job's sandbox fleet (slime_ext.job.sandboxes.fleet_metrics: counters since the
fleet opened, each host's load) when the trajectory finished; the rollout log reports the
latest of a step's samples."""


def to_samples(
    trajectory: Trajectory,
    base: Any,
    loss_kind: LossKind,
    train_kl_on_invalid: bool = True,
    with_teacher: bool = True,
    teacher_top_k: int = 0,
    layout: Layout = "per_turn",
) -> list[Any]:
    """The samples slime trains on for one trajectory (`base` is slime's Sample).
    `teacher_top_k` > 0: every sample also carries the teacher's top-k rows
    (`slime_ext.slime.topk`), k wide. `layout` packed: one tree-packed sample, every
    sample (placeholders too) carrying its tree (TREE_KEY)."""
    k = teacher_top_k if with_teacher else 0

    def removed(reason: str) -> list[Any]:
        sample = placeholder(trajectory, base, reason, with_teacher, k)
        if layout == "packed":
            sample = _with_tree(sample, causal_tree(len(sample.tokens)))
        return [sample]

    if not trajectory.ended_normally:
        return removed(trajectory.status_reason)
    if not trajectory.turns:
        return removed("no turns")
    if with_teacher and any(turn.teacher_logprobs is None for turn in trajectory.turns):
        return removed("a turn has no teacher scores")
    try:
        topk = [_turn_topk(turn, k) for turn in trajectory.turns] if k else None
    except TopKError as err:
        return removed(f"teacher top-k: {err}")
    if layout == "packed":
        return [packed_sample(trajectory, base, loss_kind, train_kl_on_invalid, with_teacher, topk)]
    if trajectory.think_policy == "keep":
        whole = _one_sequence(trajectory, base, loss_kind, train_kl_on_invalid, with_teacher)
        if whole is not None:
            return [_with_topk(whole, _spread(trajectory, whole, topk, k)) if topk else whole]
    samples = [
        _turn_sample(trajectory, t, base, loss_kind, train_kl_on_invalid, with_teacher)
        for t in range(trajectory.num_turns)
    ]
    if topk is None:
        return samples
    return [_with_topk(s, rows) for s, rows in zip(samples, topk, strict=True)]


def _turn_topk(turn: Any, k: int) -> TopKRows:
    if turn.teacher_topk_ids is None or turn.teacher_topk_logprobs is None:
        raise TopKError("a turn has none (score with teacher.top_k > 0)")
    rows = rows_from_turn(turn.teacher_topk_ids, turn.teacher_topk_logprobs, k)
    if rows.ids.shape[0] != len(turn.span_ids):
        raise TopKError(f"{rows.ids.shape[0]} rows for a span of {len(turn.span_ids)}")
    return rows


def _spread(trajectory: Trajectory, whole: Any, topk: list[TopKRows], k: int) -> TopKRows:
    """Think kept: each turn's rows at its span's place in the one sequence's response."""
    rows = filler(int(whole.response_length), k)
    prompt = len(whole.tokens) - int(whole.response_length)
    for t, turn_rows in enumerate(topk):
        start = len(trajectory.context_ids(t)) - prompt
        rows.ids[start : start + turn_rows.ids.shape[0]] = turn_rows.ids
        rows.logprobs[start : start + turn_rows.ids.shape[0]] = turn_rows.logprobs
    return rows


def packed_sample(
    trajectory: Trajectory,
    base: Any,
    loss_kind: LossKind,
    train_kl_on_invalid: bool,
    with_teacher: bool,
    topk: list[TopKRows] | None = None,
) -> Any:
    """The trajectory as one sample: `pack(..., stems=True)`'s ids (the trunk, then a branch
    per turn whose span the trunk does not hold), so that, as in any slime sample, the
    output before each response token predicts it. The response runs from the first span
    token to the end; loss mask, rollout and teacher log-probs (and each turn's top-k
    rows, `topk`) are the spans' at their places, 0 (filler) elsewhere (observations,
    stems, drifted suffixes); the tree rides in train_metadata[TREE_KEY]."""
    packed = pack(trajectory.trunk_ids, trajectory.turns, stems=True)
    prompt = min(packed.span_rows) + 1
    places = [row + 1 - prompt for row in packed.span_rows]
    sample = _whole_trajectory_sample(
        trajectory, base, packed.ids, prompt, places, loss_kind, train_kl_on_invalid, with_teacher
    )
    sample = _with_tree(sample, tree_rows(packed))
    if topk is None:
        return sample
    rows = filler(int(sample.response_length), topk[0].ids.shape[1])
    where = torch.tensor(places, dtype=torch.long)
    rows.ids[where] = torch.cat([r.ids for r in topk])
    rows.logprobs[where] = torch.cat([r.logprobs for r in topk])
    return _with_topk(sample, rows)


def _whole_trajectory_sample(
    trajectory: Trajectory,
    base: Any,
    tokens: list[int],
    prompt: int,
    places: list[int],
    loss_kind: LossKind,
    train_kl_on_invalid: bool,
    with_teacher: bool,
) -> Any:
    """One sample for a whole trajectory: `tokens`, the response from `prompt` on, each
    span token (turns in order) at its place in the response with its loss mask and
    log-probs; 0 elsewhere."""
    response = len(tokens) - prompt
    mask, logprobs, teacher = [0] * response, [0.0] * response, [0.0] * response
    spans = [(turn, j) for turn in trajectory.turns for j in range(len(turn.span_ids))]
    for at, (turn, j) in zip(places, spans, strict=True):
        if tokens[prompt + at] != turn.span_ids[j]:
            raise AssertionError(f"response token {at} is not its span token")
        mask[at] = int(loss_mask_for(turn.mask_tier, loss_kind, train_kl_on_invalid))
        logprobs[at] = turn.logprobs[j] if turn.logprobs else 0.0
        if turn.teacher_logprobs is not None:
            teacher[at] = turn.teacher_logprobs[j]
    return dataclasses.replace(
        base,
        rollout_id=rollout_id_of(base),
        tokens=list(tokens),
        response_length=response,
        loss_mask=mask,
        rollout_log_probs=logprobs,
        teacher_log_probs=teacher if with_teacher else None,
        reward=float(trajectory.reward or 0.0),
        status=_status(trajectory, base),
        metadata={**base.metadata, METADATA_KEY: _summary(trajectory) | {"turn": None}},
    )


def tree_rows(packed: PackedSequence) -> Tensor:
    """int32 [3, L]: positions, branch, visible trunk length."""
    return torch.tensor([packed.positions, packed.branch, packed.visible_trunk], dtype=torch.int32)


def causal_tree(length: int) -> Tensor:
    """The tree of a plain sequence: positions 0.., no branch, each token sees the ones
    before it."""
    index = torch.arange(length, dtype=torch.int32)
    return torch.stack([index, torch.full_like(index, -1), index + 1])


def _with_tree(sample: Any, tree: Tensor) -> Any:
    if tree.shape != (3, len(sample.tokens)):
        raise AssertionError(f"a tree of {tuple(tree.shape)} for {len(sample.tokens)} tokens")
    metadata = {**(sample.train_metadata or {}), TREE_KEY: tree}
    return dataclasses.replace(sample, train_metadata=metadata)


def _with_topk(sample: Any, rows: TopKRows) -> Any:
    metadata = {**(sample.train_metadata or {}), TOPK_KEY: rows.as_metadata()}
    return dataclasses.replace(sample, train_metadata=metadata)


def rollout_id_of(base: Any) -> int:
    """slime's rollout_id, else the sample's global index (unique per rollout)."""
    if base.rollout_id is not None:
        return int(base.rollout_id)
    if base.index is None:
        raise ValueError("the sample has neither rollout_id nor index: siblings need an id")
    return int(base.index)


def placeholder(
    trajectory: Trajectory, base: Any, reason: str, with_teacher: bool, teacher_top_k: int = 0
) -> Any:
    """One removable sample that records why the trajectory gave nothing to train on; its
    log-probs are zero-filled (slime copies teacher_log_probs only if every sample has them),
    its top-k rows (teacher_top_k > 0) filler."""
    tokens = list(trajectory.trunk_ids)
    if len(tokens) < 2:
        tokens = tokens * 2
    sample = dataclasses.replace(
        base,
        rollout_id=rollout_id_of(base),
        tokens=tokens,
        response_length=1,
        loss_mask=[0],
        rollout_log_probs=[0.0],
        teacher_log_probs=[0.0] if with_teacher else None,
        reward=float(trajectory.reward or 0.0),
        remove_sample=True,
        status=type(base).Status.ABORTED,
        metadata={
            **base.metadata,
            METADATA_KEY: _summary(trajectory) | {"abort_reason": reason, "placeholder": True},
        },
    )
    return _with_topk(sample, filler(1, teacher_top_k)) if teacher_top_k else sample


def _turn_sample(
    trajectory: Trajectory,
    k: int,
    base: Any,
    loss_kind: LossKind,
    train_kl_on_invalid: bool,
    with_teacher: bool,
) -> Any:
    turn = trajectory.turns[k]
    span = len(turn.span_ids)
    carries = loss_mask_for(turn.mask_tier, loss_kind, train_kl_on_invalid)
    return dataclasses.replace(
        base,
        rollout_id=rollout_id_of(base),
        tokens=trajectory.context_ids(k) + list(turn.span_ids),
        response_length=span,
        loss_mask=[int(carries)] * span,
        rollout_log_probs=list(turn.logprobs) if turn.logprobs is not None else [0.0] * span,
        teacher_log_probs=list(turn.teacher_logprobs or []) if with_teacher else None,
        reward=float(trajectory.reward or 0.0),
        status=_status(trajectory, base),
        metadata={**base.metadata, METADATA_KEY: _summary(trajectory) | _turn_info(trajectory, k)},
    )


def _one_sequence(
    trajectory: Trajectory,
    base: Any,
    loss_kind: LossKind,
    train_kl_on_invalid: bool,
    with_teacher: bool,
) -> Any | None:
    """Think kept: the last context holds every earlier span, so one sequence carries all
    of them; observation and template tokens inside it get loss mask 0 and log-prob 0.
    None when a later context does not hold a span exactly (drift): then per-turn samples."""
    last = trajectory.num_turns - 1
    tokens = trajectory.context_ids(last) + list(trajectory.turns[last].span_ids)
    prompt = len(trajectory.context_ids(0))
    places: list[int] = []
    for k, turn in enumerate(trajectory.turns):
        context = trajectory.context_ids(k)
        start = len(context)
        if turn.drift or tokens[:start] != context:
            return None
        if tokens[start : start + len(turn.span_ids)] != list(turn.span_ids):
            return None
        places += range(start - prompt, start - prompt + len(turn.span_ids))
    return _whole_trajectory_sample(
        trajectory, base, tokens, prompt, places, loss_kind, train_kl_on_invalid, with_teacher
    )


def _status(trajectory: Trajectory, base: Any) -> Any:
    statuses = type(base).Status
    if trajectory.status is TrajectoryStatus.TRUNCATED:
        return statuses.TRUNCATED
    return statuses.COMPLETED


def _summary(trajectory: Trajectory) -> dict[str, Any]:
    summary = trajectory_summary(trajectory) | {
        "drift_turns": sum(t.drift for t in trajectory.turns)
    }
    for key in (HINT_STATS_KEY, REMINDER_STATS_KEY, FLEET_STATS_KEY):
        if key in trajectory.metadata:
            summary[key] = trajectory.metadata[key]
    return summary


def _turn_info(trajectory: Trajectory, k: int) -> dict[str, Any]:
    turn = trajectory.turns[k]
    return {"turn": k, "mask_tier": int(turn.mask_tier), "drift": turn.drift}
