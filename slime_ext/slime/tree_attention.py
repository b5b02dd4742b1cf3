"""Megatron core attention for tree-packed samples (`samples.packed_sample`), plugged in
through megatron-core's layer spec (`layer_spec`, slime's `--spec`), not by patching.

A packed sample is a trajectory's trunk, then a branch per turn; a branch token sees its
context's part of the trunk and its own branch before it (`slime_ext.turns.may_attend`),
at explicit positions (a branch continues its context's positions). Megatron's attention
is causal per sequence and derives RoPE positions from offsets, so this module does both:

- RoPE at each token's explicit position, with Megatron's own RotaryEmbedding and
  apply_rotary_pos_emb, on the queries and keys the layer hands it (after the QK norm, as
  Megatron's SelfAttention would); `layer_spec` has the model built with position
  embedding `none`, so that nothing rotates them before;
- the tree rule as the mask, per sequence of slime's THD micro-batch; a sample without a
  tree (or the batch's padding) is causal, so per-turn samples run here unchanged.

Context parallelism: K and V are all-gathered over the CP group (Megatron's
sequence-parallel all-gather, whose backward reduce-scatters); every query row knows its
sequence and global index from slime's zigzag split (chunks r and 2CP-1-r of each
sequence), so a branch reads its trunk prefix wherever it lives. Memory for K/V grows to
the whole micro-batch per rank; compute stays split.

Two kernels: `dense` (scores materialized, [local rows, all rows] per head: exact, the CPU
path and small sequences), `flex` (torch's FlexAttention with a block mask from the same
rule: blocks nobody may read are skipped; compiled on CUDA, forward only on the CPU).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor

from slime_ext.slime.settings import HookConfigError
from slime_ext.turns import may_attend

TREE_ATTRIBUTE = "opd_tree"
"""packed_seq_params.opd_tree: the micro-batch's trees, one int32 [3, L] per sample
(positions, branch, visible trunk), set by `slime_ext.slime.tree`'s get_batch wrapper."""

Kernel = Literal["dense", "flex"]


@dataclass(frozen=True)
class Rope:
    """What GPTModel would build its RotaryEmbedding from (slime's arguments)."""

    rotary_percent: float = 1.0
    rotary_base: int = 10000
    seq_len_interpolation_factor: float | None = None


class TreeCoreAttention(torch.nn.Module):
    """Core attention over slime's packed (THD) micro-batch with tree-packed samples."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        rope: Rope | None = None,
        kernel: Kernel = "dense",
    ) -> None:
        super().__init__()
        from megatron.core import parallel_state as mpu
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        if attention_type != "self":
            raise HookConfigError("the tree attention is self-attention only")
        if (attention_dropout or config.attention_dropout) > 0:
            raise HookConfigError("the tree attention takes no attention dropout")
        self.config = config
        self.kernel = kernel
        self.cp_group = mpu.get_context_parallel_group()
        self.softmax_scale = softmax_scale or config.kv_channels**-0.5
        rope = rope or Rope()
        self.rotary = RotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=rope.rotary_percent,
            rotary_interleaved=config.rotary_interleaved,
            seq_len_interpolation_factor=rope.seq_len_interpolation_factor,
            rotary_base=rope.rotary_base,
            use_cpu_initialization=config.use_cpu_initialization,
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise HookConfigError(
                "the tree attention takes slime's packed (THD) micro-batches (--qkv-format thd)"
            )
        batch = _micro_batch(packed_seq_params, self.cp_group, self.kernel, query.device)
        freqs = self.rotary.get_emb(int(batch.table.position.max()) + 1)
        at = freqs[batch.positions.to(freqs.device)]
        query = apply_rotary_pos_emb(query[:, None], at, self.config)[:, 0]
        key = apply_rotary_pos_emb(key[:, None], at, self.config)[:, 0]
        if self.cp_group.size() > 1:
            key = gather_from_sequence_parallel_region(key, group=self.cp_group)
            value = gather_from_sequence_parallel_region(value, group=self.cp_group)
        if self.kernel == "flex":
            out = _flex(query, key, value, batch.mask, self.softmax_scale)
        else:
            out = _dense(query, key, value, batch.mask, self.softmax_scale)
        return out.reshape(out.size(0), -1)


_MICRO_BATCH_ATTRIBUTE = "_opd_tree_micro_batch"


@dataclass(frozen=True)
class _MicroBatch:
    """What every layer's attention reads of one micro-batch: made by the first layer and
    kept on its packed_seq_params (the object Megatron hands every layer, recomputation
    included), so the table and the mask are built once per micro-batch, not per layer."""

    table: TreeTable
    positions: Tensor
    """The explicit positions of this rank's rows."""
    mask: Any
    """dense: [this rank's rows, all rows] bool; flex: the BlockMask."""


