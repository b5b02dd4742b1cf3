"""slime's hybrid layers (slime_plugins.models.qwen3_5 / qwen3_next: Gated DeltaNet behind
slime's HuggingfaceAttention) taking tree-packed samples: each branch runs from the
trunk's recurrent state and convolution window where it forks (slime_ext.gated_delta).

`tree_layer(family)` is slime's linear-attention layer (`Attention` of that module) with
the two mixing steps of its Gated DeltaNet replaced on the instance: the short
convolution (`conv1d`, a module keeping slime's weight under its name) and the chunked
gated delta rule (`chunk_gated_delta_rule`), both handed the micro-batch's DeltaPlan where
slime hands them cu_seqlens. Everything else is slime's: projections, gating norm, output
projection, the parameter names checkpoints use, and the context-parallel all-gather
(HuggingfaceAttention.forward), after which the layer sees whole sequences, so CP needs
nothing more here. Before wrapping, the module's source is checked to still pass
cu_seqlens to those two calls only (`require_source`), so slime's drift fails loudly.

The full-attention layers keep the tree attention (slime_ext.slime.tree_attention, whose
`layer_spec` builds a hybrid's spec through `hybrid_spec` here).
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from functools import cache
from typing import Any

import torch
from torch import Tensor

from slime_ext.gated_delta import DeltaPlan, gated_delta_kernel, gated_delta_rule, short_convolution
from slime_ext.slime.settings import HookConfigError
from slime_ext.slime.tree_attention import TREE_ATTRIBUTE

FAMILIES = {
    "qwen3_5": "slime_plugins.models.qwen3_5",
    "qwen3_next": "slime_plugins.models.qwen3_next",
}
"""HF model_type prefix -> slime's module of its hybrid layers."""
LINEAR_ATTENTION = "linear_attention"
_PLAN_ATTRIBUTE = "_opd_delta_plan"


