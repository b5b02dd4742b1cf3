"""A tree-packed trajectory (slime_ext.turns.pack) in one forward through FlexAttention:
the attention rule (`may_attend`) is the block mask's mask_mod, so blocks that no query
may read are skipped and no [L, L] mask exists.

The kernel reaches the model as its attention mask (a `SdpaOverride`, as the
trunk-then-branches kernel does), so the model stays on transformers' "sdpa"
implementation and other threads can use it meanwhile. On CUDA flex_attention runs
compiled (forward and backward); on the CPU torch runs its forward only, unfused (dense
scores, like the mask kernel): scoring there works under torch.no_grad, training refuses
(`FlexBackwardUnavailable`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from slime_ext.tree_attention import SdpaOverride, override_forward
from slime_ext.turns import PackedSequence, check_sdpa, may_attend


class FlexBackwardUnavailable(NotImplementedError):
    """FlexAttention has no backward on this device (torch's CPU build)."""


def block_mask(pack: PackedSequence, device: torch.device) -> BlockMask:
    """The packed sequence's attention rule as a FlexAttention block mask."""
    branch = torch.tensor(pack.branch, device=device)
    visible = torch.tensor(pack.visible_trunk, device=device)

    def mask_mod(batch: Tensor, head: Tensor, query: Tensor, key: Tensor) -> Tensor:
        return may_attend(query, key, branch, visible)

    length = len(pack.ids)
    return create_block_mask(mask_mod, None, None, length, length, device=device)


class FlexMask(SdpaOverride):
    """Stands for a BlockMask: runs `flex_tree_attention`."""

    block_mask: BlockMask

    @staticmethod
    def __new__(cls, mask: BlockMask) -> FlexMask:
        override = SdpaOverride.__new__(cls)
        override.block_mask = mask
        return override

    @staticmethod
    def attention(*args: Any, **kwargs: Any) -> Tensor:
        return flex_tree_attention(*args, **kwargs)


def flex_tree_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: FlexMask,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """`scaled_dot_product_attention` of query [1, heads, L, d] and key/value [1, heads or
    kv heads, L, d] by the block mask of `attn_mask`."""
    if dropout_p or is_causal:
        raise ValueError(
            "flex tree attention takes no dropout and no is_causal: the mask is the rule"
        )
    if query.device.type == "cpu" and (
        query.requires_grad or key.requires_grad or value.requires_grad
    ):
        raise FlexBackwardUnavailable(
            f"FlexAttention has no backward on the CPU (torch {torch.__version__}): train on "
            f"the CPU with packed_kernel: kv (or mask); flex runs there under torch.no_grad only"
        )
    kernel = _flex_attention(compiled=query.is_cuda)
    output = kernel(
        query, key, value, block_mask=attn_mask.block_mask, scale=scale, enable_gqa=enable_gqa
    )
    assert isinstance(output, Tensor)
    return output


@functools.cache
def _flex_attention(compiled: bool) -> Callable[..., Any]:
    # uncompiled (the CPU's forward), flex_attention materializes every score
    if not compiled:
        return flex_attention
    return torch.compile(flex_attention)


def flex_tree(model: Any, pack: PackedSequence, rows: Sequence[int] | None = None) -> Tensor:
    """Hidden states [len(pack.ids), H] of every packed position of a HF causal LM with
    "sdpa" attention, or [len(rows), H] of the positions `rows`: one forward, FlexAttention
    with the pack's block mask in every attention layer."""
    check_sdpa(model, "the FlexAttention kernel")
    device = next(model.parameters()).device
    ids = torch.tensor(pack.ids, device=device)
    positions = torch.tensor(pack.positions, device=device)
    hidden = override_forward(model, ids, positions, FlexMask(block_mask(pack, device)))
    return hidden if rows is None else hidden[torch.tensor(rows, device=device)]