def _micro_batch(packed_seq_params: Any, cp_group: Any, kernel: Kernel, device: Any) -> _MicroBatch:
    made = getattr(packed_seq_params, _MICRO_BATCH_ATTRIBUTE, None)
    if made is not None:
        return cast(_MicroBatch, made)
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cu_seqlens = [int(x) for x in packed_seq_params.cu_seqlens_q.tolist()]
    table = TreeTable.of(cu_seqlens, getattr(packed_seq_params, TREE_ATTRIBUTE, None))
    ranks = [table.rank_rows(r, cp_size) for r in range(cp_size)]
    positions = table.position[ranks[cp_rank]]
    table = table.to(device)
    mine, everyone = ranks[cp_rank].to(device), torch.cat(ranks).to(device)
    if kernel == "flex":
        mask = _block_mask(table, mine, everyone)
    else:
        mask = table.may_attend(mine[:, None], everyone[None])
    made = _MicroBatch(table, positions, mask)
    setattr(packed_seq_params, _MICRO_BATCH_ATTRIBUTE, made)
    return made


@dataclass(frozen=True)
class TreeTable:
    """Every row of a micro-batch before the CP split (sequences one after another, each at
    its padded length), by global row id: its sequence, position, branch and the end of the
    trunk it may see (as a global row id). A sample's tree gives its rows' values; a sample
    without one, and padding, are plain causal sequences."""

    sequence: Tensor
    position: Tensor
    branch: Tensor
    visible_end: Tensor
    starts: list[int]

    @staticmethod
    def of(cu_seqlens: Sequence[int], trees: Sequence[Tensor] | None) -> TreeTable:
        sequence, position, branch, visible_end = [], [], [], []
        for s, (start, end) in enumerate(itertools.pairwise(cu_seqlens)):
            index = torch.arange(end - start)
            pos, br, vis = index.clone(), torch.full_like(index, -1), index + 1
            tree = trees[s] if trees is not None and s < len(trees) else None
            if tree is not None:
                real = min(int(tree.shape[1]), end - start)
                pos[:real], br[:real], vis[:real] = tree[:, :real].to(torch.long)
            sequence.append(torch.full_like(index, s))
            position.append(pos)
            branch.append(br)
            visible_end.append(vis + start)
        if not sequence:
            raise HookConfigError("an empty micro-batch")
        return TreeTable(
            torch.cat(sequence),
            torch.cat(position),
            torch.cat(branch),
            torch.cat(visible_end),
            list(cu_seqlens),
        )

    def rank_rows(self, cp_rank: int, cp_size: int) -> Tensor:
        """The global row ids rank `cp_rank` holds, in its THD order."""
        return torch.cat(
            [
                start + zigzag_indices(end - start, cp_rank, cp_size)
                for start, end in itertools.pairwise(self.starts)
            ]
        )

    def to(self, device: Any) -> TreeTable:
        return TreeTable(
            self.sequence.to(device),
            self.position.to(device),
            self.branch.to(device),
            self.visible_end.to(device),
            self.starts,
        )

    def may_attend(self, query: Tensor, key: Tensor) -> Tensor:
        """`slime_ext.turns.may_attend` on global row ids, within each sequence."""
        same = self.sequence[query] == self.sequence[key]
        return same & may_attend(query, key, self.branch, self.visible_end)


def zigzag_indices(length: int, cp_rank: int, cp_size: int) -> Tensor:
    """The indices rank r holds of a sequence slime split for CP: chunks r and 2CP-1-r of
    2CP (slime's slice_with_cp; `length` is already padded to 2CP chunks)."""
    if cp_size == 1:
        return torch.arange(length)
    if length % (2 * cp_size):
        # only the micro-batch's padding is not cut in 2CP chunks (slime pads each sample):
        # any share of its rows will do, each sees its own
        if length % cp_size:
            raise HookConfigError(f"a CP-split sequence of {length} rows is not CP shares")
        share = length // cp_size
        return torch.arange(cp_rank * share, (cp_rank + 1) * share)
    chunk = length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


