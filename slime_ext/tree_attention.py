"""One forward of a tree-packed sequence through a HF full-attention model, with a custom
attention kernel (slime_ext.turns: the packed layout).

Everything but attention is position-wise, so embeddings, norms, projections, rotary
embeddings (from the explicit position ids) and MLPs run once over all packed tokens, in
the model's own modules. Only attention knows the tree: the trunk attends causally to
itself in one SDPA call; each group of branches attends to a slice of the trunk's keys
and values (its context, gathered from the layer's own keys, never through a cache) and
causally to its own tokens. Gradients flow from the branches into the trunk.

The layout reaches the kernel as the attention mask: a `TreeBias` tensor that takes over
`scaled_dot_product_attention` when it is the mask (as torch's own CausalBias does), so
the model's modules and config are untouched and other threads can use the same model.
It needs models whose attention goes through transformers' "sdpa" implementation.
`SdpaOverride` is that mechanism for any kernel (slime_ext.flex_tree: FlexAttention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class TreeLayout:
    """What the kernel needs of a packed sequence, built once for every layer."""

    query_sizes: list[int]
    """The trunk's length, then each branch group's token count: the packed positions in
    order."""
    key_index: Tensor
    """Each group's keys, groups concatenated: the trunk prefix it reads, then its own
    positions."""
    key_sizes: list[int]
    masks: list[Tensor]
    """[group tokens, prefix + group tokens] additive (0 or -inf), per group."""
    kv_heads: int
    """Key/value heads of the model's attention (transformers repeats them for SDPA)."""
    last_layer: int | None = None
    """The index of the model's last attention layer, when `read_trunk` applies to it."""
    read_trunk: Tensor | None = None
    """The trunk positions whose final outputs are read: the last layer computes the
    trunk's attention only there (its other trunk outputs feed nothing)."""
    read_trunk_mask: Tensor | None = None
    """[len(read_trunk), last read trunk position + 1] additive: causal for those rows."""


def tree_layout(
    trunk_len: int,
    branches: Sequence[tuple[int, int, int]],
    group: int,
    device: torch.device,
    dtype: torch.dtype,
    kv_heads: int,
    last_layer: int | None = None,
    read_rows: Sequence[int] | None = None,
) -> TreeLayout:
    """Groups `group` consecutive branches ((start, end, visible trunk tokens) each, as
    `PackedSequence.branches()`); a group reads the longest prefix any of its branches
    sees, and its mask hides the rest. With `read_rows` (the packed positions whose final
    outputs the caller reads) and `last_layer`, the last layer skips the trunk's other
    queries."""
    query_sizes, key_index, key_sizes, masks = [trunk_len], [], [], []
    longest = max((end - start for start, end, _ in branches), default=0)
    widest = max((visible for _, _, visible in branches), default=0)
    # a lone branch sees its whole prefix, then itself causally: its mask is a view of
    # one shared [longest, widest + longest] matrix, ending where the branch's keys end
    shared = torch.full((longest, widest + longest), float("-inf"), device=device, dtype=dtype)
    shared = shared.triu(widest + 1)
    for first in range(0, len(branches), group):
        chosen = branches[first : first + group]
        start, end = chosen[0][0], chosen[-1][1]
        size = end - start
        prefix_len = max(visible for _, _, visible in chosen)
        query_sizes.append(size)
        key_index += [torch.arange(prefix_len), torch.arange(start, end)]
        key_sizes.append(prefix_len + size)
        if len(chosen) == 1:
            masks.append(shared[:size, widest - prefix_len : widest + size])
            continue
        owner = torch.cat([torch.full((e - s,), b) for b, (s, e, _) in enumerate(chosen)])
        visible = torch.cat([torch.full((e - s,), v) for s, e, v in chosen])
        owner, visible = owner.to(device), visible.to(device)
        queries = torch.arange(size, device=device)
        sees_prefix = torch.arange(prefix_len, device=device)[None, :] < visible[:, None]
        sees_group = (owner[None, :] == owner[:, None]) & (queries[None, :] <= queries[:, None])
        sees = torch.cat([sees_prefix, sees_group], dim=1)
        additive = torch.zeros(sees.shape, device=device, dtype=dtype)
        masks.append(additive.masked_fill_(~sees, -torch.inf))
    index = torch.cat(key_index) if key_index else torch.zeros(0, dtype=torch.long)
    layout = TreeLayout(query_sizes, index.to(device), key_sizes, masks, kv_heads)
    if last_layer is None or read_rows is None:
        return layout
    read = torch.tensor(sorted({row for row in read_rows if row < trunk_len}), dtype=torch.long)
    reach = int(read[-1]) + 1 if len(read) else 0
    future = torch.arange(reach)[None, :] > read[:, None]
    read_mask = torch.zeros(future.shape, dtype=dtype).masked_fill_(future, -torch.inf)
    return replace(
        layout,
        last_layer=last_layer,
        read_trunk=read.to(device),
        read_trunk_mask=read_mask.to(device),
    )


