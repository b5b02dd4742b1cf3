"""Masked rows never reach the math: whatever a row whose mask is 0 holds (NaN, +inf, -inf,
in any input), every loss gives the same value, metrics and gradient as with ordinary
numbers there (so 0 and exactly 0 gradient at the row), unchunked, chunked and fused.
The TP=2 form is in test_vocab_parallel_dist.py.

Also: a teacher top-k log-prob of -inf on an UNmasked row (a teacher giving probability 0)
counts as `logprob_floor`, so value and gradient stay finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from slime_ext.losses import (
    TokenLoss,
    generalized_jsd,
    masked_nll,
    reverse_kl_pg_loss,
    sampled_reverse_kl,
    teacher_topk_kl,
    topk_shared_support_kl,
)
from slime_ext.vocab_parallel import fused_lm_head, token_logprobs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOKENS, VOCAB, TOP_K, HIDDEN = 7, 11, 4, 5
TEMPERATURE = 0.7
POISONS = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}


def _batch(seed: int) -> dict[str, Tensor]:
    """Ordinary numbers everywhere: the clean batch every poisoned one is compared with."""
    generator = torch.Generator().manual_seed(seed)
    teacher_logits = torch.randn(TOKENS, VOCAB, generator=generator) * 3
    topk = torch.log_softmax(teacher_logits / TEMPERATURE, dim=-1).topk(TOP_K, dim=-1)
    return {
        "student_logits": torch.randn(TOKENS, VOCAB, generator=generator) * 3,
        "student_logprobs": -torch.rand(TOKENS, generator=generator) * 4,
        "teacher_logits": teacher_logits,
        "topk_ids": topk.indices,
        "topk_logprobs": topk.values,
        "teacher_logprobs": -torch.rand(TOKENS, generator=generator) * 4,
        "old_logprobs": -torch.rand(TOKENS, generator=generator) * 4,
        "ids": torch.randint(0, VOCAB, (TOKENS,), generator=generator),
    }


LossFn = Callable[[Tensor, dict[str, Tensor], Tensor, int | None], TokenLoss]


def _sampled(loss: Callable[[Tensor, Tensor], TokenLoss]) -> LossFn:
    """A loss of the student's log-probs, taken from its logits (masked, chunked)."""

    def run(student: Tensor, b: dict[str, Tensor], mask: Tensor, chunk: int | None) -> TokenLoss:
        logprobs = token_logprobs(student, b["ids"], None, TEMPERATURE, chunk, mask=mask)
        return loss(logprobs, mask)

    return run


def _pg(b: dict[str, Tensor], clip: bool) -> Callable[[Tensor, Tensor], TokenLoss]:
    old = b["old_logprobs"] if clip else None
    return lambda s, m: reverse_kl_pg_loss(s, b["teacher_logprobs"], m, old, 0.2 if clip else None)


@dataclass(frozen=True)
class Case:
    student: str
    """The differentiated input: "student_logits" [N, V] or "student_logprobs" [N]."""
    reads: tuple[str, ...]
    """The float inputs a hostile masked row may poison (the student's among them)."""
    loss: LossFn


def _full(reads: str, fn: Callable[..., TokenLoss]) -> Case:
    return Case("student_logits", ("student_logits", reads), fn)