def _dense(query: Tensor, key: Tensor, value: Tensor, visible: Tensor, scale: float) -> Tensor:
    heads = query.size(1)
    if key.size(1) != heads:  # grouped-query attention
        key = key.repeat_interleave(heads // key.size(1), dim=1)
        value = value.repeat_interleave(heads // value.size(1), dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), key.float()) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.einsum("hqk,khd->qhd", probs, value)


def _block_mask(table: TreeTable, mine: Tensor, everyone: Tensor) -> Any:
    """The table's rule between this rank's rows (queries) and all rows (keys) as a
    FlexAttention BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(batch: Tensor, head: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return table.may_attend(mine[q], everyone[k])

    return create_block_mask(
        mask_mod, None, None, mine.numel(), everyone.numel(), device=mine.device
    )


def _flex(query: Tensor, key: Tensor, value: Tensor, mask: Any, scale: float) -> Tensor:
    out = _flex_kernel(query.is_cuda)(
        query.transpose(0, 1)[None],
        key.transpose(0, 1)[None],
        value.transpose(0, 1)[None],
        block_mask=mask,
        scale=scale,
        enable_gqa=key.size(1) != query.size(1),
    )
    return out[0].transpose(0, 1)


@functools.cache
def _flex_kernel(compiled: bool) -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    return cast(Callable[..., Any], torch.compile(flex_attention) if compiled else flex_attention)


# --- the layer spec ------------------------------------------------------------------------


def with_tree_attention(spec: Any, rope: Rope, kernel: Kernel = "dense") -> Any:
    """A copy of a GPT block or layer spec whose every layer's core attention is
    TreeCoreAttention (the rest, norms and projections, as given)."""
    import copy

    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(spec)
    layers = getattr(spec, "layer_specs", None) or [spec]
    core = ModuleSpec(module=TreeCoreAttention, params={"rope": rope, "kernel": kernel})
    for layer in layers:
        attention = layer.submodules.self_attention
        if not hasattr(attention.submodules, "core_attention"):
            raise HookConfigError(f"a layer without a core attention: {attention}")
        attention.submodules.core_attention = core
    return spec


def layer_spec(args: Any, config: Any, vp_stage: int | None = None) -> Any:
    """slime's `--spec slime_ext.slime.tree_attention layer_spec`: the spec slime builds by
    default (Transformer Engine's or the local one, MoE blocks included) with the tree
    attention as every layer's core attention, and for a hybrid student (its
    --hf-checkpoint's config has linear-attention layers) slime's Gated DeltaNet layers
    taking the tree in those (slime_ext.slime.hybrid_attention); RoPE moved into the
    attention: slime's provider builds
    GPTModel from `args` after calling this, so a `rope` position embedding becomes `none`
    here (slime's model scripts pass the legacy --use-rotary-position-embeddings, which
    sets rope again whatever `opd launch` passed)."""
    _require_provider_reads_args_after_the_spec()
    if args.position_embedding_type not in ("rope", "none"):
        raise HookConfigError(
            "tree-packed samples: the tree attention applies plain RoPE; this model's "
            f"position embedding is {args.position_embedding_type!r}: use "
            "algorithm.sequence_layout: per_turn"
        )
    if getattr(args, "use_rope_scaling", False) or getattr(args, "multi_latent_attention", False):
        raise HookConfigError(
            "tree-packed samples support plain RoPE only (no rope scaling, no multi-latent "
            "attention): use algorithm.sequence_layout: per_turn"
        )
    if getattr(args, "allgather_cp", False):
        raise HookConfigError("tree-packed samples do not take --allgather-cp")
    args.position_embedding_type = "none"  # the tree attention rotates q and k itself
    from megatron.core.models.gpt import gpt_layer_specs as specs

    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        kwargs: dict[str, Any] = {"use_transformer_engine": use_te}
        if vp_stage is not None:
            kwargs["vp_stage"] = vp_stage
        base = specs.get_gpt_decoder_block_spec(config, **kwargs)
    else:
        build = (
            specs.get_gpt_layer_with_transformer_engine_spec
            if use_te
            else (specs.get_gpt_layer_local_spec)
        )
        base = build(
            num_experts=args.num_experts,
            moe_grouped_gemm=args.moe_grouped_gemm,
            qk_layernorm=args.qk_layernorm,
            multi_latent_attention=False,
            moe_use_legacy_grouped_gemm=args.moe_use_legacy_grouped_gemm,
        )
    rope = Rope(
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        seq_len_interpolation_factor=getattr(args, "rotary_seq_len_interpolation_factor", None),
    )
    kernel: Kernel = "flex" if torch.cuda.is_available() else "dense"
    spec = with_tree_attention(base, rope, kernel)
    from slime_ext.slime import hybrid_attention

    student = getattr(args, "hf_checkpoint", None)
    if student and hybrid_attention.is_hybrid_checkpoint(student):
        return hybrid_attention.hybrid_spec(spec, args, config, vp_stage)
    return spec


def _require_provider_reads_args_after_the_spec() -> None:
    """A slime whose provider read the position embedding before the spec would rotate q
    and k twice (a silently wrong model): refuse it, naming the pinned commit."""
    import inspect

    from slime.backends.megatron_utils import model_provider

    source = inspect.getsource(model_provider._get_model_provider_func)
    spec_call = source.find("transformer_layer_spec(args, config, vp_stage)")
    reads = source.find('"position_embedding_type": args.position_embedding_type')
    if spec_call < 0 or reads < spec_call:
        raise HookConfigError(
            "tree-packed samples: slime's model provider no longer builds GPTModel's position "
            "embedding from args after calling --spec (slime/backends/megatron_utils/"
            "model_provider.py), which the tree attention relies on to take RoPE over; use "
            "the slime commit tests/slime_cpu.py pins (SLIME_COMMIT) or "
            "algorithm.sequence_layout: per_turn"
        )
