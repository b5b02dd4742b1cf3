"""Token-level losses of every recipe, as backend-agnostic functions of tensors.

Inputs are flat over tokens: log-probs and masks are [N]; logits are [N, V] (or this
rank's [N, V/TP] rows with `shard=VocabShard(group, start, real_vocab_size)`; see
`slime_ext.vocab_parallel`). Each loss returns a `TokenLoss`: the per-token value [N],
exactly 0 (with 0 gradient) where mask is 0, and detached scalar metrics. Callers choose
the reduction; `per_trajectory_mean` and `outcome_routed` implement DESIGN.md invariant 7.

Conventions (REFERENCE.md): log-softmax in fp32; temperatures explicit and the same on
both sides of a KL; the teacher side is never differentiated.

Temperature: every loss is the divergence between the temperature-T distributions
themselves, with no T^2 factor: a loss of logits z at temperature T equals the same loss
of z / T at temperature 1, and the losses of log-probs take them at T (`token_logprobs`).
T is the rollout's sampling temperature, not a softening knob: the sampled estimator k_t
(slime's OPD, tinker-cookbook) estimates exactly KL(p_S^T || p_T^T), and the
full-distribution forms (`teacher_topk_kl`, `topk_shared_support_kl`, `generalized_jsd`
at beta 1) are lower-variance alternatives of that same quantity, interchangeable through
`opd_loss` and `oprd_failure_loss` only if they share its scale; TRL's GKD and OPSD apply
no factor either. Hinton's T^2 makes up for gradients shrinking as 1/T^2 when soft targets
at T > 1 are mixed with hard labels at T = 1; here every term, OPRD's success NLL
included, is taken at the same T. OPRD's paper writes T^2 * KL for its failure branch
(REFERENCE.md): at T != 1 that is our loss with lambda_- scaled by T^2.

Masked rows: every input row whose mask is 0 is replaced by a finite constant before any
math (`keep_valid_rows`, inside the chunked kernels too), so it may hold NaN or inf and
still gives exactly 0 with exactly 0 gradient, sharded or not, chunked or fused.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from slime_ext.vocab_parallel import (
    VocabShard,
    apply_chunked,
    gather_ids,
    keep_valid_rows,
    log_softmax,
    sum_across_shards,
    topk_ids,
)


class TokenLoss(NamedTuple):
    per_token: Tensor
    """[N]: the loss (or estimator) at each token; 0 where the mask is 0."""
    metrics: dict[str, Tensor]
    """Detached scalars, named as they are logged."""


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over positions where mask is set; 0 when none is."""
    valid = mask.bool()
    total = torch.where(valid, values.float(), torch.zeros((), device=values.device)).sum()
    return total / valid.sum().clamp(min=1)


def sampled_reverse_kl(
    student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor
) -> TokenLoss:
    """k_t = s(x_t) - t(x_t) on each sampled token: an unbiased estimate of KL(p_S || p_T)
    when x_t ~ p_S. A metric and an advantage, not a trainable loss (its expected gradient
    is 0); train with `reverse_kl_pg_loss`."""
    valid = mask.bool()
    student = keep_valid_rows(student_logprobs.detach().float(), valid)
    teacher = keep_valid_rows(teacher_logprobs.detach().float(), valid)
    k_t = student - teacher
    return TokenLoss(
        k_t,
        {
            "opd_reverse_kl": masked_mean(k_t, valid),
            "student_gt_teacher_frac": masked_mean((student > teacher).float(), valid),
        },
    )


def discounted_future_sum(values: Tensor, owners: Tensor, discount: float) -> Tensor:
    """[N] -> [N]: at each token, the sum over the same owner's tokens from it onwards of
    discount^(distance) * value (tokens in order within an owner, as every batch here lays
    out a trajectory's spans). discount 0 returns `values`."""
    if discount == 0.0 or values.numel() == 0:
        return values
    flat = values.detach().double().tolist()
    ids = owners.tolist()
    out = [0.0] * len(flat)
    running, owner = 0.0, None
    for index in range(len(flat) - 1, -1, -1):
        if ids[index] != owner:
            running, owner = 0.0, ids[index]
        running = flat[index] + discount * running
        out[index] = running
    return torch.tensor(out, dtype=values.dtype, device=values.device)


