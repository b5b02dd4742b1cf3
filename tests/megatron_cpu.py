"""Test-only: megatron-core (0.16.1) training on a CPU over gloo, inside a test process.

The CUDA sites and their CPU redirects, and the CPU layer spec's pieces, are
slime_ext.cpu_runtime's (the CPU runtime a whole job installs in each of slime's
processes); here `cpu_redirects()` applies the megatron-core sites for the duration of a
test and undoes them on exit, and `gpt_block_spec` builds the test model's block from the
same norm and packed / CP core attention.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from slime_ext.cpu_runtime import redirects
from slime_ext.cpu_runtime.spec import (
    PackedContextParallelAttention,
    SequenceParallelTorchNorm,
    zigzag_positions,
)

__all__ = [
    "PackedContextParallelAttention",
    "SequenceParallelTorchNorm",
    "cpu_redirects",
    "gpt_block_spec",
    "zigzag_positions",
]


@contextmanager
def cpu_redirects() -> Iterator[None]:
    """megatron-core's CUDA placements on the CPU (redirects.MEGATRON_CORE_SITES), undone
    on exit. The RNG tracker is megatron-core's own inference tracker (forks are no-ops):
    model_parallel_cuda_manual_seed seeds torch.cuda (tensor_parallel/random.py); the tests
    load their weights."""
    from megatron.core.tensor_parallel import random as tp_random

    with pytest.MonkeyPatch.context() as patch:
        for name in redirects.MEGATRON_CORE_SITES:
            patch.setattr(importlib.import_module(name), "torch", redirects.TORCH_ON_CPU)
        patch.setattr(torch.Tensor, "type", redirects.type_names_cuda(torch.Tensor.type))
        try:  # slime's hybrid layers' gating norm (flash-linear-attention's Triton kernel)
            from fla.modules.norm import fused_norm_gate
        except ImportError:
            pass
        else:
            patch.setattr(fused_norm_gate.FusedRMSNormGated, "forward", None)  # undone on exit
            redirects.gated_norm_in_torch(fused_norm_gate)
        tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        try:
            yield
        finally:
            tp_random.initialize_rng_tracker(force_reset=True)


def gpt_block_spec(num_layers: int, *, packed: bool) -> Any:
    """get_gpt_layer_local_spec's layer, `num_layers` times; with `packed`, its core
    attention is PackedContextParallelAttention and its norms (and the final norm) are
    SequenceParallelTorchNorm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = copy.deepcopy(get_gpt_layer_local_spec())
    if not packed:
        return TransformerBlockSubmodules([layer] * num_layers, layer_norm=WrappedTorchNorm)
    layer.submodules.self_attention.submodules.core_attention = PackedContextParallelAttention
    layer.submodules.input_layernorm = SequenceParallelTorchNorm
    layer.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    return TransformerBlockSubmodules([layer] * num_layers, layer_norm=SequenceParallelTorchNorm)
