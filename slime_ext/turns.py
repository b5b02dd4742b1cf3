"""Trajectories -> training batches, with the loss only on each turn's span (DESIGN.md:
per-turn spans). Two layouts of the same computation:

- per turn (`per_turn_batch`): one sequence per turn, its context then its span; about
  K x L tokens per trajectory, every context recomputed;
- tree-packed (`packed_batch`): one sequence per trajectory, every token once. The trunk
  is the stored context ids; turn k's span is a branch placed at the positions right
  after context_k, seeing only context_k (the trunk's first context_len_k tokens, then the
  turn's drifted suffix when it has one) and its own earlier tokens. A span that the
  trunk already holds at those positions (think kept) is read from the trunk itself.
  The rule is a [L, L] boolean attention mask with explicit position ids, the
  trunk-then-branches kernel (`trunk_then_branches`, slime_ext.tree_attention) that runs
  it without one, or FlexAttention with a block mask (slime_ext.flex_tree). Hybrid
  (Gated DeltaNet linear-attention) models take only the trunk-then-branches kernel: it
  runs each branch of a linear-attention layer from the trunk's state at its fork
  (slime_ext.hybrid_tree).

Rows of a batch are right-padded; `span_rows` index the flattened [B * L] positions whose
outputs predict the span tokens (the same tokens in the same order in both layouts), so a
trainer computes the LM head only there. Masks follow invariant 4: imitation losses drop
tier-1/2 turns, KL losses keep them unless configured off. Every token carries its
trajectory's index for the per-trajectory normalization of invariant 7.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from rollout.masking import loss_mask_for
from rollout.trajectory import Trajectory
from slime_ext.hybrid_tree import (
    LINEAR_ATTENTION,
    config_layer_types,
    hybrid_tree,
    hybrid_tree_forward,
    is_hybrid,
    layer_types,
    unsupported_linear_layers,
)
from slime_ext.tree_attention import tree_forward, tree_layout

LossKind = Literal["imitation", "kl"]
Layout = Literal["per_turn", "packed"]


class PackingUnsupported(ValueError):
    """The model cannot evaluate a tree-packed sequence exactly (it has no attention mask
    to express branches, e.g. linear-attention layers)."""


@dataclass
class TurnBatch:
    input_ids: Tensor
    """[B, L] token ids, right-padded."""
    attention_mask: Tensor
    """[B, L] 1 on real tokens (per turn), or [B, 1, L, L] bool: which positions each
    position attends to (packed)."""
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
    num_processed_tokens: int
    """Tokens the forward pass runs over (padding excluded): the layout's cost."""
    position_ids: Tensor | None = None
    """[B, L] explicit positions (packed: a branch continues its context's positions)."""
    packs: list[PackedSequence] | None = None
    """Packed without a dense mask: each trajectory's layout, for the trunk-then-branches
    kernel."""

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class _Spans:
    """Every span token of a list of trajectories, in turn order, with its annotations."""

    targets: list[int]
    mask: list[bool]
    owners: list[int]
    sampler: list[float] | None
    teacher: list[float] | None
    topk_ids: list[list[int]] | None
    topk_logprobs: list[list[float]] | None


def _spans(
    trajectories: Sequence[Trajectory],
    loss: LossKind,
    train_kl_on_invalid: bool,
    imitate_invalid: bool = False,
) -> _Spans:
    targets: list[int] = []
    mask: list[bool] = []
    owners: list[int] = []
    sampler: list[float] = []
    teacher: list[float] = []
    topk_ids: list[list[int]] = []
    topk_logprobs: list[list[float]] = []
    has_sampler = has_teacher = has_topk = True
    for index, trajectory in enumerate(trajectories):
        for turn in trajectory.turns:
            targets += turn.span_ids
            carries = loss_mask_for(turn.mask_tier, loss, train_kl_on_invalid, imitate_invalid)
            mask += [carries] * len(turn.span_ids)
            owners += [index] * len(turn.span_ids)
            has_sampler &= turn.logprobs is not None
            has_teacher &= turn.teacher_logprobs is not None
            has_topk &= turn.teacher_topk_ids is not None
            sampler += turn.logprobs or []
            teacher += turn.teacher_logprobs or []
            topk_ids += turn.teacher_topk_ids or []
            topk_logprobs += turn.teacher_topk_logprobs or []
    some = bool(targets)
    return _Spans(
        targets,
        mask,
        owners,
        sampler if has_sampler and some else None,
        teacher if has_teacher and some else None,
        topk_ids if has_topk and some else None,
        topk_logprobs if has_topk and some else None,
    )