T = TEMPERATURE
CASES: dict[str, Case] = {
    "jsd_beta0": _full(
        "teacher_logits",
        lambda s, b, m, c: generalized_jsd(s, b["teacher_logits"], m, 0.0, T, chunk_size=c),
    ),
    "jsd_beta0.4_vocab_clip": _full(
        "teacher_logits",
        lambda s, b, m, c: generalized_jsd(s, b["teacher_logits"], m, 0.4, T, 0.05, chunk_size=c),
    ),
    "jsd_beta1_token_clip": _full(
        "teacher_logits",
        lambda s, b, m, c: generalized_jsd(
            s, b["teacher_logits"], m, 1.0, T, 0.5, "token", chunk_size=c
        ),
    ),
    "jsd_top_k": _full(
        "teacher_logits",
        lambda s, b, m, c: generalized_jsd(
            s, b["teacher_logits"], m, 0.5, T, top_k=3, chunk_size=c
        ),
    ),
    "topk_shared": _full(
        "teacher_logits",
        lambda s, b, m, c: topk_shared_support_kl(s, b["teacher_logits"], m, 4, T, chunk_size=c),
    ),
    "teacher_topk_tail": _full(
        "topk_logprobs",
        lambda s, b, m, c: teacher_topk_kl(
            s, b["topk_ids"], b["topk_logprobs"], m, T, True, chunk_size=c
        ),
    ),
    "teacher_topk_renorm": _full(
        "topk_logprobs",
        lambda s, b, m, c: teacher_topk_kl(
            s, b["topk_ids"], b["topk_logprobs"], m, T, False, chunk_size=c
        ),
    ),
    "token_logprobs": Case(
        "student_logits",
        ("student_logits",),
        lambda s, b, m, c: TokenLoss(token_logprobs(s, b["ids"], None, T, c, mask=m), {}),
    ),
    "nll_of_logits": Case(
        "student_logits", ("student_logits",), lambda s, b, m, c: _sampled(masked_nll)(s, b, m, c)
    ),
    "pg_of_logits": Case(
        "student_logits",
        ("student_logits", "teacher_logprobs"),
        lambda s, b, m, c: _sampled(_pg(b, clip=False))(s, b, m, c),
    ),
    "pg_clip_of_logits": Case(
        "student_logits",
        ("student_logits", "teacher_logprobs", "old_logprobs"),
        lambda s, b, m, c: _sampled(_pg(b, clip=True))(s, b, m, c),
    ),
    "nll": Case("student_logprobs", ("student_logprobs",), lambda s, b, m, c: masked_nll(s, m)),
    "pg": Case(
        "student_logprobs",
        ("student_logprobs", "teacher_logprobs"),
        lambda s, b, m, c: _pg(b, clip=False)(s, m),
    ),
    "pg_clip": Case(
        "student_logprobs",
        ("student_logprobs", "teacher_logprobs", "old_logprobs"),
        lambda s, b, m, c: _pg(b, clip=True)(s, m),
    ),
    "sampled_reverse_kl": Case(
        "student_logprobs",
        ("student_logprobs", "teacher_logprobs"),
        lambda s, b, m, c: sampled_reverse_kl(s, b["teacher_logprobs"], m),
    ),
}


def _poisoned(
    batch: dict[str, Tensor], key: str, mask: Tensor, poison: float, whole_row: bool
) -> dict[str, Tensor]:
    """The batch with `key`'s masked rows holding `poison`: all of each row, or one entry."""
    values = batch[key].clone()
    rows = (~mask).nonzero()[:, 0]
    if values.dim() == 1 or whole_row:
        values[rows] = poison
    else:
        values[rows, rows % values.shape[1]] = poison
    return {**batch, key: values}


def _run(case: Case, batch: dict[str, Tensor], mask: Tensor, chunk: int | None):  # type: ignore[no-untyped-def]
    student = batch[case.student].clone().requires_grad_()
    result = case.loss(student, batch, mask, chunk)
    if result.per_token.requires_grad:
        (result.per_token * torch.linspace(0.5, 1.5, TOKENS)).sum().backward()
    grad = torch.zeros_like(student) if student.grad is None else student.grad
    return result.per_token.detach(), grad, result.metrics


def _assert_same_as_clean(
    case: Case, clean: dict[str, Tensor], dirty: dict[str, Tensor], mask: Tensor, chunk: int | None
) -> None:
    value, grad, metrics = _run(case, dirty, mask, chunk)
    expected_value, expected_grad, expected_metrics = _run(case, clean, mask, chunk)
    assert torch.isfinite(value).all() and torch.isfinite(grad).all()
    assert torch.all(value[~mask] == 0) and torch.all(grad[~mask] == 0)
    assert torch.allclose(value, expected_value, atol=1e-6)
    assert torch.allclose(grad, expected_grad, atol=1e-6)
    assert metrics.keys() == expected_metrics.keys()
    for name, metric in metrics.items():
        assert torch.allclose(metric, expected_metrics[name], atol=1e-6), name


CASE_INPUTS = [(name, key) for name, case in sorted(CASES.items()) for key in case.reads]


