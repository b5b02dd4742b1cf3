"""Trajectories -> per-turn training samples: one sequence per turn (its context, then its
span), with the loss only on the span (DESIGN.md: per-turn spans).

Rows of the batch are right-padded; `span_rows` index the flattened [B * L] positions
whose outputs predict the span tokens, so a trainer computes the LM head only there.
Masks follow invariant 4: imitation losses drop tier-1/2 turns, KL losses keep them
unless configured off. Every token carries its trajectory's index for the per-trajectory
normalization of invariant 7.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rollout.masking import loss_mask_for
from rollout.trajectory import Trajectory

LossKind = Literal["imitation", "kl"]


@dataclass
class TurnBatch:
    input_ids: Tensor
    """[B, L] token ids, right-padded."""
    attention_mask: Tensor
    """[B, L] 1 on real tokens."""
    span_rows: Tensor
    """[T] indices into the flattened [B * L] positions: the outputs that predict span tokens."""
    targets: Tensor
    """[T] the span tokens."""
    loss_mask: Tensor
    """[T] bool: whether the token carries loss."""
    trajectory_index: Tensor
    """[T] which trajectory (index into the list given) each token belongs to."""
    sampler_logprobs: Tensor | None
    """[T] the rollout's log-probs, when every turn has them."""
    teacher_logprobs: Tensor | None
    """[T] the teacher's log-probs, when every turn has them."""
    teacher_topk_ids: Tensor | None
    """[T, k] the teacher's top-k ids, when every turn has them (same k)."""
    teacher_topk_logprobs: Tensor | None
    """[T, k] their log-probs."""
    num_trajectories: int

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_processed_tokens(self) -> int:
        """Tokens the forward pass runs over (padding excluded): the per-turn cost."""
        return int(self.attention_mask.sum())


def per_turn_batch(
    trajectories: Sequence[Trajectory],
    loss: LossKind,
    train_kl_on_invalid: bool = True,
    pad_id: int = 0,
) -> TurnBatch:
    sequences: list[list[int]] = []
    span_starts: list[int] = []
    targets: list[int] = []
    mask: list[bool] = []
    owners: list[int] = []
    sampler: list[float] = []
    teacher: list[float] = []
    topk_ids: list[list[int]] = []
    topk_logprobs: list[list[float]] = []
    has_sampler = has_teacher = has_topk = True
    for index, trajectory in enumerate(trajectories):
        for k, turn in enumerate(trajectory.turns):
            context = trajectory.context_ids(k)
            sequences.append(context + turn.span_ids)
            span_starts.append(len(context))
            targets += turn.span_ids
            carries = loss_mask_for(turn.mask_tier, loss, train_kl_on_invalid)
            mask += [carries] * len(turn.span_ids)
            owners += [index] * len(turn.span_ids)
            has_sampler &= turn.logprobs is not None
            has_teacher &= turn.teacher_logprobs is not None
            has_topk &= turn.teacher_topk_ids is not None
            sampler += turn.logprobs or []
            teacher += turn.teacher_logprobs or []
            topk_ids += turn.teacher_topk_ids or []
            topk_logprobs += turn.teacher_topk_logprobs or []
    width = max((len(s) for s in sequences), default=1)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    rows: list[int] = []
    for row, (sequence, start) in enumerate(zip(sequences, span_starts, strict=True)):
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
        # the output at position p predicts token p + 1
        rows += [row * width + p for p in range(start - 1, len(sequence) - 1)]
    return TurnBatch(
        input_ids=input_ids,
        attention_mask=attention,
        span_rows=torch.tensor(rows, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        trajectory_index=torch.tensor(owners, dtype=torch.long),
        sampler_logprobs=torch.tensor(sampler) if has_sampler and sequences else None,
        teacher_logprobs=torch.tensor(teacher) if has_teacher and sequences else None,
        teacher_topk_ids=torch.tensor(topk_ids) if has_topk and sequences else None,
        teacher_topk_logprobs=torch.tensor(topk_logprobs) if has_topk and sequences else None,
        num_trajectories=len(trajectories),
    )
