"""One temperature convention for every loss (slime_ext.losses' module docstring): a loss at
temperature T is the same function of the temperature-T distributions as at T = 1, with
no T^2 factor, so loss(z, T) = loss(z / T, 1), and each equals its plain-torch statement
on log_softmax(z / T)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from slime_ext.losses import (
    generalized_jsd,
    masked_nll,
    reverse_kl_pg_loss,
    sampled_reverse_kl,
    teacher_topk_kl,
    topk_shared_support_kl,
)
from slime_ext.vocab_parallel import token_logprobs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOKENS, VOCAB, TOP_K = 6, 9, 4
MASK = torch.tensor([True, True, False, True, True, True])

Ours = Callable[[Tensor, Tensor, Tensor, float], Tensor]
"""(student logits, teacher logits, sampled ids, T) -> per-token loss."""
Plain = Callable[[Tensor, Tensor, Tensor], Tensor]
"""(student log-probs at T, teacher log-probs at T, sampled ids) -> per-token loss."""


def _teacher_topk(teacher_logits: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """The teacher service's answer: its top-k ids and log-probs at the temperature."""
    top = torch.log_softmax(teacher_logits.float() / temperature, -1).topk(TOP_K, dim=-1)
    return top.indices, top.values


def _logprobs(logits: Tensor, ids: Tensor, temperature: float) -> Tensor:
    return token_logprobs(logits, ids, temperature=temperature)


OURS: dict[str, Ours] = {
    "jsd_beta0": lambda s, t, x, T: generalized_jsd(s, t, MASK, 0.0, T).per_token,
    "jsd_beta0.3": lambda s, t, x, T: generalized_jsd(s, t, MASK, 0.3, T).per_token,
    "jsd_beta1": lambda s, t, x, T: generalized_jsd(s, t, MASK, 1.0, T).per_token,
    "jsd_top_k": lambda s, t, x, T: generalized_jsd(s, t, MASK, 0.5, T, top_k=3).per_token,
    "topk_shared": lambda s, t, x, T: topk_shared_support_kl(s, t, MASK, 3, T).per_token,
    "teacher_topk_tail": lambda s, t, x, T: (
        teacher_topk_kl(s, *_teacher_topk(t, T), MASK, T, tail=True).per_token
    ),
    "teacher_topk_renorm": lambda s, t, x, T: (
        teacher_topk_kl(s, *_teacher_topk(t, T), MASK, T, tail=False).per_token
    ),
    "reverse_kl_pg": lambda s, t, x, T: (
        reverse_kl_pg_loss(_logprobs(s, x, T), _logprobs(t, x, T), MASK).per_token
    ),
    "sampled_reverse_kl": lambda s, t, x, T: (
        sampled_reverse_kl(_logprobs(s, x, T), _logprobs(t, x, T), MASK).per_token
    ),
    "masked_nll": lambda s, t, x, T: masked_nll(_logprobs(s, x, T), MASK).per_token,
}


def _kl(p: Tensor, q: Tensor) -> Tensor:
    return (p.exp() * (p - q)).sum(-1)


def _renorm(logprobs: Tensor) -> Tensor:
    return logprobs - logprobs.logsumexp(-1, keepdim=True)


def _jsd(s: Tensor, t: Tensor, beta: float) -> Tensor:
    if beta == 0.0:
        return _kl(t, s)
    if beta == 1.0:
        return _kl(s, t)
    mixture = torch.log((1 - beta) * s.exp() + beta * t.exp())
    return beta * _kl(t, mixture) + (1 - beta) * _kl(s, mixture)


def _on(ids: Tensor, *logprobs: Tensor) -> list[Tensor]:
    return [_renorm(lp.gather(-1, ids)) for lp in logprobs]


def _topk_tail(s: Tensor, t: Tensor) -> Tensor:
    ids = t.topk(TOP_K, -1).indices
    s_k, t_k = s.gather(-1, ids), t.gather(-1, ids)
    s_rest, t_rest = [(1 - lp.exp().sum(-1)).clamp(min=1e-8).log() for lp in (s_k, t_k)]
    return _kl(s_k, t_k) + s_rest.exp() * (s_rest - t_rest)