@pytest.mark.parametrize(("name", "key"), CASE_INPUTS)
def test_masked_rows_holding_nan_or_inf_change_no_value_and_no_gradient(
    name: str, key: str
) -> None:
    case, clean = CASES[name], _batch(seed=0)
    mask = torch.tensor([True, False, True, True, False, True, False])
    assert clean[key].isfinite().all()  # the control: the clean batch is ordinary
    for poison in POISONS.values():
        for whole_row in (True, False):
            dirty = _poisoned(clean, key, mask, poison, whole_row)
            for chunk in (None, 2):
                _assert_same_as_clean(case, clean, dirty, mask, chunk)


@given(
    case_input=st.sampled_from(CASE_INPUTS),
    masked=st.sets(st.integers(0, TOKENS - 1), min_size=1, max_size=TOKENS - 1),
    poisons=st.lists(st.sampled_from(sorted(POISONS)), min_size=1, max_size=TOKENS),
    chunk=st.sampled_from([None, 1, 3]),
    seed=st.integers(0, 1_000),
)
def test_any_mix_of_poisons_in_any_masked_rows_changes_nothing(
    case_input: tuple[str, str], masked: set[int], poisons: list[str], chunk: int | None, seed: int
) -> None:
    name, key = case_input
    clean = _batch(seed)
    mask = torch.ones(TOKENS, dtype=torch.bool)
    mask[sorted(masked)] = False
    dirty = {k: v.clone() for k, v in clean.items()}
    for row, kind in zip(sorted(masked), poisons * TOKENS, strict=False):
        for read in CASES[name].reads:  # every input of the loss, this row one kind
            dirty[read][row] = POISONS[kind]
    dirty[key][sorted(masked)[0]] = math.nan  # and the drawn input NaN on the first
    _assert_same_as_clean(CASES[name], clean, dirty, mask, chunk)


FUSED: dict[str, Callable[..., Tensor]] = {
    "jsd": lambda lg, t, v: generalized_jsd(lg, t, v, 0.5, T).per_token,
    "topk_shared": lambda lg, t, v: topk_shared_support_kl(lg, t, v, 4, T).per_token,
    "teacher_topk": lambda lg, t, v: (
        teacher_topk_kl(lg, *torch.log_softmax(t / T, -1).topk(TOP_K, -1)[::-1], v, T).per_token
    ),
}