def hf_text_config(checkpoint: str) -> dict[str, Any]:
    """The student's config.json (its text_config for a VLM), as a dict."""
    path = os.path.join(checkpoint, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise HookConfigError(f"{path}: cannot read the student's config ({err})") from err
    text = config.get("text_config") or {}
    return {**config, **text}


def layer_types(config: dict[str, Any]) -> list[str]:
    """Each layer's kind, as slime's get_qwen3_5_spec reads them (layer_types, else every
    full_attention_interval-th layer full attention)."""
    if config.get("layer_types"):
        return [str(kind) for kind in config["layer_types"]]
    interval = int(config.get("full_attention_interval", 4))
    count = int(config["num_hidden_layers"])
    return ["full_attention" if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(count)]


def is_hybrid_checkpoint(checkpoint: str) -> bool:
    """Whether the student's config.json shows linear-attention layers (False when absent:
    its layers are then what slime's model arguments say)."""
    if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        return False
    config = hf_text_config(checkpoint)
    if not config.get("layer_types") and "full_attention_interval" not in config:
        return False
    return LINEAR_ATTENTION in layer_types(config)


def family_of(config: dict[str, Any]) -> str:
    model_type = str(config.get("model_type", ""))
    for prefix in FAMILIES:
        if model_type.startswith(prefix):
            return prefix
    raise HookConfigError(
        f"tree-packed samples: a hybrid student of model_type {model_type!r}; slime's layers "
        f"for {', '.join(FAMILIES)} take them: use algorithm.sequence_layout: per_turn"
    )


def delta_plan(packed_seq_params: Any) -> DeltaPlan:
    """The micro-batch's plan, made by the first linear-attention layer and kept on its
    packed_seq_params (the object Megatron hands every layer, recomputation included)."""
    made = getattr(packed_seq_params, _PLAN_ATTRIBUTE, None)
    if made is not None:
        return made
    cu_seqlens = [int(x) for x in packed_seq_params.cu_seqlens_q.tolist()]
    branch = [-1] * cu_seqlens[-1]
    visible = [0] * cu_seqlens[-1]
    trees = getattr(packed_seq_params, TREE_ATTRIBUTE, None) or []
    for start, end, tree in zip(cu_seqlens, cu_seqlens[1:], trees, strict=False):
        if tree is None:
            continue
        real = min(int(tree.shape[1]), end - start)
        branch[start : start + real] = [int(x) for x in tree[1, :real].tolist()]
        visible[start : start + real] = [int(x) for x in tree[2, :real].tolist()]
    plan = DeltaPlan.of(cu_seqlens, branch, visible)
    setattr(packed_seq_params, _PLAN_ATTRIBUTE, plan)
    return plan


class TreeShortConvolution(torch.nn.Module):
    """The Gated DeltaNet's short convolution over a DeltaPlan, holding the layer's own
    weight ([D, 1, W], under the name `weight` as flash-linear-attention's ShortConvolution)."""

    def __init__(self, original: Any) -> None:
        super().__init__()
        self.weight = original.weight
        self.activation = getattr(original, "activation", None)

    def forward(
        self, x: Tensor, cu_seqlens: Any = None, **kwargs: Any
    ) -> tuple[Tensor, Tensor | None]:
        return short_convolution(x, self.weight, self.activation, _plan_of(cu_seqlens)), None


def tree_chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The layer's chunk_gated_delta_rule call, over a DeltaPlan (slime passes no state)."""
    if initial_state is not None or output_final_state:
        raise HookConfigError("the tree's gated delta rule takes its states from the plan")
    kernel = gated_delta_kernel(q.device)
    plan = _plan_of(cu_seqlens)
    return gated_delta_rule(q, k, v, g, beta, plan, kernel, use_qk_l2norm_in_kernel), None


def _plan_of(cu_seqlens: Any) -> DeltaPlan:
    if not isinstance(cu_seqlens, DeltaPlan):
        raise HookConfigError(
            "the tree's Gated DeltaNet mixing was called without its plan (slime's "
            f"linear-attention layer passed {type(cu_seqlens).__name__})"
        )
    return cu_seqlens


@cache
def tree_layer(family: str) -> type:
    """slime's linear-attention layer of `family` taking tree-packed micro-batches."""
    import importlib

    module = importlib.import_module(FAMILIES[family])
    base = module.Attention
    _require_mixing_calls(module)

    class TreeGatedDeltaAttention(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            mixer = self.linear_attn
            mixer.conv1d = TreeShortConvolution(mixer.conv1d)
            mixer.chunk_gated_delta_rule = tree_chunk_gated_delta_rule

        def hf_forward(self, hidden_states: Tensor, packed_seq_params: Any) -> Tensor:
            from megatron.core import parallel_state as mpu

            plan = delta_plan(packed_seq_params)
            cp_group = mpu.get_context_parallel_group()
            cp = cp_group.size()
            if cp > 1:
                hidden_states = _ScaledGradient.apply(hidden_states, float(cp))
            hidden_states = self.input_layernorm(hidden_states)
            out = self.linear_attn(hidden_states=hidden_states, cu_seqlens=plan)
            if cp > 1:
                out = _GradientSummedOverRanks.apply(out, cp_group, 1.0 / cp)
            return out

    TreeGatedDeltaAttention.__name__ = TreeGatedDeltaAttention.__qualname__ = (
        f"TreeGatedDeltaAttention[{family}]"
    )
    return TreeGatedDeltaAttention


class _ScaledGradient(torch.autograd.Function):
    """Identity; the gradient times `scale`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


class _GradientSummedOverRanks(torch.autograd.Function):
    """Identity; the gradient summed over `group`, times `scale`.

    Why, with context parallelism: slime's HuggingfaceAttention all-gathers the sequence,
    every CP rank runs the layer on all of it and keeps its own chunks of the output, and
    the gather's backward hands each rank the gradient of its own input slice from its own
    output chunks only (_AllGatherForDuplicatedComputation). A recurrent layer's later
    outputs depend on earlier inputs held by other ranks, so those terms are lost
    (measured: per-turn samples at CP2 train other parameters than at TP2). Summing the
    output's gradient over the CP ranks makes the layer's backward the same on every rank
    and complete; scaled by 1/CP here (and its input's gradient by CP, `_ScaledGradient`),
    parameter gradients summed over CP by Megatron stay the total, and the slice the
    gather hands back is complete."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, scale: float) -> Tensor:
        ctx.group, ctx.scale = group, scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        total = grad.contiguous().clone()
        torch.distributed.all_reduce(total, group=ctx.group)
        return total * ctx.scale, None, None


def _require_mixing_calls(module: Any) -> None:
    """slime's Gated DeltaNet passes cu_seqlens to its conv1d and chunk_gated_delta_rule
    only, and hf_forward is input_layernorm then linear_attn(..., cu_seqlens=...): what the
    wrapper replaces. Anything else: refuse, naming the file."""
    mixer: Any = next(
        value
        for name, value in vars(module).items()
        if name.endswith("GatedDeltaNet") and isinstance(value, type)
    )
    forward = inspect.getsource(mixer.forward)
    hf_forward = inspect.getsource(module.Attention.hf_forward)
    uses = forward.count("cu_seqlens")
    expected = (
        "self.conv1d(" in forward
        and "self.chunk_gated_delta_rule(" in forward
        and forward.count("cu_seqlens=cu_seqlens") == 2
        and uses == 5  # the argument, then twice in each of the two calls
        and "self.input_layernorm(hidden_states)" in hf_forward
        and "cu_seqlens=packed_seq_params.cu_seqlens_q" in hf_forward
    )
    if not expected:
        raise HookConfigError(
            f"tree-packed samples: slime's {module.__name__} no longer mixes as the tree "
            "wrapper expects (cu_seqlens passed to conv1d and chunk_gated_delta_rule only; "
            "hf_forward = input_layernorm, then linear_attn); use the slime commit "
            "tests/slime_cpu.py pins (SLIME_COMMIT) or algorithm.sequence_layout: per_turn"
        )


def hybrid_spec(spec: Any, args: Any, config: Any, vp_stage: int | None) -> Any:
    """`spec` (the tree attention's block spec) with the linear-attention layers of this
    pipeline stage replaced by slime's, taking the tree (as get_qwen3_5_spec replaces
    them with slime's own)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        _get_block_submodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    hf = hf_text_config(args.hf_checkpoint)
    kinds = layer_types(hf)
    layer = tree_layer(family_of(hf))
    # a layer's spec becomes megatron's own block of it (its final norm included)
    spec = copy.deepcopy(_get_block_submodules(config, spec, vp_stage))
    specs = spec.layer_specs
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    for index in range(count):
        if kinds[index + offset] == LINEAR_ATTENTION:
            specs[index] = copy.deepcopy(specs[index])
            specs[index].submodules.self_attention = ModuleSpec(module=layer, params={"args": args})
    return spec
