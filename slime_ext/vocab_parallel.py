"""Vocabulary-sharded, token-chunked primitives under every full-distribution loss.

A rank's logits hold rows [start, start + V_local) of the vocabulary (Megatron's tensor
parallel layout; rows at or past the tokenizer's size are padding and are masked out).
With `VocabShard()` (no group) the same code is the ordinary unsharded computation, so
the local trainer and slime's Megatron loss run one code path (DESIGN.md invariant 6).

Masked rows: a kernel passes every per-token input through `keep_valid_rows` before any
math, so a row whose mask is 0 may hold anything (NaN, inf) and still gives 0 with 0
gradient; inside a chunked kernel this happens per chunk, so the chunked and fused paths
are covered by the same line.

Memory: `apply_chunked` evaluates a per-token kernel over token chunks and recomputes
each chunk in backward, so a loss never keeps more than one chunk's [chunk x V_local] fp32
intermediates alive; the fused path (`fused_lm_head`) also computes the logits per
chunk from hidden states and the LM-head weight, so [tokens x vocab] never exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

PAD_LOGIT = -1e30
"""Stands in for padding rows: finite (so 0 * (s - t) stays 0), never sampled or selected."""

PerTokenKernel = Callable[..., Tensor]


@dataclass(frozen=True)
class VocabShard:
    """Which vocabulary rows this rank's logits hold, and the group that holds the rest."""

    group: Any = None
    """A torch.distributed process group over the tensor-parallel ranks; None: unsharded."""
    start: int = 0
    """Global id of this rank's first row."""
    real_vocab_size: int | None = None
    """Ids at or past this are padding rows (Megatron pads the vocabulary); None: no padding."""

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @classmethod
    def for_rank(
        cls, group: Any, padded_vocab_size: int, real_vocab_size: int | None = None
    ) -> VocabShard:
        """The even split Megatron uses: rank r holds rows [r * V/TP, (r + 1) * V/TP)."""
        world = dist.get_world_size(group)
        if padded_vocab_size % world:
            raise ValueError(f"vocab size {padded_vocab_size} is not divisible by TP {world}")
        rank = dist.get_rank(group)
        return cls(group, rank * (padded_vocab_size // world), real_vocab_size)


class _SumAcrossShards(torch.autograd.Function):
    """All-reduce SUM forward; identity backward (every rank computes the same loss)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _SumAcrossShardsForLocalUse(torch.autograd.Function):
    """All-reduce SUM forward and backward: for a sum that each rank then combines with
    its own rows (the normalizer of a sharded softmax), so every rank's graph holds only
    part of the sum's consumers and the true gradient is the sum of the parts."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def sum_across_shards(tensor: Tensor, shard: VocabShard) -> Tensor:
    """Sum over the group of a value that every rank then uses identically."""
    if shard.world_size == 1:
        return tensor
    return _SumAcrossShards.apply(tensor, shard.group)


def _sum_for_local_use(tensor: Tensor, shard: VocabShard) -> Tensor:
    if shard.world_size == 1:
        return tensor
    return _SumAcrossShardsForLocalUse.apply(tensor, shard.group)


def max_across_shards(tensor: Tensor, shard: VocabShard) -> Tensor:
    """Element-wise max over the group, without gradient (a shift that cancels)."""
    tensor = tensor.detach().clone()
    if shard.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=shard.group)
    return tensor


def keep_valid_rows(values: Tensor, valid: Tensor, fill: float = 0.0) -> Tensor:
    """values on rows where valid ([N]) is set, `fill` on the others, before any math reads
    them. Masking after the math is not enough: backward multiplies a masked row's zero
    gradient by the local derivative there, and 0 * inf or 0 * NaN is NaN."""
    rows = valid.reshape(valid.shape + (1,) * (values.dim() - valid.dim()))
    return torch.where(rows, values, torch.full((), fill, dtype=values.dtype, device=values.device))


def scaled_logits(logits: Tensor, shard: VocabShard, temperature: float) -> Tensor:
    """fp32 logits / temperature with padding rows pushed to PAD_LOGIT."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits.float() / temperature
    if shard.real_vocab_size is not None:
        global_ids = torch.arange(scaled.shape[-1], device=scaled.device) + shard.start
        scaled = scaled.masked_fill(global_ids >= shard.real_vocab_size, PAD_LOGIT)
    return scaled


def log_softmax(logits: Tensor, shard: VocabShard, temperature: float = 1.0) -> Tensor:
    """Local rows of the global log-softmax of logits / temperature, in fp32."""
    scaled = scaled_logits(logits, shard, temperature)
    shift = max_across_shards(scaled.max(dim=-1, keepdim=True).values, shard)
    sum_exp = _sum_for_local_use(torch.exp(scaled - shift).sum(dim=-1, keepdim=True), shard)
    return scaled - (shift + torch.log(sum_exp))


def gather_ids(local_values: Tensor, global_ids: Tensor, shard: VocabShard) -> Tensor:
    """values[n, ids[n, j]] for global ids, whichever rank holds the row: [N, K]."""
    local_ids = global_ids - shard.start
    held = (local_ids >= 0) & (local_ids < local_values.shape[-1])
    picked = local_values.gather(-1, local_ids.clamp(0, local_values.shape[-1] - 1))
    return sum_across_shards(torch.where(held, picked, torch.zeros_like(picked)), shard)


def topk_ids(local_scores: Tensor, k: int, shard: VocabShard) -> Tensor:
    """Global ids of the k largest scores per row over all shards (no gradient): [N, k]."""
    local_scores = local_scores.detach()
    local_k = min(k, local_scores.shape[-1])
    values, ids = local_scores.topk(local_k, dim=-1)
    ids = ids + shard.start
    if shard.world_size > 1:
        all_values = [torch.empty_like(values) for _ in range(shard.world_size)]
        all_ids = [torch.empty_like(ids) for _ in range(shard.world_size)]
        dist.all_gather(all_values, values.contiguous(), group=shard.group)
        dist.all_gather(all_ids, ids.contiguous(), group=shard.group)
        values, ids = torch.cat(all_values, dim=-1), torch.cat(all_ids, dim=-1)
    if k > values.shape[-1]:
        raise ValueError(f"top-k of {k} exceeds the vocabulary size {values.shape[-1]}")
    best = values.topk(k, dim=-1).indices
    return ids.gather(-1, best)


def _chunk_bounds(num_tokens: int, chunk_size: int) -> range:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return range(0, num_tokens, chunk_size)


def _sliced(tensors: Sequence[Tensor | None], begin: int, end: int) -> list[Tensor | None]:
    return [None if t is None else t[begin:end] for t in tensors]


class _ChunkedKernel(torch.autograd.Function):
    """Forward runs the kernel chunk by chunk without a graph; backward recomputes one
    chunk at a time and writes its gradient into a single buffer per input. (Slicing a
    tensor inside a graph would give every chunk a full-size zero gradient to sum.)

    With an LM-head weight, tensors[0] is the hidden states and the kernel sees
    hidden_chunk @ weight.T; the weight's gradient accumulates chunk by chunk.
    """

    @staticmethod
    def forward(
        ctx: Any,
        kernel: PerTokenKernel,
        chunk_size: int,
        weight: Tensor | None,
        *tensors: Tensor | None,
    ) -> Tensor:
        ctx.kernel, ctx.chunk_size = kernel, chunk_size
        ctx.save_for_backward(weight, *tensors)
        first = next(t for t in tensors if t is not None)
        outputs = []
        with torch.no_grad():
            for begin in _chunk_bounds(first.shape[0], chunk_size):
                chunk = _sliced(tensors, begin, begin + chunk_size)
                if weight is not None:
                    assert chunk[0] is not None
                    chunk[0] = chunk[0] @ weight.t()
                outputs.append(kernel(*chunk))
        return torch.cat(outputs, dim=0)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        weight, *tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        grads = [
            torch.zeros_like(t) if t is not None and need else None
            for t, need in zip(tensors, needs, strict=True)
        ]
        weight_grad = torch.zeros_like(weight) if ctx.needs_input_grad[2] else None
        first = next(t for t in tensors if t is not None)
        for begin in _chunk_bounds(first.shape[0], ctx.chunk_size):
            end = begin + ctx.chunk_size
            chunk = _sliced(tensors, begin, end)
            with torch.enable_grad():
                if weight is not None:
                    assert chunk[0] is not None
                    hidden_chunk = chunk[0]
                    chunk[0] = (hidden_chunk.detach() @ weight.detach().t()).requires_grad_()
                    targets = [0]
                else:
                    targets = [i for i, need in enumerate(needs) if need]
                    for i in targets:
                        chunk[i] = cast(Tensor, chunk[i]).detach().requires_grad_()
                output = ctx.kernel(*chunk)
                if not output.requires_grad:
                    continue
                chunk_grads = torch.autograd.grad(
                    output,
                    [cast(Tensor, chunk[i]) for i in targets],
                    grad_output[begin:end],
                    allow_unused=True,
                )
            if weight is None:
                for i, grad in zip(targets, chunk_grads, strict=True):
                    if grad is not None:
                        cast(Tensor, grads[i])[begin:end] = grad
                continue
            logits_grad = chunk_grads[0]
            if logits_grad is None:
                continue
            logits_grad = logits_grad.to(weight.dtype)
            if grads[0] is not None:
                torch.mm(logits_grad, weight, out=grads[0][begin:end])
            if weight_grad is not None:
                # a row without gradient adds nothing: keep its hidden state (a masked row may
                # hold NaN or inf) out of 0 * h
                carries = (logits_grad != 0).any(dim=-1, keepdim=True)
                weight_grad.addmm_(logits_grad.t(), torch.where(carries, hidden_chunk, 0))
        return (None, None, weight_grad, *grads)


def apply_chunked(
    kernel: PerTokenKernel, tensors: Sequence[Tensor | None], chunk_size: int | None
) -> Tensor:
    """kernel(*tensors) for per-token tensors, evaluated `chunk_size` tokens at a time.

    Backward recomputes each chunk instead of keeping its intermediates, so the working
    memory is one chunk's [chunk x V_local] worth beside the inputs' gradients. None
    entries pass through as None.
    """
    present = [t for t in tensors if t is not None]
    if chunk_size is None or chunk_size >= present[0].shape[0]:
        return kernel(*tensors)
    result: Tensor = _ChunkedKernel.apply(kernel, chunk_size, None, *tensors)
    return result


def fused_lm_head(
    kernel: PerTokenKernel,
    hidden: Tensor,
    lm_head_weight: Tensor,
    tensors: Sequence[Tensor | None],
    chunk_size: int,
) -> Tensor:
    """kernel(hidden @ W.T, *tensors) per chunk: the logits exist one chunk at a time, and
    the gradients of hidden and W are accumulated chunk by chunk.

    `lm_head_weight` is this rank's [V_local, H] rows; the kernel sees local logits.
    """
    result: Tensor = _ChunkedKernel.apply(kernel, chunk_size, lm_head_weight, hidden, *tensors)
    return result


def token_logprobs(
    logits: Tensor,
    token_ids: Tensor,
    shard: VocabShard | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    *,
    mask: Tensor | None = None,
) -> Tensor:
    """log p(token_ids[n]) under softmax(logits[n] / T) over the whole vocabulary: [N].

    With `mask`, rows where it is 0 never reach the math: they give 0 with 0 gradient
    whatever they hold (NaN, inf), as the losses that consume these log-probs promise."""
    shard = shard or VocabShard()

    def kernel(logits_chunk: Tensor, ids_chunk: Tensor, valid_chunk: Tensor | None) -> Tensor:
        if valid_chunk is not None:
            logits_chunk = keep_valid_rows(logits_chunk, valid_chunk)
            ids_chunk = keep_valid_rows(ids_chunk, valid_chunk)
        local = log_softmax(logits_chunk, shard, temperature)
        picked = gather_ids(local, ids_chunk[:, None], shard)[:, 0]
        return picked if valid_chunk is None else keep_valid_rows(picked, valid_chunk)

    valid = None if mask is None else mask.bool()
    return apply_chunked(kernel, [logits, token_ids, valid], chunk_size)