def reverse_kl_pg_loss(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    old_logprobs: Tensor | None = None,
    clip: float | tuple[float, float] | None = None,
    kl_discount: float = 0.0,
    owners: Tensor | None = None,
) -> TokenLoss:
    """Policy-gradient form of the sampled reverse KL: advantage A_t = -k_t.

    Fresh samples (old_logprobs None): loss_t = stopgrad(k_t) * s(x_t) in gradient, whose
    expectation over x_t ~ p_S is the gradient of KL(p_S || p_T). Reused samples: k_t is
    taken under the sampling policy and the loss is -A_t * ratio_t with ratio_t =
    exp(s - old), PPO-clipped to [1 - clip, 1 + clip] (or [low, high]) when clip is set.
    The loss value at a fresh sample equals k_t.

    kl_discount gamma > 0 (tinker-cookbook's kl_discount_factor): A_t = -sum over the same
    trajectory's (`owners`) loss tokens s >= t, later turns included, of gamma^d * k_s, d
    the number of loss tokens from t to s (observations and masked turns do not count, so
    the per-turn-spans layout here and a whole-trajectory sample on slime agree): a token is
    also charged for the divergence it leads to. The metrics stay the plain k_t.
    """
    valid = mask.bool()
    student = keep_valid_rows(student_logprobs.float(), valid)
    teacher = keep_valid_rows(teacher_logprobs.detach().float(), valid)
    behaviour = (
        student.detach()
        if old_logprobs is None
        else keep_valid_rows(old_logprobs.detach().float(), valid)
    )
    advantage = teacher - behaviour
    metrics = {
        "opd_reverse_kl": masked_mean(-advantage, valid),
        "student_gt_teacher_frac": masked_mean((behaviour > teacher).float(), valid),
    }
    if kl_discount:
        if owners is None:
            raise ValueError("kl_discount needs each token's trajectory (owners)")
        rows = valid.nonzero().squeeze(-1)
        later = discounted_future_sum(advantage[rows], owners[rows], kl_discount)
        advantage = torch.zeros_like(advantage).index_put((rows,), later)
    ratio = torch.exp(student - behaviour)
    loss = -advantage * ratio
    if clip is not None:
        low, high = (1.0 - clip, 1.0 + clip) if isinstance(clip, (int, float)) else clip
        if not 0.0 <= low <= 1.0 <= high:
            raise ValueError(f"clip range must satisfy 0 <= low <= 1 <= high, got {low}, {high}")
        clipped = -advantage * ratio.clamp(low, high)
        metrics["pg_clipfrac"] = masked_mean((clipped > loss).float(), valid).detach()
        loss = torch.maximum(loss, clipped)
    metrics["ratio_mean"] = masked_mean(ratio.detach(), valid)
    return TokenLoss(keep_valid_rows(loss, valid), metrics)


def masked_nll(student_logprobs: Tensor, mask: Tensor) -> TokenLoss:
    """-log p_S(x_t) on loss-carrying tokens (SFT, SSD, OPRD's success branch)."""
    valid = mask.bool()
    nll = -keep_valid_rows(student_logprobs.float(), valid)
    return TokenLoss(nll, {"nll": masked_mean(nll.detach(), valid)})


def _renormalize(logprobs: Tensor) -> Tensor:
    return logprobs - torch.logsumexp(logprobs, dim=-1, keepdim=True)