def _batch(
    spans: _Spans,
    input_ids: Tensor,
    attention_mask: Tensor,
    rows: list[int],
    num_trajectories: int,
    processed: int,
    position_ids: Tensor | None = None,
) -> TurnBatch:
    optional = torch.tensor
    return TurnBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        span_rows=torch.tensor(rows, dtype=torch.long),
        targets=torch.tensor(spans.targets, dtype=torch.long),
        loss_mask=torch.tensor(spans.mask, dtype=torch.bool),
        trajectory_index=torch.tensor(spans.owners, dtype=torch.long),
        sampler_logprobs=None if spans.sampler is None else optional(spans.sampler),
        teacher_logprobs=None if spans.teacher is None else optional(spans.teacher),
        teacher_topk_ids=None if spans.topk_ids is None else optional(spans.topk_ids),
        teacher_topk_logprobs=None
        if spans.topk_logprobs is None
        else optional(spans.topk_logprobs),
        num_trajectories=num_trajectories,
        num_processed_tokens=processed,
        position_ids=position_ids,
    )


def per_turn_batch(
    trajectories: Sequence[Trajectory],
    loss: LossKind,
    train_kl_on_invalid: bool = True,
    pad_id: int = 0,
    imitate_invalid: bool = False,
) -> TurnBatch:
    sequences: list[list[int]] = []
    span_starts: list[int] = []
    for trajectory in trajectories:
        for k, turn in enumerate(trajectory.turns):
            context = trajectory.context_ids(k)
            sequences.append(context + turn.span_ids)
            span_starts.append(len(context))
    width = max((len(s) for s in sequences), default=1)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    rows: list[int] = []
    for row, (sequence, start) in enumerate(zip(sequences, span_starts, strict=True)):
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
        # the output at position p predicts token p + 1
        rows += [row * width + p for p in range(start - 1, len(sequence) - 1)]
    spans = _spans(trajectories, loss, train_kl_on_invalid, imitate_invalid)
    return _batch(spans, input_ids, attention, rows, len(trajectories), int(attention.sum()))


@dataclass
class PackedSequence:
    """One trajectory as a single sequence: trunk, then one branch per turn that needs one."""

    ids: list[int]
    positions: list[int]
    visible_trunk: list[int]
    """Per position: how many trunk tokens it may see (a trunk position: itself and before)."""
    branch: list[int]
    """Per position: -1 on the trunk, else the index of the turn whose branch holds it."""
    span_rows: list[int]
    """Positions whose outputs predict the span tokens, turns in order."""

    @property
    def trunk_len(self) -> int:
        return self.branch.count(-1)

    def branches(self) -> list[tuple[int, int, int]]:
        """(start, end, visible trunk tokens) of each branch, in order."""
        spans: list[tuple[int, int, int]] = []
        position = self.trunk_len
        while position < len(self.branch):
            end = position
            while end < len(self.branch) and self.branch[end] == self.branch[position]:
                end += 1
            spans.append((position, end, self.visible_trunk[position]))
            position = end
        return spans


class PackableTurn(Protocol):
    """What packing reads of a turn (rollout.trajectory.Turn, or the teacher API's)."""

    context_len: int
    context_suffix_ids: list[int]
    span_ids: list[int]


def pack_trajectory(trajectory: Trajectory) -> PackedSequence:
    return pack(trajectory.trunk_ids, trajectory.turns)


