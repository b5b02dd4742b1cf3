from __future__ import annotations

import math
import os
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from slime_ext.losses import (
    generalized_jsd,
    masked_nll,
    outcome_routed,
    outcome_routed_weights,
    per_trajectory_mean,
    reverse_kl_pg_loss,
    sampled_reverse_kl,
    teacher_topk_kl,
    topk_shared_support_kl,
    trajectory_token_weights,
    weighted_sum,
)
from slime_ext.vocab_parallel import VocabShard, fused_lm_head, token_logprobs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _logits(n: int, v: int, seed: int, scale: float = 3.0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=generator) * scale


def exact_kl(p_logits: Tensor, q_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(p || q) per row, computed directly in float64 (an independent reference)."""
    p = torch.log_softmax(p_logits.double() / temperature, dim=-1)
    q = torch.log_softmax(q_logits.double() / temperature, dim=-1)
    return (p.exp() * (p - q)).sum(dim=-1).float()


FULL_LOSSES: dict[str, Callable[..., Tensor]] = {
    "jsd_beta0": lambda s, t, m: generalized_jsd(s, t, m, beta=0.0).per_token,
    "jsd_beta0.3": lambda s, t, m: generalized_jsd(s, t, m, beta=0.3).per_token,
    "jsd_beta1": lambda s, t, m: generalized_jsd(s, t, m, beta=1.0).per_token,
    "jsd_top_k": lambda s, t, m: generalized_jsd(s, t, m, beta=0.5, top_k=4).per_token,
    "topk_shared": lambda s, t, m: topk_shared_support_kl(s, t, m, k=4, temperature=1.5).per_token,
    "teacher_topk_tail": lambda s, t, m: (
        teacher_topk_kl(
            s, *torch.log_softmax(t.float(), -1).topk(4, dim=-1)[::-1], m, tail=True
        ).per_token
    ),
    "teacher_topk_renorm": lambda s, t, m: (
        teacher_topk_kl(
            s, *torch.log_softmax(t.float(), -1).topk(4, dim=-1)[::-1], m, tail=False
        ).per_token
    ),
}


@given(
    seed=st.integers(0, 10_000),
    scale=st.floats(0.1, 8.0),
    name=st.sampled_from(sorted(FULL_LOSSES)),
)
def test_full_distribution_kls_are_zero_on_identical_and_nonnegative(
    seed: int, scale: float, name: str
) -> None:
    student, teacher = _logits(6, 11, seed, scale), _logits(6, 11, seed + 1, scale)
    mask = torch.ones(6, dtype=torch.bool)
    loss = FULL_LOSSES[name]
    assert torch.all(loss(student, teacher, mask) >= -1e-6)
    assert torch.allclose(loss(student, student.clone(), mask), torch.zeros(6), atol=1e-5)


def test_sampled_estimator_is_unbiased_and_pg_gradient_matches_exact_kl() -> None:
    """Enumerate every outcome on a 5-token vocabulary."""
    student_logits = _logits(1, 5, seed=0)[0].requires_grad_()
    teacher_logits = _logits(1, 5, seed=1)[0]
    student = torch.log_softmax(student_logits, dim=-1)
    teacher = torch.log_softmax(teacher_logits, dim=-1)
    outcomes = torch.arange(5)
    prob = student.exp().detach()
    mask = torch.ones(5, dtype=torch.bool)

    k_t = sampled_reverse_kl(student[outcomes], teacher[outcomes], mask).per_token
    exact = exact_kl(student_logits[None], teacher_logits[None])[0]
    assert float((prob * k_t).sum()) == pytest.approx(float(exact), abs=1e-6)

    (exact_grad,) = torch.autograd.grad(exact, student_logits, retain_graph=True)
    for old in (None, student[outcomes].detach()):
        pg = reverse_kl_pg_loss(student[outcomes], teacher[outcomes], mask, old_logprobs=old)
        (expected_grad,) = torch.autograd.grad(
            (prob * pg.per_token).sum(), student_logits, retain_graph=True
        )
        assert torch.allclose(expected_grad, exact_grad, atol=1e-6)
    # minimizing k_t directly has zero expected gradient: why the pg form exists
    (naive_grad,) = torch.autograd.grad((prob * (student - teacher)).sum(), student_logits)
    assert torch.allclose(naive_grad, torch.zeros(5), atol=1e-6)


def test_sampled_metrics() -> None:
    student = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    teacher = torch.tensor([-1.5, -1.0, -0.5, -9.0])
    mask = torch.tensor([True, True, True, False])
    result = sampled_reverse_kl(student, teacher, mask)
    assert result.per_token.tolist() == pytest.approx([0.5, -1.0, 0.0, 0.0])
    assert float(result.metrics["opd_reverse_kl"]) == pytest.approx(-0.5 / 3)
    assert float(result.metrics["student_gt_teacher_frac"]) == pytest.approx(1 / 3)


def test_pg_loss_value_is_k_t_and_clipping_stops_gradient() -> None:
    student = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    teacher = torch.tensor([-2.0, -2.0, 0.0])
    old = torch.tensor([-1.0, -0.5, -1.5])  # ratios 1, e^-0.5, e^0.5
    mask = torch.ones(3, dtype=torch.bool)
    fresh = reverse_kl_pg_loss(student, teacher, mask)
    assert fresh.per_token.tolist() == pytest.approx([1.0, 1.0, -1.0])
    clipped = reverse_kl_pg_loss(student, teacher, mask, old_logprobs=old, clip=0.2)
    clipped.per_token.sum().backward()
    assert student.grad is not None
    # token 0: inside the range, gradient = k_t * ratio = (old - teacher) = 1
    # token 1: advantage < 0 and ratio < 0.8: clipped, no gradient
    # token 2: advantage > 0 (teacher prefers it) and ratio > 1.2: clipped, no gradient
    assert student.grad.tolist() == pytest.approx([1.0, 0.0, 0.0])
    assert float(clipped.metrics["pg_clipfrac"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="clip range"):
        reverse_kl_pg_loss(student, teacher, mask, old_logprobs=old, clip=(1.1, 1.2))


@given(
    st.lists(
        st.tuples(st.floats(-5, 0), st.floats(-5, 0), st.booleans(), st.integers(0, 2)),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([0.0, 0.5, 0.9]),
)
def test_kl_discount_charges_each_token_for_its_trajectorys_later_loss_tokens(
    rows: list[tuple[float, float, bool, int]], gamma: float
) -> None:
    rows = sorted(rows, key=lambda row: row[3])  # a trajectory's tokens are contiguous
    student = torch.tensor([r[0] for r in rows], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    mask = torch.tensor([r[2] for r in rows])
    owners = torch.tensor([r[3] for r in rows])
    result = reverse_kl_pg_loss(student, teacher, mask, kl_discount=gamma, owners=owners)
    result.per_token.sum().backward()
    assert student.grad is not None
    for t, (s_t, _, valid, owner) in enumerate(rows):
        if not valid:
            assert result.per_token[t] == 0 and student.grad[t] == 0
            continue
        later = [r for r in rows[t:] if r[2] and r[3] == owner]  # loss tokens from t on
        charged = sum(gamma**d * (r[0] - r[1]) for d, r in enumerate(later))
        # a fresh sample: the value is the advantage's negative, the gradient too
        assert float(result.per_token[t]) == pytest.approx(charged, rel=1e-5, abs=1e-5)
        assert float(student.grad[t]) == pytest.approx(charged, rel=1e-5, abs=1e-5)
        del s_t
    plain = reverse_kl_pg_loss(student, teacher, mask)  # the metrics stay k_t's
    assert float(result.metrics["opd_reverse_kl"]) == pytest.approx(
        float(plain.metrics["opd_reverse_kl"])
    )
    if gamma:
        with pytest.raises(ValueError, match="owners"):
            reverse_kl_pg_loss(student, teacher, mask, kl_discount=gamma)


def _masked_rows_check(loss_fn: Callable[[Tensor, Tensor], Tensor]) -> None:
    student = _logits(6, 9, seed=3).requires_grad_()
    mask = torch.tensor([True, False, True, False, True, True])
    per_token = loss_fn(student, mask)
    assert torch.all(per_token[~mask] == 0)
    per_token.sum().backward()
    assert student.grad is not None
    assert torch.all(student.grad[~mask] == 0)
    assert torch.any(student.grad[mask] != 0)


@pytest.mark.parametrize("name", sorted(FULL_LOSSES))
def test_full_losses_give_exactly_zero_gradient_at_masked_positions(name: str) -> None:
    teacher = _logits(6, 9, seed=4)
    _masked_rows_check(lambda s, m: FULL_LOSSES[name](s, teacher, m))


@pytest.mark.parametrize("name", ["pg", "pg_clip", "nll"])
def test_token_losses_give_exactly_zero_gradient_at_masked_positions(name: str) -> None:
    teacher = torch.full((6,), -2.0)
    teacher[1] = float("-inf")  # garbage where masked must not leak
    ids = torch.arange(6)

    def loss(student_logits: Tensor, mask: Tensor) -> Tensor:
        student = token_logprobs(student_logits, ids)
        if name == "nll":
            return masked_nll(student, mask).per_token
        old = student.detach() + 0.1 if name == "pg_clip" else None
        clip = 0.2 if name == "pg_clip" else None
        return reverse_kl_pg_loss(student, teacher, mask, old_logprobs=old, clip=clip).per_token

    _masked_rows_check(loss)


CHUNKABLE: dict[str, Callable[..., Tensor]] = {
    "token_logprobs": lambda s, t, m, c: token_logprobs(
        s, torch.arange(s.shape[0]) % 7, temperature=0.7, chunk_size=c
    ),
    "jsd_vocab_clip": lambda s, t, m, c: (
        generalized_jsd(s, t, m, 0.5, clip=0.05, chunk_size=c).per_token
    ),
    "jsd_token_clip": lambda s, t, m, c: (
        generalized_jsd(s, t, m, 0.0, clip=0.5, clip_mode="token", chunk_size=c).per_token
    ),
    "topk_shared": lambda s, t, m, c: topk_shared_support_kl(s, t, m, k=5, chunk_size=c).per_token,
    "teacher_topk": lambda s, t, m, c: (
        teacher_topk_kl(
            s, *torch.log_softmax(t.float(), -1).topk(5, dim=-1)[::-1], m, chunk_size=c
        ).per_token
    ),
}


@pytest.mark.parametrize("name", sorted(CHUNKABLE))
def test_chunked_equals_unchunked(name: str) -> None:
    teacher = _logits(10, 13, seed=6)
    mask = torch.tensor([True] * 7 + [False, True, True])
    results = []
    for chunk in (None, 3):
        student = _logits(10, 13, seed=5).requires_grad_()
        value = CHUNKABLE[name](student, teacher, mask, chunk)
        (value * torch.linspace(0.5, 1.5, 10)).sum().backward()
        results.append((value.detach(), student.grad))
    (value_a, grad_a), (value_b, grad_b) = results
    assert torch.allclose(value_a, value_b, atol=1e-6)
    assert grad_a is not None and grad_b is not None
    assert torch.allclose(grad_a, grad_b, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.0])
def test_top_k_over_the_whole_vocabulary_equals_the_full_kl(temperature: float) -> None:
    student, teacher = _logits(5, 8, seed=7), _logits(5, 8, seed=8)
    mask = torch.ones(5, dtype=torch.bool)
    reverse = exact_kl(student, teacher, temperature)
    shared = topk_shared_support_kl(student, teacher, mask, k=8, temperature=temperature)
    assert torch.allclose(shared.per_token, reverse, atol=1e-5)
    teacher_logprobs = torch.log_softmax(teacher / temperature, dim=-1)
    ids = torch.arange(8).expand(5, 8)
    for tail in (True, False):
        topk = teacher_topk_kl(student, ids, teacher_logprobs, mask, temperature, tail=tail)
        assert torch.allclose(topk.per_token, reverse, atol=1e-5)
    jsd = generalized_jsd(student, teacher, mask, beta=1.0, temperature=temperature, top_k=8)
    assert torch.allclose(jsd.per_token, reverse, atol=1e-5)


def test_hand_computed_temperature_case() -> None:
    # two tokens; student logits (0, 2), teacher (0, 0); at T = 2 the student is
    # softmax(0, 1) = (1, e) / (1 + e) and the teacher is uniform.
    p1 = math.e / (1 + math.e)
    p0 = 1 - p1
    reverse = p0 * math.log(p0 / 0.5) + p1 * math.log(p1 / 0.5)
    forward = 0.5 * math.log(0.5 / p0) + 0.5 * math.log(0.5 / p1)
    student, teacher = torch.tensor([[0.0, 2.0]]), torch.tensor([[0.0, 0.0]])
    mask = torch.ones(1, dtype=torch.bool)
    assert float(generalized_jsd(student, teacher, mask, 1.0, 2.0).per_token) == pytest.approx(
        reverse, rel=1e-6
    )
    assert float(generalized_jsd(student, teacher, mask, 0.0, 2.0).per_token) == pytest.approx(
        forward, rel=1e-6
    )
    assert float(topk_shared_support_kl(student, teacher, mask, 2, 2.0).per_token) == (
        pytest.approx(reverse, rel=1e-6)
    )
    assert float(token_logprobs(student, torch.tensor([1]), temperature=2.0)) == pytest.approx(
        math.log(p1), rel=1e-6
    )


def test_tail_bucket_penalizes_mass_outside_the_teachers_top_k() -> None:
    # the student puts most mass on token 3, outside the teacher's top-2 {0, 1}; on {0, 1}
    # the two agree after renormalization, so only the tail bucket sees the difference.
    student = torch.log(torch.tensor([[0.1, 0.1, 0.0001, 0.7999]]))
    teacher_ids = torch.tensor([[0, 1]])
    teacher_logprobs = torch.log(torch.tensor([[0.495, 0.495]]))
    mask = torch.ones(1, dtype=torch.bool)
    renorm = teacher_topk_kl(student, teacher_ids, teacher_logprobs, mask, tail=False)
    with_tail = teacher_topk_kl(student, teacher_ids, teacher_logprobs, mask, tail=True)
    assert float(renorm.per_token) == pytest.approx(0.0, abs=1e-6)
    expected = 0.2 * math.log(0.1 / 0.495) + 0.8 * math.log(0.8 / 0.01)
    assert float(with_tail.per_token) == pytest.approx(expected, rel=1e-4)


def test_jsd_clip_modes_and_diagnostics() -> None:
    student = torch.tensor([[2.0, 0.0, -2.0], [0.0, 0.0, 0.0]], requires_grad=True)
    teacher = torch.tensor([[-2.0, 0.0, 4.0], [0.0, 0.0, 0.0]])
    mask = torch.ones(2, dtype=torch.bool)
    true_kl = exact_kl(teacher, student)  # forward KL(T || S)
    teacher_p = torch.softmax(teacher, -1)
    terms = teacher_p * (torch.log_softmax(teacher, -1) - torch.log_softmax(student.detach(), -1))

    vocab = generalized_jsd(student, teacher, mask, beta=0.0, clip=0.05)
    assert torch.allclose(vocab.per_token, terms.clamp(max=0.05).sum(-1), atol=1e-6)
    assert float(vocab.metrics["kl_true"]) == pytest.approx(float(true_kl.mean()), rel=1e-5)
    discarded = float((true_kl - terms.clamp(max=0.05).sum(-1)).mean())
    assert float(vocab.metrics["kl_discarded"]) == pytest.approx(discarded, rel=1e-5)
    assert float(vocab.metrics["clipped_per_token"]) == pytest.approx(
        float((terms > 0.05).sum()) / 2
    )

    token = generalized_jsd(student, teacher, mask, beta=0.0, clip=1.0, clip_mode="token")
    assert token.per_token.tolist() == pytest.approx([1.0, 0.0], abs=1e-6)
    token.per_token.sum().backward()
    assert student.grad is not None and torch.all(student.grad[0] == 0)
    assert float(token.metrics["clipped_per_token"]) == pytest.approx(0.5)
    assert {"kl_true_p50", "kl_true_p90", "kl_true_p99"} <= set(token.metrics)


def test_argument_errors_are_explained() -> None:
    logits = _logits(2, 4, seed=0)
    mask = torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(logits, logits, mask, beta=1.5)
    with pytest.raises(ValueError, match="clip_mode"):
        generalized_jsd(logits, logits, mask, beta=0.5, clip=1.0, clip_mode="row")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        topk_shared_support_kl(logits, logits, mask, k=5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(logits, torch.tensor([0, 1]), temperature=0.0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_generalized_jsd_matches_trl(beta: float, temperature: float) -> None:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDTrainer

    student, teacher = _logits(12, 17, seed=9).float(), _logits(12, 17, seed=10).float()
    labels = torch.randint(0, 17, (12,), generator=torch.Generator().manual_seed(0))
    labels[[2, 5, 6]] = -100
    trl = GKDTrainer.generalized_jsd_loss(
        student[None], teacher[None], labels=labels[None], beta=beta, temperature=temperature
    )
    ours = generalized_jsd(student, teacher, labels != -100, beta=beta, temperature=temperature)
    assert float(ours.per_token.sum()) / 9 == pytest.approx(float(trl), abs=1e-5)


def test_token_logprobs_ignore_padding_rows() -> None:
    logits = _logits(4, 10, seed=11)
    ids = torch.tensor([0, 3, 6, 2])
    padded = token_logprobs(logits, ids, shard=VocabShard(real_vocab_size=7))
    reference = torch.log_softmax(logits[:, :7], dim=-1).gather(-1, ids[:, None])[:, 0]
    assert torch.allclose(padded, reference.float(), atol=1e-6)


def test_fused_path_equals_logits_path() -> None:
    generator = torch.Generator().manual_seed(12)
    hidden = torch.randn(9, 6, generator=generator, requires_grad=True)
    weight = torch.randn(11, 6, generator=generator, requires_grad=True)
    teacher = _logits(9, 11, seed=13)
    mask = torch.ones(9, dtype=torch.bool)

    fused = fused_lm_head(
        lambda lg, tc, vl: generalized_jsd(lg, tc, vl, 0.5).per_token,
        hidden,
        weight,
        [teacher, mask],
        chunk_size=4,
    )
    fused.sum().backward()
    fused_grads = (hidden.grad.clone(), weight.grad.clone())  # type: ignore[union-attr]
    hidden.grad, weight.grad = None, None
    plain = generalized_jsd(hidden @ weight.t(), teacher, mask, 0.5).per_token
    plain.sum().backward()
    assert torch.allclose(fused, plain, atol=1e-6)
    assert torch.allclose(fused_grads[0], hidden.grad, atol=1e-6)  # type: ignore[arg-type]
    assert torch.allclose(fused_grads[1], weight.grad, atol=1e-6)  # type: ignore[arg-type]


def test_per_trajectory_mean_by_hand() -> None:
    loss = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0, 7.0], requires_grad=True)
    mask = torch.tensor([True, True, True, True, False, False])
    index = torch.tensor([0, 0, 0, 1, 1, 2])
    # trajectory 0: mean 2; trajectory 1: 4 (its masked 100 left out); 2: no tokens, counts 0
    value = per_trajectory_mean(loss, mask, index)
    assert float(value) == pytest.approx((2 + 4 + 0) / 3)
    value.backward()
    assert loss.grad is not None
    assert loss.grad.tolist() == pytest.approx([1 / 9, 1 / 9, 1 / 9, 1 / 3, 0, 0])
    assert float(per_trajectory_mean(loss, mask, index, num_trajectories=4)) == pytest.approx(6 / 4)


@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.booleans(), st.floats(-5, 5)), min_size=1, max_size=30
    ),
    st.integers(1, 30),
)
def test_micro_batches_reduce_to_the_batch_loss(
    rows: list[tuple[int, bool, float]], split: int
) -> None:
    index = torch.tensor([r[0] for r in rows])
    mask = torch.tensor([r[1] for r in rows])
    loss = torch.tensor([r[2] for r in rows])
    weights = trajectory_token_weights(mask, index, num_trajectories=5)
    parts = [
        weighted_sum(loss[i : i + split], weights[i : i + split])
        for i in range(0, len(rows), split)
    ]
    whole = per_trajectory_mean(loss, mask, index, num_trajectories=5)
    assert float(sum(parts)) == pytest.approx(float(whole), rel=1e-5, abs=1e-6)


def test_all_masked_batch_is_a_connected_zero() -> None:
    loss = torch.tensor([float("nan"), 2.0], requires_grad=True)
    value = per_trajectory_mean(loss, torch.tensor([False, False]), torch.tensor([0, 1]))
    assert float(value) == 0.0
    value.backward()
    assert loss.grad is not None and loss.grad.tolist() == [0.0, 0.0]


def test_outcome_routing_by_hand() -> None:
    nll = torch.tensor([1.0, 3.0, 5.0, 9.0, 9.0], requires_grad=True)
    kl = torch.tensor([9.0, 9.0, 9.0, 2.0, 4.0], requires_grad=True)
    index = torch.tensor([0, 0, 1, 2, 2])
    mask = torch.ones(5, dtype=torch.bool)
    success = torch.tensor([True, True, False])
    loss, metrics = outcome_routed(nll, kl, mask, index, success, lambda_pos=1.0, lambda_neg=0.5)
    # success branch: mean(mean(1, 3), mean(5)) = 3.5; failure: mean(2, 4) = 3, * 0.5
    assert float(loss) == pytest.approx(3.5 + 1.5)
    assert float(metrics["success_branch_loss"]) == pytest.approx(3.5)
    assert float(metrics["failure_branch_loss"]) == pytest.approx(3.0)
    w_pos, w_neg = outcome_routed_weights(mask, index, success, 1.0, 0.5)
    assert w_pos.tolist() == pytest.approx([0.25, 0.25, 0.5, 0, 0])
    assert w_neg.tolist() == pytest.approx([0, 0, 0, 0.25, 0.25])


def test_absent_branch_contributes_zero_and_stays_connected() -> None:
    nll = torch.tensor([1.0, 3.0], requires_grad=True)
    kl = torch.tensor([float("inf"), 5.0], requires_grad=True)
    loss, _ = outcome_routed(
        nll, kl, torch.ones(2, dtype=torch.bool), torch.tensor([0, 1]), torch.tensor([True, True])
    )
    assert float(loss) == pytest.approx(2.0)
    loss.backward()
    assert kl.grad is not None and kl.grad.tolist() == [0.0, 0.0]
