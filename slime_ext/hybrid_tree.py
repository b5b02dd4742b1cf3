"""A tree-packed sequence through a hybrid HF model (Qwen3.5, Qwen3-Next: Gated DeltaNet
linear-attention layers beside full attention), every token of the trajectory once.

A mask cannot express a branch for a recurrent layer, but a state can: a branch that leaves
the trunk after its first f tokens is the trunk's state at f run forward over the branch's
tokens. So, layer by layer:

- full-attention layers take the tree attention as Qwen3's do (slime_ext.tree_attention:
  a TreeBias as the mask of the model's SDPA attention);
- linear-attention layers run the trunk in segments cut at every fork, each segment from
  the state the one before left (the recurrent state and the short convolution's window),
  keeping the states at each fork; then the branches, in batches, each from its fork's
  states. Gradients flow into the trunk through those states.

Each piece is computed by the decoder layer's own modules (transformers' code: norms,
projections, the causal convolution, the chunked gated delta rule with its torch kernels
on CPU and flash-linear-attention's where installed, the gated norm, the MLP); the states
reach them as the cache a generation step passes (`_States`: the methods those modules
call). Only the model's outer loop is run here (`hybrid_tree_forward`: embeddings, rotary
embeddings, the layers, the final norm), and tests check it against the model's forward.
The model's modules and config are never changed, so other threads can use it meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slime_ext.tree_attention import TreeBias, TreeLayout

LINEAR_ATTENTION = "linear_attention"
BRANCH_PADDING = 1.25
"""A batch of branches is padded to its longest; a branch joins the batch while the padded
tokens stay within this factor of the real ones (sorted by length, so batches are tight)."""


def config_layer_types(config: Any) -> list[str]:
    """Each layer's kind from an HF config, or its text_config's (empty when it names none:
    all full attention)."""
    text = getattr(config, "text_config", None)
    kinds = getattr(config, "layer_types", None) or getattr(text, "layer_types", None)
    return [str(kind) for kind in kinds or []]


def layer_types(model: Any) -> list[str]:
    return config_layer_types(model.config)


def is_hybrid(model: Any) -> bool:
    return LINEAR_ATTENTION in layer_types(model)


def unsupported_linear_layers(model: Any) -> str | None:
    """Why the model's linear-attention layers cannot be run from a state here, or None.
    They must be transformers' Gated DeltaNet modules, which read a recurrent state and a
    convolution window from the cache they are given."""
    for layer in model.base_model.layers:
        mixer = getattr(layer, "linear_attn", None)
        if mixer is None:
            continue
        missing = [name for name in ("conv1d", "conv_dim", "layer_idx") if not hasattr(mixer, name)]
        if missing:
            return (
                f"its linear-attention layer {type(mixer).__name__} lacks {', '.join(missing)} "
                "(a Gated DeltaNet module is needed to run a branch from the trunk's state)"
            )
    return None


@dataclass(frozen=True)
class HybridTree:
    """What the linear-attention layers need of a packed sequence: the trunk's segments
    and the branches' batches, built once for every layer."""

    trunk_len: int
    forks: list[int]
    """Trunk lengths a branch leaves at, ascending (0: a branch that sees no trunk)."""
    batches: list[list[tuple[int, int, int]]]
    """Branches as (start, end, fork), grouped into padded batches."""


def hybrid_tree(trunk_len: int, branches: Sequence[tuple[int, int, int]]) -> HybridTree:
    """`branches` as `PackedSequence.branches()`: (start, end, visible trunk tokens)."""
    forks = sorted({visible for _, _, visible in branches})
    if forks and (forks[0] < 0 or forks[-1] > trunk_len):
        raise ValueError(f"a branch forks at {forks} outside the trunk of {trunk_len} tokens")
    batches: list[list[tuple[int, int, int]]] = []
    batch: list[tuple[int, int, int]] = []
    for branch in sorted(branches, key=lambda b: (b[1] - b[0], b[0]), reverse=True):
        longest = batch[0][1] - batch[0][0] if batch else branch[1] - branch[0]
        real = sum(end - start for start, end, _ in batch) + branch[1] - branch[0]
        if batch and longest * (len(batch) + 1) > BRANCH_PADDING * real:
            batches.append(batch)
            batch = []
        batch.append(branch)
    if batch:
        batches.append(batch)
    return HybridTree(trunk_len, forks, batches)


