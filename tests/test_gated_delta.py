"""Gated DeltaNet's mixing over a packed micro-batch with tree-packed samples
(slime_ext.gated_delta): every row's output, and the gradients of every input, equal those
of its logical sequence (a trunk prefix, then the branch) run alone from zeros through
transformers' own kernels (torch_chunk_gated_delta_rule, causal_conv1d_fn)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    causal_conv1d_fn,
    torch_chunk_gated_delta_rule,
)

from rollout.trajectory import Turn
from slime_ext.gated_delta import (
    DeltaPlan,
    GatedDeltaError,
    chunk_gated_delta_rule_reference,
    gated_delta_rule,
    short_convolution,
)
from slime_ext.turns import pack

HEADS, K_DIM, V_DIM, CHANNELS, WIDTH = 2, 8, 8, 6, 4
ATOL = 1e-5


def _inputs(rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).requires_grad_()

    return {
        "q": rand(1, rows, HEADS, K_DIM),
        "k": rand(1, rows, HEADS, K_DIM),
        "v": rand(1, rows, HEADS, V_DIM),
        "a": rand(1, rows, HEADS),
        "b": rand(1, rows, HEADS),
        "x": rand(1, rows, CHANNELS),
    }


def _mix(inputs: dict[str, torch.Tensor], plan: DeltaPlan, weight: torch.Tensor) -> torch.Tensor:
    g, beta = -torch.nn.functional.softplus(inputs["a"]), inputs["b"].sigmoid()
    out = gated_delta_rule(
        inputs["q"], inputs["k"], inputs["v"], g, beta, plan, chunk_gated_delta_rule_reference
    )
    conv = short_convolution(inputs["x"], weight, "silu", plan)
    return torch.cat([out.flatten(2), conv], dim=-1)[0]  # [T, H * V + C]


def _alone(inputs: dict[str, torch.Tensor], rows: list[int], weight: torch.Tensor) -> torch.Tensor:
    """The rows as one plain sequence, through transformers' kernels, from zeros."""
    index = torch.tensor(rows)
    pick = {name: value.index_select(1, index) for name, value in inputs.items()}
    g, beta = -torch.nn.functional.softplus(pick["a"]), pick["b"].sigmoid()
    out, _ = torch_chunk_gated_delta_rule(
        pick["q"], pick["k"], pick["v"], g=g, beta=beta, use_qk_l2norm_in_kernel=True
    )
    conv = causal_conv1d_fn(pick["x"].transpose(1, 2), weight[:, 0], None, activation="silu")
    return torch.cat([out.flatten(2), conv.transpose(1, 2)], dim=-1)[0]


def _micro_batch(stems: bool = True) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """A tree-packed trajectory (forks after 2, 3 (a drifted turn), 3 and 9 of its 9 trunk
    tokens; one span held in the trunk; `stems`: as slime's samples, each branch without a
    drifted suffix starting with a copy of its context's last token, one fork earlier),
    its padding, then a causal per-turn sample: the cu_seqlens, branch and visible rows,
    and each output row's logical sequence."""
    trunk = list(range(10, 19))
    turns = [
        Turn(context_len=2, span_ids=[30, 31], think_len=1),
        Turn(context_len=3, span_ids=[32], think_len=0),
        Turn(context_len=3, context_suffix_ids=[40], span_ids=[33, 34], think_len=1,
             drift=True, drift_reason="rewritten"),
        Turn(context_len=4, span_ids=[14, 15], think_len=0),  # held: trunk[4:6]
        Turn(context_len=9, span_ids=list(range(50, 70)), think_len=5),
    ]  # fmt: skip
    packed = pack(trunk, turns, stems=stems)
    length = len(packed.ids)
    padding, causal = 3, 70
    branch = packed.branch + [-1] * padding + [-1] * causal
    visible = packed.visible_trunk + [0] * (padding + causal)
    cu_seqlens = [0, length + padding, length + padding + causal]
    logical: list[list[int]] = []
    for row in range(length):
        if packed.branch[row] < 0:
            logical.append(list(range(row + 1)))
        else:
            first = packed.branch.index(packed.branch[row])
            fork = packed.visible_trunk[row]
            logical.append(list(range(fork)) + list(range(first, row + 1)))
    start = length + padding
    logical += [list(range(start, start + n + 1)) for n in range(causal)]
    return cu_seqlens, branch, visible, logical