def pack(
    trunk_ids: Sequence[int], turns: Sequence[PackableTurn], stems: bool = False
) -> PackedSequence:
    """The trunk (cut to what some turn needs), then a branch per turn whose span the trunk
    does not already hold right after its context.

    `stems`: a branch without a drifted suffix starts with a copy of its context's last
    token (at that token's position, seeing the trunk before it: the same hidden state),
    so every span token is predicted by the position right before it in the sequence, the
    layout of a causal LM's shifted labels (slime's samples, `slime_ext.slime.packed`);
    one token more per such branch."""
    in_trunk = [_span_in_trunk(trunk_ids, turn) for turn in turns]
    trunk_len = max(
        (
            turn.context_len + (len(turn.span_ids) if held else 0)
            for turn, held in zip(turns, in_trunk, strict=True)
        ),
        default=0,
    )
    trunk_len = max(trunk_len, 1)
    ids = list(trunk_ids[:trunk_len])
    positions = list(range(trunk_len))
    visible = [p + 1 for p in range(trunk_len)]
    branch = [-1] * trunk_len
    rows: list[int] = []
    for k, (turn, held) in enumerate(zip(turns, in_trunk, strict=True)):
        start = turn.context_len
        if held:  # the trunk holds the span right after its context (think kept)
            rows += list(range(start - 1, start - 1 + len(turn.span_ids)))
            continue
        lead = list(turn.context_suffix_ids)
        if not lead and stems:
            lead, start = [trunk_ids[start - 1]], start - 1
        first = len(ids)
        tokens = lead + list(turn.span_ids)
        ids += tokens
        positions += list(range(start, start + len(tokens)))
        visible += [start] * len(tokens)
        branch += [k] * len(tokens)
        # span token j is predicted by the position before it: the context's last token
        # (the trunk's, when the branch has no lead), then the branch's own tokens
        rows.append(first + len(lead) - 1 if lead else start - 1)
        rows += list(range(first + len(lead), first + len(tokens) - 1))
    return PackedSequence(ids, positions, visible, branch, rows)


def _span_in_trunk(trunk_ids: Sequence[int], turn: PackableTurn) -> bool:
    if turn.context_suffix_ids:
        return False
    start = turn.context_len
    return list(trunk_ids[start : start + len(turn.span_ids)]) == list(turn.span_ids)


def attention_rule(packed: PackedSequence) -> Tensor:
    """[L, L] bool: query i may attend to key j (`may_attend` at every pair)."""
    index = torch.arange(len(packed.ids))
    branch = torch.tensor(packed.branch)
    visible = torch.tensor(packed.visible_trunk)
    return may_attend(index[:, None], index[None, :], branch, visible)


def may_attend(query: Tensor, key: Tensor, branch: Tensor, visible: Tensor) -> Tensor:
    """Whether packed position `query` may attend to `key` (broadcasting index tensors;
    `branch` and `visible` are PackedSequence's per-position lists). Trunk keys: causal,
    and a branch sees only its context's part of the trunk; branch keys: only the same
    branch's, causally. Also FlexAttention's mask_mod (slime_ext.flex_tree)."""
    key_branch = branch[key]
    trunk_key = (key_branch == -1) & (key < visible[query])
    same_branch = (key_branch == branch[query]) & (key_branch != -1)
    return (key <= query) & (trunk_key | same_branch)


def trunk_then_branches(
    model: Any, pack: PackedSequence, group: int = 1, rows: Sequence[int] | None = None
) -> Tensor:
    """Hidden states [len(pack.ids), H] of every packed position of a HF causal LM, or
    [len(rows), H] of the positions `rows` (the last layer then skips the trunk's queries
    that no row reads). One forward (slime_ext.tree_attention): position-wise layers over
    all tokens at once; in attention, the trunk causally, then the branches, `group` at a
    time, each on its context's slice of the trunk's keys and values (gradients flow
    through the slice into the trunk). Linear-attention layers of a hybrid model run the
    trunk, then each branch from the trunk's state where it forks
    (slime_ext.hybrid_tree). Exact for full-attention and Gated DeltaNet hybrid models.
    One branch per group does the least attention work; on the bench trajectory groups
    of 2 cost about the same, of 4 and 8 10-30% more CPU time, all 40 at once 2.5x."""
    config = model.config
    check_sdpa(model, "the trunk-then-branches kernel")
    device = next(model.parameters()).device
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    kinds = layer_types(model) or ["full_attention"] * config.num_hidden_layers
    # the read-only last layer is counted in attention calls: only when the model ends in one
    attention_calls = kinds.count("full_attention")
    last = attention_calls - 1 if kinds[-1] == "full_attention" else None
    layout = tree_layout(
        pack.trunk_len, pack.branches(), group, device, model.dtype, kv_heads, last, rows
    )
    ids = torch.tensor(pack.ids, device=device)
    positions = torch.tensor(pack.positions, device=device)
    if LINEAR_ATTENTION in kinds:
        tree = hybrid_tree(pack.trunk_len, pack.branches())
        hidden = hybrid_tree_forward(model, ids, positions, layout, tree)
    else:
        hidden = tree_forward(model, ids, positions, layout)
    return hidden if rows is None else hidden[torch.tensor(rows, device=device)]