class _States:
    """The recurrent state and convolution window of one linear-attention call, as the
    cache interface of transformers' Gated DeltaNet modules (Qwen3.5, Qwen3-Next) reads and
    writes them: given the states at the call's start, left holding those at its end.
    `is_recording_past` is always true, so a one-token call takes the same functional path
    as a longer one, never the in-place decode update."""

    def __init__(self, conv: Tensor, recurrent: Tensor | None) -> None:
        self.conv = conv
        """[batch, conv channels, kernel - 1]: the inputs before the call, zeros at the start."""
        self.recurrent = recurrent
        """[batch, value heads, key dim, value dim], None for zeros."""

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return True

    def get_recurrent_states_to_keep(self, layer_idx: int) -> int:
        return 0

    def update_conv_state(
        self, hidden_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> Tensor:
        window = torch.cat([self.conv.to(hidden_states.dtype), hidden_states], dim=-1)
        self.conv = window[..., window.shape[-1] - self.conv.shape[-1] :]
        return window

    def update_recurrent_state(self, state: Tensor, layer_idx: int, state_idx: int = 0) -> None:
        self.recurrent = state


def _start_states(mixer: Any, batch: int, like: Tensor) -> _States:
    width = mixer.conv1d.kernel_size[0] - 1
    return _States(like.new_zeros(batch, mixer.conv_dim, width), None)


def _linear_layer(layer: Any, hidden: Tensor, tree: HybridTree) -> Tensor:
    """The decoder layer [1, L, H] -> [1, L, H] over the packed sequence: the trunk in
    segments between forks, then the branches from their forks' states."""
    mixer = layer.linear_attn
    outputs: list[Tensor] = []
    states = _start_states(mixer, 1, hidden)
    at_fork: dict[int, tuple[Tensor, Tensor | None]] = {0: (states.conv, None)}
    cuts = [fork for fork in tree.forks if 0 < fork < tree.trunk_len] + [tree.trunk_len]
    start = 0
    for cut in cuts:
        outputs.append(layer(hidden[:, start:cut], None, cache=states))
        at_fork[cut] = (states.conv, states.recurrent)
        start = cut
    branch_out: dict[int, Tensor] = {}
    for batch in tree.batches:
        # right padding: causal layers never let it reach a real token
        pieces = [hidden[0, begin:end] for begin, end, _ in batch]
        padded = torch.nn.utils.rnn.pad_sequence(pieces, batch_first=True)
        conv = torch.cat([at_fork[fork][0] for _, _, fork in batch])
        recurrent = [at_fork[fork][1] for _, _, fork in batch]
        known = next((r for r in recurrent if r is not None), None)
        stacked = None
        if known is not None:  # a branch at fork 0 starts from zeros beside the others
            stacked = torch.cat(
                [known.new_zeros(known.shape) if r is None else r for r in recurrent]
            )
        out = layer(padded, None, cache=_States(conv, stacked))
        for row, (begin, end, _) in enumerate(batch):
            branch_out[begin] = out[row, : end - begin]
    ordered = [branch_out[begin] for begin in sorted(branch_out)]
    return torch.cat([torch.cat(outputs, dim=1)[0], *ordered])[None]


def hybrid_tree_forward(
    model: Any, ids: Tensor, positions: Tensor, layout: TreeLayout, tree: HybridTree
) -> Tensor:
    """Final hidden states [L, H] of the packed ids [L] at their positions [L]: the tree
    attention (`layout`) in full-attention layers, `tree` in linear-attention ones."""
    base = model.base_model
    kinds = layer_types(model)
    hidden = base.embed_tokens(ids[None])
    position_ids = positions[None]
    position_embeddings = base.rotary_emb(hidden, position_ids)
    bias = TreeBias(layout)
    for kind, layer in zip(kinds, base.layers, strict=True):
        if kind == LINEAR_ATTENTION:
            hidden = _linear_layer(layer, hidden, tree)
        else:
            hidden = layer(
                hidden,
                position_embeddings=position_embeddings,
                attention_mask=bias,
                position_ids=position_ids,
            )
    return base.norm(hidden)[0]