def topk_shared_support_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor,
    k: int = 100,
    temperature: float = 1.0,
    *,
    shard: VocabShard | None = None,
    chunk_size: int | None = None,
) -> TokenLoss:
    """OPRD's failure branch: U = top-k ids by max(log p_S, log p_T); both renormalized on
    U; KL(p_S|U || stopgrad p_T|U) per token, without the paper's T^2 (module docstring)."""
    shard = shard or VocabShard()

    def kernel(student_chunk: Tensor, teacher_chunk: Tensor, valid_chunk: Tensor) -> Tensor:
        student = log_softmax(keep_valid_rows(student_chunk, valid_chunk), shard, temperature)
        teacher_chunk = keep_valid_rows(teacher_chunk.detach(), valid_chunk)
        teacher = log_softmax(teacher_chunk, shard, temperature)
        support = topk_ids(torch.maximum(student, teacher), k, shard)
        student_u = _renormalize(gather_ids(student, support, shard))
        teacher_u = _renormalize(gather_ids(teacher, support, shard))
        kl = (student_u.exp() * (student_u - teacher_u)).sum(dim=-1)
        return keep_valid_rows(kl, valid_chunk)

    per_token = apply_chunked(kernel, [student_logits, teacher_logits, mask.bool()], chunk_size)
    return TokenLoss(per_token, {"topk_kl": masked_mean(per_token.detach(), mask)})


def teacher_topk_kl(
    student_logits: Tensor,
    teacher_topk_ids: Tensor,
    teacher_topk_logprobs: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    tail: bool = True,
    *,
    tail_floor: float = 1e-8,
    logprob_floor: float = -100.0,
    shard: VocabShard | None = None,
    chunk_size: int | None = None,
) -> TokenLoss:
    """KL(p_S || p_T) against a teacher known only on its top-k ids ([N, k], global ids;
    log-probs computed at the same temperature, e.g. by the teacher server).

    tail=False renormalizes both sides on the top-k. tail=True keeps both unnormalized and
    adds one bucket for the rest of the mass on each side (floored at `tail_floor`: below
    it, 1 - sum of the top-k is fp32 rounding), so student mass outside the teacher's
    top-k is penalized.

    A teacher may give a token of its top-k probability 0 (log-prob -inf): the exact KL is
    then infinite wherever the student has mass there. Teacher log-probs count as at least
    `logprob_floor` (e^-100 is below fp32's smallest normal number: a top-k entry that low
    is, to the teacher, as good as 0): value and gradient stay finite, the penalty for
    student mass p_S there is p_S * (log p_S - logprob_floor), bounded whatever a teacher
    sends. A NaN on an unmasked row stays NaN (a real error, not a teacher's answer).
    """
    if not -math.inf < logprob_floor < 0.0:
        raise ValueError(f"logprob_floor must be finite and < 0, got {logprob_floor}")
    shard = shard or VocabShard()

    def kernel(
        student_chunk: Tensor, ids_chunk: Tensor, teacher_chunk: Tensor, valid_chunk: Tensor
    ) -> Tensor:
        student_chunk = keep_valid_rows(student_chunk, valid_chunk)
        ids_chunk = keep_valid_rows(ids_chunk, valid_chunk)
        teacher_k = keep_valid_rows(teacher_chunk.detach().float(), valid_chunk)
        teacher_k = teacher_k.clamp(min=logprob_floor)
        student_k = gather_ids(log_softmax(student_chunk, shard, temperature), ids_chunk, shard)
        if not tail:
            student_k, teacher_k = _renormalize(student_k), _renormalize(teacher_k)
        kl = (student_k.exp() * (student_k - teacher_k)).sum(dim=-1)
        if tail:
            student_rest = _log_rest(student_k, tail_floor)
            teacher_rest = _log_rest(teacher_k, tail_floor)
            kl = kl + student_rest.exp() * (student_rest - teacher_rest)
        return keep_valid_rows(kl, valid_chunk)

    tensors = [student_logits, teacher_topk_ids, teacher_topk_logprobs, mask.bool()]
    per_token = apply_chunked(kernel, tensors, chunk_size)
    return TokenLoss(per_token, {"teacher_topk_kl": masked_mean(per_token.detach(), mask)})


def _log_rest(topk_logprobs: Tensor, floor: float) -> Tensor:
    """log(1 - sum exp(topk_logprobs)), floored: the log-mass outside the top-k."""
    covered = torch.logsumexp(topk_logprobs, dim=-1).clamp(max=0.0)
    return torch.log((-torch.expm1(covered)).clamp(min=floor))


