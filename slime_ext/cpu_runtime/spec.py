"""The CPU layer spec of slime's model provider (`--spec`): a test and rehearsal aid.

On CPU slime builds megatron-core's LOCAL layer (`--transformer-impl local`). Through
the spec (a setting slime offers) instead of a patch, this builds it as Transformer
Engine's layer is built, with what the local layer cannot do on slime's batches:
- the norms before attention and MLP fused into their first linear under TE's parameter
  names (`NormedColumnParallelLinear`), so slime's name-based converters read the model;
- norms under sequence parallelism (Megatron's torch norm asserts SP off; its fused
  norms, CUDA only, mark their weights so finalize_model_grads sums them over TP);
- the core attention for slime's packed (THD) micro-batches, with context parallelism:
  Megatron's local DotProductAttention refuses packed_seq_params, and its only CP
  attention is Transformer Engine's (CUDA). This one all-gathers K/V over the CP group and
  masks by each row's sequence and global position in slime's zigzag layout.

`layer_spec` is the per-turn spec (`--spec slime_ext.cpu_runtime.spec layer_spec`);
`tree_layer_spec` builds our tree attention's spec (slime_ext.slime.tree_attention
layer_spec, whose core attention takes packed trees) the same way.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch


class SequenceParallelTorchNorm:
    """megatron-core's torch norm (transformer/torch_norm.py:32 asserts SP off) built as
    without SP, its weights marked `sequence_parallel` as Megatron's fused norms mark
    theirs: each TP rank normalizes its own rows and finalize_model_grads sums the weight
    gradients over TP. A class, as build_module returns a plain function uncalled."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> Any:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = WrappedTorchNorm(plain, hidden_size, eps)
        if config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm


class PackedContextParallelAttention(torch.nn.Module):
    """Causal core attention over slime's packed micro-batch ([t, heads, dim] rows, THD),
    under context parallelism: K and V are all-gathered over the CP group (Megatron's
    sequence-parallel all-gather, whose backward reduce-scatters), a query sees the keys of
    its own sequence at global positions up to its own."""

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
    ) -> None:
        super().__init__()
        from megatron.core import parallel_state as mpu

        self.config = config
        self.cp_group = mpu.get_context_parallel_group()
        self.softmax_scale = softmax_scale or config.kv_channels**-0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise NotImplementedError("this test attention takes slime's packed THD batches")
        cp_size, cp_rank = self.cp_group.size(), self.cp_group.rank()
        cu_seqlens = packed_seq_params.cu_seqlens_q.tolist()  # global lengths (x CP)
        if cp_size > 1:
            key = gather_from_sequence_parallel_region(key, group=self.cp_group)
            value = gather_from_sequence_parallel_region(value, group=self.cp_group)
        query_seq, query_pos = zigzag_positions(cu_seqlens, cp_rank, cp_size)
        layouts = [zigzag_positions(cu_seqlens, r, cp_size) for r in range(cp_size)]
        key_seq = torch.cat([seq for seq, _ in layouts])
        key_pos = torch.cat([pos for _, pos in layouts])
        visible = (query_seq[:, None] == key_seq[None]) & (key_pos[None] <= query_pos[:, None])
        heads = query.size(1)
        if key.size(1) != heads:  # grouped-query attention
            key = key.repeat_interleave(heads // key.size(1), dim=1)
            value = value.repeat_interleave(heads // value.size(1), dim=1)
        scores = torch.einsum("qhd,khd->hqk", query.float(), key.float()) * self.softmax_scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        out = torch.einsum("hqk,khd->qhd", probs, value)
        return out.reshape(out.size(0), -1)


def zigzag_positions(
    cu_seqlens: list[int], cp_rank: int, cp_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each local row's (sequence index, global position in its sequence): rank r holds
    chunks r and 2CP-1-r of every sequence (slime's slice_with_cp)."""
    seqs, positions = [], []
    for index, (start, end) in enumerate(itertools.pairwise(cu_seqlens)):
        length = end - start
        if cp_size == 1:
            local = torch.arange(length)
        else:
            chunk = length // (2 * cp_size)
            local = torch.cat(
                [
                    torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                    torch.arange(
                        (2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk
                    ),
                ]
            )
        seqs.append(torch.full_like(local, index))
        positions.append(local)
    return torch.cat(seqs), torch.cat(positions)


class NormedColumnParallelLinear:
    """Transformer Engine's LayerNormColumnParallelLinear on the CPU: the norm, then
    megatron-core's ColumnParallelLinear, the norm's weight named `layer_norm_weight` (and
    `layer_norm_bias`) as TE names it, so slime's name-based converters (HF to Megatron,
    Megatron to HF for weight updates and checkpoints) read this model as the GPU's. A
    class whose __new__ builds the module, as build_module calls a spec's class."""

    def __new__(cls, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> Any:
        from megatron.core.tensor_parallel import ColumnParallelLinear

        class _Normed(ColumnParallelLinear):
            def forward(self, input_: torch.Tensor, *args: Any, **kw: Any) -> Any:
                return super().forward(self._norm(input_), *args, **kw)

            def _norm(self, x: torch.Tensor) -> torch.Tensor:
                eps = self.config.layernorm_epsilon
                if self.config.normalization == "RMSNorm":
                    return torch.nn.functional.rms_norm(
                        x, (x.size(-1),), self.layer_norm_weight, eps
                    )
                return torch.nn.functional.layer_norm(
                    x, (x.size(-1),), self.layer_norm_weight, self.layer_norm_bias, eps
                )

        if config.layernorm_zero_centered_gamma:
            raise NotImplementedError("the CPU spec's norm takes no zero-centered gamma")
        module = _Normed(input_size, output_size, config=config, **kwargs)
        module.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size))
        if config.normalization != "RMSNorm":
            module.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size))
        else:
            module.layer_norm_bias = None
        for param in (module.layer_norm_weight, module.layer_norm_bias):
            if param is not None and config.sequence_parallel:
                param.sequence_parallel = True  # each TP rank normalizes its own rows
        return module


def cpu_layers(layer: Any, config: Any, vp_stage: int | None = None) -> Any:
    """A block of `layer` (a local layer spec) as Transformer Engine's layer is built: the
    norms before attention and MLP fused into their first linear (NormedColumnParallelLinear),
    the q / k norms and the final norm as SequenceParallelTorchNorm."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = copy.deepcopy(layer)
    attention = layer.submodules.self_attention.submodules
    if _is_norm(layer.submodules.input_layernorm):
        layer.submodules.input_layernorm = IdentityOp
        attention.linear_qkv = NormedColumnParallelLinear
    if _is_norm(layer.submodules.pre_mlp_layernorm):
        layer.submodules.pre_mlp_layernorm = IdentityOp
        layer.submodules.mlp.submodules.linear_fc1 = NormedColumnParallelLinear
    for name in ("q_layernorm", "k_layernorm"):
        if _is_norm(getattr(attention, name, None)):
            setattr(attention, name, SequenceParallelTorchNorm)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules([layer] * count, layer_norm=SequenceParallelTorchNorm)


def _is_norm(module: Any) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    return module is not None and module is not IdentityOp


def layer_spec(args: Any, config: Any, vp_stage: int | None = None) -> Any:
    """slime's default local layer with the packed / CP core attention, built as TE's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if args.num_experts:
        raise NotImplementedError("the CPU spec builds dense layers only")
    layer = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm)
    layer.submodules.self_attention.submodules.core_attention = PackedContextParallelAttention
    return cpu_layers(layer, config, vp_stage)


def tree_layer_spec(args: Any, config: Any, vp_stage: int | None = None) -> Any:
    """Our tree attention's spec (tree-packed samples), built as TE's."""
    from slime_ext.slime.tree_attention import layer_spec as tree_spec

    return cpu_layers(tree_spec(args, config, vp_stage), config, vp_stage)