class SdpaOverride(torch.Tensor):
    """An empty tensor that, as the mask of `scaled_dot_product_attention`, runs its class's
    `attention` instead (called with the same arguments, itself as `attn_mask`)."""

    @staticmethod
    def __new__(cls) -> Self:
        return torch.Tensor._make_subclass(cls, torch.empty(0, dtype=torch.bool))

    @staticmethod
    def attention(*args: Any, **kwargs: Any) -> Tensor:
        raise NotImplementedError

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return cls.attention(*args, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)


class TreeBias(SdpaOverride):
    """Stands for a TreeLayout: runs `tree_attention`."""

    tree: TreeLayout
    calls: int
    """Attention calls served so far: the index of the layer being run (one forward)."""

    @staticmethod
    def __new__(cls, layout: TreeLayout) -> TreeBias:
        bias = SdpaOverride.__new__(cls)
        bias.tree = layout
        bias.calls = 0
        return bias

    @staticmethod
    def attention(*args: Any, **kwargs: Any) -> Tensor:
        return tree_attention(*args, **kwargs)


def tree_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: TreeBias,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """`scaled_dot_product_attention` of query [1, heads, L, d] and key/value [1, heads or
    kv heads, L, d] over every packed position, by the layout of `attn_mask`."""
    layout, layer = attn_mask.tree, attn_mask.calls
    attn_mask.calls += 1
    if dropout_p or is_causal:
        raise ValueError("tree attention takes no dropout and no is_causal: the layout is the rule")
    if key.shape[1] != layout.kv_heads:  # transformers repeated the kv heads: undo it (a view)
        repeats = key.shape[1] // layout.kv_heads
        key, value = key[:, ::repeats], value[:, ::repeats]
    gqa = query.shape[1] != key.shape[1]
    # one gather and one split per tensor: their backward is one scatter, not one
    # zero-filled full-size gradient per slice
    queries = query.split(layout.query_sizes, dim=2)
    keys = key.index_select(2, layout.key_index).split(layout.key_sizes, dim=2)
    values = value.index_select(2, layout.key_index).split(layout.key_sizes, dim=2)
    # layers recomputed later (gradient checkpointing) count past the last: full trunk
    read_only = layer == layout.last_layer
    outputs = [_trunk_attention(queries[0], key, value, layout, scale, gqa, read_only)]
    for group_queries, group_keys, group_values, mask in zip(
        queries[1:], keys, values, layout.masks, strict=True
    ):
        outputs.append(
            F.scaled_dot_product_attention(
                group_queries, group_keys, group_values, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        )
    return torch.cat(outputs, dim=2)


def _trunk_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layout: TreeLayout,
    scale: float | None,
    gqa: bool,
    read_only: bool,
) -> Tensor:
    """Causal attention of the trunk's queries [1, heads, trunk, d]; `read_only`: only at
    the rows that are read (the others are zero)."""
    trunk = query.shape[2]
    if not read_only or layout.read_trunk is None or layout.read_trunk_mask is None:
        return F.scaled_dot_product_attention(
            query,
            key[:, :, :trunk],
            value[:, :, :trunk],
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )
    if not len(layout.read_trunk):
        return query.new_zeros(query.shape)
    reach = layout.read_trunk_mask.shape[1]
    read = F.scaled_dot_product_attention(
        query.index_select(2, layout.read_trunk),
        key[:, :, :reach],
        value[:, :, :reach],
        attn_mask=layout.read_trunk_mask,
        scale=scale,
        enable_gqa=gqa,
    )
    return query.new_zeros(query.shape).index_copy(2, layout.read_trunk, read)


def tree_forward(model: Any, ids: Tensor, positions: Tensor, layout: TreeLayout) -> Tensor:
    """Final hidden states [L, H] of the packed ids [L] at their positions [L], through the
    model's "sdpa" attention with a TreeBias mask."""
    return override_forward(model, ids, positions, TreeBias(layout))


def override_forward(model: Any, ids: Tensor, positions: Tensor, mask: SdpaOverride) -> Tensor:
    """Final hidden states [L, H] of ids [L] at positions [L], `mask` given to every
    attention layer of the model's "sdpa" implementation."""
    mapping = {kind: mask for kind in set(getattr(model.config, "layer_types", None) or [])}
    mapping.setdefault("full_attention", mask)
    out = model.base_model(
        input_ids=ids[None], position_ids=positions[None], attention_mask=mapping
    )
    return out.last_hidden_state[0]
