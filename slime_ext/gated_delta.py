"""Gated DeltaNet's sequence mixing (its short convolution and its gated delta rule) over a
packed micro-batch of variable-length sequences, some tree-packed (slime_ext.turns.pack):
each branch runs from the trunk's state where it forks.

A micro-batch row belongs to a run: a causal sequence (a per-turn sample, padding), a
trunk segment (a trunk cut at every fork), or a branch. Every run starts from zeros or
from the state another run ended with, so `DeltaPlan` orders them in rounds: round 0 the
runs from zeros, then each trunk segment after the one before, each branch after the
segment that ends at its fork. A round is one call of the gated delta rule in
flash-linear-attention's varlen form (`chunk_gated_delta_rule(q, k, v, g, beta,
initial_state=[N, H, K, V], output_final_state=True, cu_seqlens=[N + 1])`), so gradients
reach the trunk through the states (the kernel returns the initial state's gradient).
The short convolution is position-local: each row reads its kernel's window of logical
predecessors (a branch's first rows read the trunk before its fork), one gather.

`chunk_gated_delta_rule_reference` is the kernel on the CPU: transformers' torch
reference (exact) run per sequence behind fla's signature; `gated_delta_kernel` picks
fla's on CUDA where it is installed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

GatedDeltaKernel = Callable[..., tuple[Tensor, Tensor | None]]


class GatedDeltaError(ValueError):
    """A micro-batch or an argument the gated delta rule cannot take."""


def chunk_gated_delta_rule_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """flash-linear-attention's `chunk_gated_delta_rule` on any device: q, k [B, T, H, K],
    v [B, T, H, V], g, beta [B, T, H]; with `cu_seqlens` (B = 1) each sequence from its
    row of `initial_state` [N, H, K, V]. transformers' torch reference computes each."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise GatedDeltaError(f"the reference scales queries by K**-0.5 only, not {scale}")
    if cu_seqlens is None:
        return torch_chunk_gated_delta_rule(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
    if q.shape[0] != 1:
        raise GatedDeltaError(f"variable-length sequences come as one row, not {q.shape[0]}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    outputs, states = [], []
    for n, (start, end) in enumerate(itertools.pairwise(bounds)):
        state = None if initial_state is None else initial_state[n : n + 1]
        if end == start:
            heads, k_dim, v_dim = v.shape[2], q.shape[-1], v.shape[-1]
            states.append(state if state is not None else v.new_zeros(1, heads, k_dim, v_dim))
            continue
        out, final = torch_chunk_gated_delta_rule(
            q[:, start:end],
            k[:, start:end],
            v[:, start:end],
            g=g[:, start:end],
            beta=beta[:, start:end],
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        outputs.append(out)
        states.append(final)
    out = torch.cat(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return out, torch.cat(states) if output_final_state and states else None


def gated_delta_kernel(device: torch.device) -> GatedDeltaKernel:
    """flash-linear-attention's chunked kernel on CUDA where installed, else the reference."""
    if device.type == "cuda":
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except ImportError:
            pass
        else:
            return chunk_gated_delta_rule
    return chunk_gated_delta_rule_reference


@dataclass(frozen=True)
class Run:
    start: int
    end: int
    """Micro-batch rows [start, end)."""
    source: int | None
    """The run whose final state this one starts from; None: zeros."""


@dataclass(frozen=True)
class DeltaPlan:
    """How a micro-batch's rows mix: runs in rounds and each row's convolution window."""

    runs: list[Run]
    rounds: list[list[int]]
    """Run indices per round; a run's source is in an earlier round."""
    parent: Tensor
    """[T] long: the row before each row in its logical sequence (-1: none)."""

    @staticmethod
    def of(cu_seqlens: Sequence[int], branch: Sequence[int], visible: Sequence[int]) -> DeltaPlan:
        """`branch` and `visible` per row as slime_ext.turns.PackedSequence's (-1 on the
        trunk; the trunk tokens a row sees), over the whole micro-batch; a sequence whose
        rows are all trunk is causal. Within a sequence: the trunk, then branches (each a
        run of one branch value), then trunk rows again (padding: a causal run)."""
        runs: list[Run] = []
        parent = list(range(-1, len(branch) - 1))
        for start, end in itertools.pairwise(cu_seqlens):
            runs += _sequence_runs(start, end, branch, visible, parent, len(runs))
        depth: list[int] = []
        for run in runs:
            depth.append(0 if run.source is None else depth[run.source] + 1)
        rounds = [
            [i for i, d in enumerate(depth) if d == r] for r in range(max(depth, default=-1) + 1)
        ]
        return DeltaPlan(runs, rounds, torch.tensor(parent, dtype=torch.long))


def _sequence_runs(
    start: int,
    end: int,
    branch: Sequence[int],
    visible: Sequence[int],
    parent: list[int],
    offset: int,
) -> list[Run]:
    """The runs of one sequence's rows; sources index the micro-batch's runs (this
    sequence's first at `offset`)."""
    if start < end:
        parent[start] = -1
    pieces = _pieces(branch, start, end)
    trunk_end = pieces[0][1] if pieces and pieces[0][2] == -1 else start
    forks = sorted(
        {visible[first] for first, _, value in pieces if value >= 0 and visible[first] > 0}
    )
    if forks and forks[-1] > trunk_end - start:
        raise GatedDeltaError(
            f"a branch forks after {forks[-1]} trunk tokens of a {trunk_end - start}-token trunk"
        )
    runs: list[Run] = []
    ends_at: dict[int, int] = {}
    cut_from = start
    for fork in [f for f in forks if f < trunk_end - start] + [trunk_end - start]:
        if start + fork > cut_from:
            source = offset + len(runs) - 1 if runs else None
            runs.append(Run(cut_from, start + fork, source))
            cut_from = start + fork
        ends_at[fork] = offset + len(runs) - 1
    for first, last, value in pieces[1 if trunk_end > start else 0 :]:
        if value < 0:  # rows after the branches (padding): their own causal run
            parent[first] = -1
            runs.append(Run(first, last, None))
            continue
        fork = visible[first]
        parent[first] = start + fork - 1 if fork > 0 else -1
        runs.append(Run(first, last, ends_at[fork] if fork > 0 else None))
    return runs


def _pieces(branch: Sequence[int], start: int, end: int) -> list[tuple[int, int, int]]:
    """(first row, end row, branch value) of each run of equal values in rows [start, end)."""
    pieces, first = [], start
    for value, group in itertools.groupby(branch[start:end]):
        size = len(list(group))
        pieces.append((first, first + size, value))
        first += size
    return pieces


def short_convolution(x: Tensor, weight: Tensor, activation: str | None, plan: DeltaPlan) -> Tensor:
    """A causal depthwise convolution x [1, T, D], weight [D, 1, W] (nn.Conv1d's), each row
    over its last W logical rows (zeros before a sequence's start)."""
    width = weight.shape[-1]
    parent = plan.parent.to(x.device)
    rows = torch.arange(x.shape[1], device=x.device)
    window = [rows]
    for _ in range(width - 1):
        previous = window[-1]
        window.append(torch.where(previous >= 0, parent[previous.clamp(min=0)], -1))
    index = torch.stack(window[::-1], dim=1)  # [T, W], oldest first
    padded = torch.cat([x[0], x.new_zeros(1, x.shape[-1])])  # row T: the zeros
    gathered = padded[torch.where(index >= 0, index, x.shape[1])]  # [T, W, D]
    out = torch.einsum("twd,dw->td", gathered, weight[:, 0].to(x.dtype))
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise GatedDeltaError(f"a short convolution with activation {activation!r}")
    return out[None]


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    plan: DeltaPlan,
    kernel: GatedDeltaKernel,
    use_qk_l2norm_in_kernel: bool = True,
) -> Tensor:
    """The gated delta rule over the micro-batch [1, T, ...]: round by round, each round's
    runs as variable-length sequences in one kernel call from their sources' states."""
    final: dict[int, Tensor] = {}
    pieces: list[Tensor] = []
    order: list[Tensor] = []
    heads, k_dim, v_dim = v.shape[2], q.shape[-1], v.shape[-1]
    for chosen in plan.rounds:
        runs = [plan.runs[i] for i in chosen]
        index = torch.cat([torch.arange(r.start, r.end) for r in runs]).to(q.device)
        lengths = torch.tensor([0] + [r.end - r.start for r in runs])
        cu_seqlens = lengths.cumsum(0).to(q.device)
        zeros = v.new_zeros(heads, k_dim, v_dim, dtype=torch.float32)
        states = torch.stack([zeros if r.source is None else final[r.source] for r in runs])
        out, ends = kernel(
            q.index_select(1, index),
            k.index_select(1, index),
            v.index_select(1, index),
            g=g.index_select(1, index),
            beta=beta.index_select(1, index),
            initial_state=states,
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens,
        )
        if ends is None:
            raise GatedDeltaError("the kernel returned no final states")
        final.update({i: ends[n] for n, i in enumerate(chosen)})
        pieces.append(out)
        order.append(index)
    rows = torch.cat(order)
    return torch.cat(pieces, dim=1).index_select(1, torch.argsort(rows))