def check_sdpa(model: Any, kernel: str) -> None:
    """Refuse models whose attention does not go through SDPA (where the packed kernels
    take over, slime_ext.tree_attention.SdpaOverride)."""
    implementation = model.config._attn_implementation
    if implementation != "sdpa":
        raise PackingUnsupported(
            f"{kernel} runs through SDPA; this model's attention is {implementation!r}: "
            f"load it with attn_implementation='sdpa' or use packed_kernel: mask"
        )


def check_packable(model: object, kernel: str = "kv") -> None:
    """Refuse models whose layers cannot take a tree-packed sequence through `kernel` (kv:
    the trunk-then-branches kernel, the only one hybrid models take; mask, flex)."""
    config = getattr(model, "config", None)
    reason = unpackable_reason(config)
    if reason is None and config is not None and is_hybrid(model):
        reason = unsupported_linear_layers(model)
        if reason is None and kernel != "kv":
            raise PackingUnsupported(
                f"packed_kernel {kernel} takes full-attention models only (a mask has no "
                "branch for a linear-attention state): use packed_kernel kv or auto"
            )
    if reason is not None:
        raise PackingUnsupported(
            f"{reason}: train it with the per-turn layout (algorithm.sequence_layout: per_turn)"
        )


RECURRENT_MODEL_TYPES = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm")
"""HF model types without attention layers (their state runs over the whole sequence)."""


def unpackable_reason(config: object) -> str | None:
    """Why a model (its HF config) cannot evaluate a tree-packed sequence exactly, or None.
    Every layer must be full attention or linear attention (run from the trunk's state:
    slime_ext.hybrid_tree); sliding windows and recurrent models have neither a mask nor
    that path for a branch."""
    if config is None:
        return None
    kinds = set(config_layer_types(config)) - {"full_attention", LINEAR_ATTENTION}
    if kinds:
        return (
            f"this model has {', '.join(sorted(kinds))} layers, whose state or window cannot "
            "express tree branches with a mask"
        )
    model_type = str(getattr(config, "model_type", ""))
    if model_type in RECURRENT_MODEL_TYPES:
        return f"this model ({model_type}) is recurrent: no attention mask can express branches"
    return None


def packed_batch(
    trajectories: Sequence[Trajectory],
    loss: LossKind,
    train_kl_on_invalid: bool = True,
    pad_id: int = 0,
    dense_mask_up_to: int | None = None,
    imitate_invalid: bool = False,
) -> TurnBatch:
    """One packed sequence per trajectory; the same span tokens as `per_turn_batch`.
    The [B, L, L] attention mask is built when the longest packed sequence has at most
    `dense_mask_up_to` tokens (None: always; 0: never); otherwise the batch carries
    `packs` for the trunk-then-branches kernel instead."""
    packs = [pack_trajectory(t) for t in trajectories]
    width = max((len(p.ids) for p in packs), default=1)
    dense_mask = dense_mask_up_to is None or width <= dense_mask_up_to
    count = len(packs)
    input_ids = torch.full((count, width), pad_id, dtype=torch.long)
    positions = torch.zeros((count, width), dtype=torch.long)
    # padding attends to itself only, so no row of the mask is empty
    mask = torch.eye(width if dense_mask else 1, dtype=torch.bool).repeat(count, 1, 1)
    rows: list[int] = []
    for row, pack in enumerate(packs):
        size = len(pack.ids)
        input_ids[row, :size] = torch.tensor(pack.ids)
        positions[row, :size] = torch.tensor(pack.positions)
        if dense_mask:
            mask[row, :size, :size] = attention_rule(pack)
        rows += [row * width + r for r in pack.span_rows]
    spans = _spans(trajectories, loss, train_kl_on_invalid, imitate_invalid)
    processed = sum(len(p.ids) for p in packs)
    batch = _batch(spans, input_ids, mask[:, None], rows, count, processed, positions)
    batch.packs = None if dense_mask else packs
    return batch