def _rows_of(cu_seqlens: list[int], logical: list[list[int]]) -> list[int]:
    """The output row each logical sequence ends at (padding rows skipped)."""
    return [rows[-1] for rows in logical]


@pytest.mark.parametrize(
    ("stems", "zero_states"),
    [(True, False), (False, False), (True, True)],
    ids=["stems", "no-stems", "negative-control"],
)
def test_every_row_equals_its_logical_sequence_alone(stems: bool, zero_states: bool) -> None:
    cu_seqlens, branch, visible, logical = _micro_batch(stems)
    plan = DeltaPlan.of(cu_seqlens, branch, visible)
    if zero_states:  # every branch from zeros and without the trunk in its window
        plan = DeltaPlan(
            [type(r)(r.start, r.end, None) for r in plan.runs],
            [list(range(len(plan.runs)))],
            torch.where(torch.tensor(branch) >= 0, -1, plan.parent),
        )
    inputs = _inputs(cu_seqlens[-1])
    weight = torch.randn(CHANNELS, 1, WIDTH, generator=torch.Generator().manual_seed(1))
    mixed = _mix(inputs, plan, weight)
    expected = torch.stack([_alone(inputs, rows, weight)[-1] for rows in logical])
    got = mixed[torch.tensor(_rows_of(cu_seqlens, logical))]
    if zero_states:
        assert (got - expected).abs().max() > 100 * ATOL
        return
    assert torch.allclose(got, expected, atol=ATOL)
    # and the gradients of every input (the trunk's through the states and windows)
    weights = torch.linspace(0.5, 1.5, got.numel()).reshape(got.shape)
    grads = torch.autograd.grad((got * weights).sum(), list(inputs.values()))
    reference = torch.autograd.grad((expected * weights).sum(), list(inputs.values()))
    for mine, theirs in zip(grads, reference, strict=True):
        assert torch.allclose(mine, theirs, atol=ATOL)


def test_rounds_chain_each_trunk_segment_after_the_one_before() -> None:
    cu_seqlens, branch, visible, _ = _micro_batch(stems=False)
    plan = DeltaPlan.of(cu_seqlens, branch, visible)
    trunk = [r for r in plan.runs if r.end <= 9]
    assert [(r.start, r.end) for r in trunk] == [(0, 2), (2, 3), (3, 9)]
    for n, chosen in enumerate(plan.rounds):
        for i in chosen:
            source = plan.runs[i].source
            assert source is None or any(source in earlier for earlier in plan.rounds[:n])


def test_the_reference_kernel_chains_states_as_one_sequence() -> None:
    """fla's varlen form: two sequences, the second from the first's final state, equal
    the two as one sequence."""
    inputs = _inputs(150, seed=3)
    g, beta = -torch.nn.functional.softplus(inputs["a"]), inputs["b"].sigmoid()
    whole, _ = chunk_gated_delta_rule_reference(
        inputs["q"], inputs["k"], inputs["v"], g, beta, use_qk_l2norm_in_kernel=True
    )
    cut = torch.tensor([0, 70])
    first, state = chunk_gated_delta_rule_reference(
        *(x[:, :70] for x in (inputs["q"], inputs["k"], inputs["v"], g, beta)),
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cut,
    )  # fmt: skip
    assert state is not None
    second, _ = chunk_gated_delta_rule_reference(
        *(x[:, 70:] for x in (inputs["q"], inputs["k"], inputs["v"], g, beta)),
        initial_state=state, use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor([0, 80]),
    )  # fmt: skip
    assert torch.allclose(torch.cat([first, second], dim=1), whole, atol=ATOL)


def test_bad_forks_and_arguments_are_refused() -> None:
    with pytest.raises(GatedDeltaError, match="forks after 5"):
        DeltaPlan.of([0, 6], [-1, -1, -1, 0, 0, 0], [1, 2, 3, 5, 5, 5])
    inputs: dict[str, Any] = _inputs(4)
    with pytest.raises(GatedDeltaError, match="scales queries"):
        chunk_gated_delta_rule_reference(
            inputs["q"], inputs["k"], inputs["v"], inputs["a"], inputs["b"], scale=1.0
        )
    with pytest.raises(GatedDeltaError, match="activation"):
        plan = DeltaPlan.of([0, 4], [-1] * 4, [1, 2, 3, 4])
        short_convolution(inputs["x"], torch.ones(CHANNELS, 1, WIDTH), "relu", plan)
