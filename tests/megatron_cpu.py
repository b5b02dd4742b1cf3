"""Test-only: what lets megatron-core (0.16.1) train on a CPU over gloo.

Megatron-core hard-codes CUDA in a few places (REFERENCE.md, "Megatron-core and slime on
CPU"). `cpu_redirects()` points each of them at the CPU for the duration of a test and
undoes it on exit; nothing happens at import. Each redirect names its megatron-core site.

Two pieces go through megatron-core's layer spec instead of a patch (`gpt_block_spec`):
- a torch norm under sequence parallelism (Megatron's torch norm asserts SP off; its fused
  norms, CUDA only, mark their weights so finalize_model_grads sums them over TP);
- a core attention for slime's packed (THD) micro-batches, with context parallelism:
  Megatron's local DotProductAttention refuses packed_seq_params, and its only CP
  attention is Transformer Engine's (CUDA). This one all-gathers K/V over the CP group and
  masks by each row's sequence and global position in slime's zigzag layout.
"""

from __future__ import annotations

import copy
import importlib
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import pytest
import torch

CPU = torch.device("cpu")

CUDA_DEVICE_SITES = {
    "megatron.core.utils": "the global memory buffer (utils.py:628-631) and the grad norm "
    'of local_multi_tensor_l2_norm (utils.py:1207) on device="cuda"',
    "megatron.core.tensor_parallel.mappings": "all-gather / reduce-scatter outputs on "
    "torch.cuda.current_device() (mappings.py:141,181): SP and the CP attention's K/V",
    "megatron.core.tensor_parallel.layers": "the SP linear backward's all-gathered input "
    "(layers.py:551-552)",
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RotaryEmbedding.get_emb "
    "moves inv_freq to torch.cuda.current_device() (rotary_pos_embedding.py:162)",
    "megatron.core.pipeline_parallel.schedules": "forward_backward_no_pipelining's "
    'total_num_tokens on device="cuda" (schedules.py:596)',
    "megatron.core.optimizer.optimizer": "_dummy_overflow_buf, _scale_one and the constant "
    "grad scale on device='cuda' (optimizer.py:481,485,907)",
    "megatron.core.optimizer.clip_grads": "get_grad_norm_fp32's overflow buffer on "
    "device='cuda' (clip_grads.py:103)",
    "megatron.core.distributed.param_and_grad_buffer": "param and grad buffers on "
    "torch.cuda.current_device() (param_and_grad_buffer.py:797-806)",
}
"""Modules whose own `torch` name is redirected (device 'cuda' -> CPU), and why."""

_FACTORIES = ("tensor", "zeros", "empty")
"""The allocations those sites make."""


def _cpu_device(device: Any) -> Any:
    """A CUDA placement (a 'cuda' string, an index, a cuda device) becomes the CPU."""
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return CPU
    return device


class _CudaOnCpu(ModuleType):
    """`torch.cuda` as a redirected module sees it: its current device is the CPU."""

    def __init__(self) -> None:
        super().__init__("torch.cuda (CPU redirect)")

    def current_device(self) -> torch.device:
        return CPU

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu(ModuleType):
    """`torch` as a redirected module sees it: its CUDA allocations land on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch (CPU redirect)")
        self.cuda = _CudaOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _on_cpu(factory: Any) -> Any:
    def allocate(*args: Any, device: Any = None, **kwargs: Any) -> Any:
        return factory(*args, device=_cpu_device(device), **kwargs)

    return allocate


def _type_names_cuda(original: Any) -> Any:
    """Tensor.type() naming a CPU tensor as its CUDA twin ('torch.cuda.FloatTensor'): the
    distributed optimizer accepts only CUDA type names (distrib_optimizer.py:361,420,582)."""

    def tensor_type(self: torch.Tensor, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
        result = original(self, dtype, *args, **kwargs)
        if dtype is None and self.device.type == "cpu" and isinstance(result, str):
            return result.replace("torch.", "torch.cuda.", 1)
        return result

    return tensor_type


@contextmanager
def cpu_redirects() -> Iterator[None]:
    """megatron-core's CUDA placements on the CPU, undone on exit. The RNG tracker is
    megatron-core's own inference tracker (forks are no-ops): model_parallel_cuda_manual_seed
    seeds torch.cuda (tensor_parallel/random.py); the tests load their weights."""
    from megatron.core.tensor_parallel import random as tp_random

    with pytest.MonkeyPatch.context() as patch:
        torch_on_cpu = _TorchOnCpu()
        for name in CUDA_DEVICE_SITES:
            patch.setattr(importlib.import_module(name), "torch", torch_on_cpu)
        patch.setattr(torch.Tensor, "type", _type_names_cuda(torch.Tensor.type))
        tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        try:
            yield
        finally:
            tp_random.initialize_rng_tracker(force_reset=True)


# --- layer spec: the norm under sequence parallelism, the packed / CP core attention -------


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