@pytest.mark.parametrize("name", sorted(FUSED))
@pytest.mark.parametrize("poison", sorted(POISONS))
def test_fused_lm_head_keeps_masked_hidden_rows_out_of_the_weight_gradient(
    name: str, poison: str
) -> None:
    """A masked row's hidden state (and teacher row) may be NaN or inf: the LM head's
    weight gradient sums over rows, and 0 * NaN there would poison every row."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator)
    teacher = torch.randn(TOKENS, VOCAB, generator=generator) * 3
    mask = torch.tensor([True, False, True, True, False, True, True])
    dirty_hidden, dirty_teacher = hidden.clone(), teacher.clone()
    dirty_hidden[~mask] = POISONS[poison]
    dirty_teacher[~mask] = POISONS[poison]
    results = []
    for rows, teacher_rows in ((hidden, teacher), (dirty_hidden, dirty_teacher)):
        rows, head = rows.clone().requires_grad_(), weight.clone().requires_grad_()
        value = fused_lm_head(FUSED[name], rows, head, [teacher_rows, mask], chunk_size=3)
        value.sum().backward()
        assert rows.grad is not None and head.grad is not None
        results.append((value.detach(), rows.grad, head.grad))
    (value, hidden_grad, weight_grad), (dirty_value, dirty_hidden_grad, dirty_weight_grad) = results
    assert torch.isfinite(dirty_weight_grad).all() and torch.isfinite(dirty_hidden_grad).all()
    assert torch.allclose(dirty_value, value, atol=1e-6)
    assert torch.allclose(dirty_hidden_grad, hidden_grad, atol=1e-6)
    assert torch.allclose(dirty_weight_grad, weight_grad, atol=1e-6)


def test_fused_token_logprobs_with_a_mask_keep_masked_hidden_rows_out() -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, requires_grad=True)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator)
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    mask = torch.tensor([True, True, False, True, True, True, False])
    hidden[~mask] = math.nan
    hidden.requires_grad_()

    def kernel(logits: Tensor, ids: Tensor, valid: Tensor) -> Tensor:
        return token_logprobs(logits, ids, temperature=T, mask=valid)

    logprobs = fused_lm_head(kernel, hidden, weight, [ids, mask], chunk_size=2)
    masked_nll(logprobs, mask).per_token.sum().backward()
    assert hidden.grad is not None and weight.grad is not None
    assert torch.all(logprobs[~mask] == 0) and torch.isfinite(logprobs).all()
    assert torch.all(hidden.grad[~mask] == 0) and torch.isfinite(weight.grad).all()
    # the plain statement on the unmasked rows alone gives the same weight gradient
    plain_weight = weight.detach().clone().requires_grad_()
    rows = hidden.detach()[mask] @ plain_weight.t()
    plain = -torch.log_softmax(rows / T, -1).gather(-1, ids[mask][:, None]).sum()
    plain.backward()
    assert torch.allclose(weight.grad, plain_weight.grad, atol=1e-5)  # type: ignore[arg-type]


# --- a teacher's probability 0 on an unmasked row -------------------------------------


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("floor", [None, -20.0])
def test_minus_inf_teacher_topk_logprobs_on_loss_rows_count_as_the_floor(
    tail: bool, chunk: int | None, floor: float | None
) -> None:
    batch = _batch(seed=3)
    mask = torch.ones(TOKENS, dtype=torch.bool)
    teacher = batch["topk_logprobs"].clone()
    teacher[0, -1] = -math.inf  # one zero-probability entry
    teacher[1] = -math.inf  # a row where the teacher gives its whole top-k probability 0
    floor_kwargs = {} if floor is None else {"logprob_floor": floor}
    floor = -100.0 if floor is None else floor  # the default
    floored = teacher.clamp(min=floor)
    results = []
    for given_logprobs in (teacher, floored):
        student = batch["student_logits"].clone().requires_grad_()
        loss = teacher_topk_kl(
            student, batch["topk_ids"], given_logprobs, mask, T, tail, chunk_size=chunk,
            **floor_kwargs,
        )  # fmt: skip
        loss.per_token.sum().backward()
        results.append((loss.per_token.detach(), student.grad))
    (value, grad), (floored_value, floored_grad) = results
    assert grad is not None and floored_grad is not None
    assert torch.isfinite(value).all() and torch.isfinite(grad).all()
    assert torch.allclose(value, floored_value) and torch.allclose(grad, floored_grad)
    for row in (0, 1):  # a plain restatement with the -inf entries at the floor
        student_k = torch.log_softmax(batch["student_logits"][row].double() / T, -1)
        student_k, teacher_k = student_k[batch["topk_ids"][row]], floored[row].double()
        if not tail:
            student_k, teacher_k = [lp - lp.logsumexp(-1) for lp in (student_k, teacher_k)]
        expected = (student_k.exp() * (student_k - teacher_k)).sum()
        if tail:
            rests = [(1 - lp.exp().sum()).clamp(min=1e-8).log() for lp in (student_k, teacher_k)]
            expected += rests[0].exp() * (rests[0] - rests[1])
        assert float(value[row]) == pytest.approx(float(expected), rel=1e-5)
        # the floor, not infinity, bounds the penalty
        assert float(value[row]) < -floor + 1


@pytest.mark.parametrize("floor", [0.0, -math.inf, math.nan])
def test_the_floor_is_a_finite_negative_logprob(floor: float) -> None:
    batch = _batch(seed=4)
    mask = torch.ones(TOKENS, dtype=torch.bool)
    with pytest.raises(ValueError, match="logprob_floor"):
        teacher_topk_kl(
            batch["student_logits"], batch["topk_ids"], batch["topk_logprobs"], mask,
            logprob_floor=floor,
        )  # fmt: skip


def test_nan_on_a_loss_row_still_shows() -> None:
    """Only masked rows are sanitized: a NaN where the loss counts is a real error."""
    batch = _batch(seed=5)
    mask = torch.ones(TOKENS, dtype=torch.bool)
    teacher = batch["topk_logprobs"].clone()
    teacher[2, 0] = math.nan
    loss = teacher_topk_kl(batch["student_logits"], batch["topk_ids"], teacher, mask, T)
    others = torch.arange(TOKENS) != 2
    assert torch.isnan(loss.per_token[2]) and torch.isfinite(loss.per_token[others]).all()