PLAIN: dict[str, Plain] = {
    "jsd_beta0": lambda s, t, x: _jsd(s, t, 0.0),
    "jsd_beta0.3": lambda s, t, x: _jsd(s, t, 0.3),
    "jsd_beta1": lambda s, t, x: _jsd(s, t, 1.0),
    "jsd_top_k": lambda s, t, x: _jsd(*_on(t.topk(3, -1).indices, s, t), 0.5),
    "topk_shared": lambda s, t, x: _kl(*_on(torch.maximum(s, t).topk(3, -1).indices, s, t)),
    "teacher_topk_tail": lambda s, t, x: _topk_tail(s, t),
    "teacher_topk_renorm": lambda s, t, x: _kl(*_on(t.topk(TOP_K, -1).indices, s, t)),
    "reverse_kl_pg": lambda s, t, x: (s - t).gather(-1, x[:, None])[:, 0],
    "sampled_reverse_kl": lambda s, t, x: (s - t).gather(-1, x[:, None])[:, 0],
    "masked_nll": lambda s, t, x: -s.gather(-1, x[:, None])[:, 0],
}


def test_every_loss_has_a_plain_statement() -> None:
    assert OURS.keys() == PLAIN.keys()


@given(
    name=st.sampled_from(sorted(OURS)),
    temperature=st.floats(0.5, 4.0),
    seed=st.integers(0, 10_000),
)
def test_every_loss_at_temperature_t_is_its_plain_statement_on_the_t_distributions(
    name: str, temperature: float, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(TOKENS, VOCAB, generator=generator)
    teacher = torch.randn(TOKENS, VOCAB, generator=generator)
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    ours = OURS[name](student, teacher, ids, temperature)
    # the convention in one line: temperature T is the same loss of the logits divided by T
    at_one = OURS[name](student / temperature, teacher / temperature, ids, 1.0)
    assert torch.allclose(ours, at_one, rtol=1e-4, atol=1e-5)
    s = torch.log_softmax(student.double() / temperature, -1)
    t = torch.log_softmax(teacher.double() / temperature, -1)
    expected = torch.where(MASK, PLAIN[name](s, t, ids), 0.0).float()
    assert torch.allclose(ours, expected, rtol=1e-4, atol=1e-5), (ours, expected)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_the_full_distribution_reverse_kls_agree_in_scale_with_the_sampled_estimator(
    temperature: float,
) -> None:
    """The sampled k_t, averaged over x ~ p_S (every outcome enumerated), equals each
    full-distribution reverse KL at the same T: the forms are interchangeable."""
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(1, VOCAB, generator=generator) * 2
    teacher = torch.randn(1, VOCAB, generator=generator) * 2
    outcomes = torch.arange(VOCAB)
    every = torch.ones(VOCAB, dtype=torch.bool)
    s = token_logprobs(student.expand(VOCAB, VOCAB), outcomes, temperature=temperature)
    t = token_logprobs(teacher.expand(VOCAB, VOCAB), outcomes, temperature=temperature)
    expected_k_t = float((s.exp() * sampled_reverse_kl(s, t, every).per_token).sum())
    one = torch.ones(1, dtype=torch.bool)
    ids = torch.arange(VOCAB)[None]
    teacher_logprobs = torch.log_softmax(teacher / temperature, -1)
    full = {
        "topk_shared": topk_shared_support_kl(student, teacher, one, VOCAB, temperature),
        "teacher_topk": teacher_topk_kl(student, ids, teacher_logprobs, one, temperature),
        "jsd_beta1": generalized_jsd(student, teacher, one, 1.0, temperature),
    }
    for name, loss in full.items():
        assert float(loss.per_token[0]) == pytest.approx(expected_k_t, rel=1e-4), name