def generalized_jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor,
    beta: float,
    temperature: float = 1.0,
    clip: float | None = None,
    clip_mode: Literal["vocab", "token"] = "vocab",
    top_k: int | None = None,
    *,
    shard: VocabShard | None = None,
    chunk_size: int | None = None,
) -> TokenLoss:
    """Generalized JSD (TRL GKD/GOLD, OPSD): beta 0 = KL(T || S), 1 = KL(S || T), else
    beta * KL(T || M) + (1 - beta) * KL(S || M) with M = (1 - beta) P_S + beta P_T.

    clip_mode "vocab" clamps each vocabulary entry's term at `clip` (what OPSD's released
    jsd_token_clip does); "token" clamps the per-token divergence (what its docs describe).
    Clamped terms get no gradient. top_k renormalizes both sides on the teacher's top-k.
    Metrics: kl_true (unclipped divergence), kl_discarded (removed by clipping),
    clipped_per_token (entries, or 0/1 in token mode), and kl_true percentiles.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if clip_mode not in ("vocab", "token"):
        raise ValueError(f"clip_mode must be 'vocab' or 'token', got {clip_mode!r}")
    shard = shard or VocabShard()

    def kernel(student_chunk: Tensor, teacher_chunk: Tensor, valid_chunk: Tensor) -> Tensor:
        student = log_softmax(keep_valid_rows(student_chunk, valid_chunk), shard, temperature)
        teacher_chunk = keep_valid_rows(teacher_chunk.detach(), valid_chunk)
        teacher = log_softmax(teacher_chunk, shard, temperature)
        sum_vocab = lambda terms: sum_across_shards(terms.sum(dim=-1), shard)  # noqa: E731
        if top_k is not None:
            support = topk_ids(teacher, top_k, shard)
            student = _renormalize(gather_ids(student, support, shard))
            teacher = _renormalize(gather_ids(teacher, support, shard))
            sum_vocab = lambda terms: terms.sum(dim=-1)  # noqa: E731  (replicated on U)
        terms = _jsd_terms(student, teacher, beta)
        kl_true = sum_vocab(terms)
        if clip is None:
            loss, clipped = kl_true, torch.zeros_like(kl_true)
        elif clip_mode == "vocab":
            loss = sum_vocab(terms.clamp(max=clip))
            clipped = sum_vocab((terms.detach() > clip).float())
        else:
            loss = kl_true.clamp(max=clip)
            clipped = (kl_true.detach() > clip).float()
        columns = [loss, kl_true.detach(), clipped]
        return torch.stack([keep_valid_rows(c, valid_chunk) for c in columns], dim=-1)

    valid = mask.bool()
    out = apply_chunked(kernel, [student_logits, teacher_logits, valid], chunk_size)
    per_token, kl_true, clipped = out[:, 0], out[:, 1], out[:, 2]
    metrics = {
        "kl_true": masked_mean(kl_true, valid),
        "kl_discarded": masked_mean(kl_true - per_token.detach(), valid),
        "clipped_per_token": masked_mean(clipped, valid),
    }
    if valid.any():
        levels = torch.tensor([0.5, 0.9, 0.99], dtype=kl_true.dtype, device=kl_true.device)
        quantiles = torch.quantile(kl_true[valid], levels)
        metrics.update(kl_true_p50=quantiles[0], kl_true_p90=quantiles[1], kl_true_p99=quantiles[2])
    return TokenLoss(per_token, metrics)


def _jsd_terms(student: Tensor, teacher: Tensor, beta: float) -> Tensor:
    """Per-entry terms whose vocabulary sum is the generalized JSD."""
    if beta == 0.0:
        return teacher.exp() * (teacher - student)
    if beta == 1.0:
        return student.exp() * (student - teacher)
    mixture = torch.logaddexp(student + math.log(1.0 - beta), teacher + math.log(beta))
    return beta * teacher.exp() * (teacher - mixture) + (1.0 - beta) * student.exp() * (
        student - mixture
    )


def trajectory_token_weights(
    mask: Tensor, trajectory_index: Tensor, num_trajectories: int | None = None
) -> Tensor:
    """Per-token weights w with sum(loss * w) = mean over trajectories of each one's
    token-mean loss (invariant 7). A trajectory with no loss tokens contributes 0 and still
    counts in the mean. Compute over the whole batch; any slice of tokens (a micro-batch,
    a CP rank) then reduces to its exact share by sum(loss[slice] * w[slice])."""
    valid = mask.float()
    if num_trajectories is None:
        num_trajectories = int(trajectory_index.max()) + 1 if trajectory_index.numel() else 0
    counts = torch.zeros(num_trajectories, device=mask.device).index_add_(
        0, trajectory_index, valid
    )
    return valid / counts[trajectory_index].clamp(min=1.0) / max(num_trajectories, 1)


def weighted_sum(per_token_loss: Tensor, weights: Tensor) -> Tensor:
    """sum(loss * w), with 0-weight tokens contributing exactly 0 (even if loss is not
    finite there) and the result connected to the graph even when every weight is 0."""
    kept = torch.where(weights != 0, per_token_loss, torch.zeros_like(per_token_loss))
    return (kept * weights).sum()


def per_trajectory_mean(
    per_token_loss: Tensor,
    mask: Tensor,
    trajectory_index: Tensor,
    num_trajectories: int | None = None,
) -> Tensor:
    """Token-mean per trajectory over all its turns, then mean over trajectories."""
    weights = trajectory_token_weights(mask, trajectory_index, num_trajectories)
    return weighted_sum(per_token_loss, weights)


def outcome_routed_weights(
    mask: Tensor,
    trajectory_index: Tensor,
    success: Tensor,
    lambda_pos: float = 1.0,
    lambda_neg: float = 1.0,
    failure_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token weights (success branch, failure branch) for OPRD's routing: each branch
    is the mean over its trajectories of their token-mean loss, scaled by its lambda; an
    absent branch has all-zero weights. `success` is [num_trajectories] bool. The failure
    branch counts its tokens by `failure_mask` when given (a KL may train on turns that
    imitation masks, invariant 4), else by `mask`."""
    num_trajectories = success.shape[0]
    success = success.bool()
    token_success = success[trajectory_index]
    n_pos = max(int(success.sum()), 1)
    n_neg = max(int((~success).sum()), 1)

    def token_mean(branch_mask: Tensor) -> Tensor:
        weights = trajectory_token_weights(branch_mask, trajectory_index, num_trajectories)
        return weights * num_trajectories  # undo the mean over all trajectories

    pos = token_mean(mask)
    neg = pos if failure_mask is None else token_mean(failure_mask)
    zero = torch.zeros_like(pos)
    w_pos = torch.where(token_success, pos * (lambda_pos / n_pos), zero)
    w_neg = torch.where(token_success, zero, neg * (lambda_neg / n_neg))
    return w_pos, w_neg


def outcome_routed(
    success_loss: Tensor,
    failure_loss: Tensor,
    mask: Tensor,
    trajectory_index: Tensor,
    success: Tensor,
    lambda_pos: float = 1.0,
    lambda_neg: float = 1.0,
    failure_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """L = lambda_+ L_+ + lambda_- L_-: success trajectories train on `success_loss` (e.g.
    masked NLL), failure trajectories on `failure_loss` (e.g. top-k shared-support KL)."""
    w_pos, w_neg = outcome_routed_weights(
        mask, trajectory_index, success, lambda_pos, lambda_neg, failure_mask
    )
    loss_pos = weighted_sum(success_loss, w_pos)
    loss_neg = weighted_sum(failure_loss, w_neg)
    metrics = {
        "success_branch_loss": loss_pos.detach() / lambda_pos if lambda_pos else loss_pos.detach(),
        "failure_branch_loss": loss_neg.detach() / lambda_neg if lambda_neg else loss_neg.detach(),
        "success_trajectories": success.bool().sum().float(),
        "failure_trajectories": (~success.bool()).sum().float(),
    }
    return loss_pos + loss_neg, metrics
