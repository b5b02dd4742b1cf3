"""The custom loss slime calls per micro-batch: `slime_ext.losses` under slime's conventions.

    --loss-type custom_loss --custom-loss-function-path slime_ext.slime.loss.loss

slime calls `loss(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)`
(slime/backends/megatron_utils/loss.py, loss_function). What that means here:
- logits are this rank's [1, T_local, V/TP] fp32 rows, raw: divided by
  --rollout-temperature here, as slime's own log-prob path does;
- samples are packed one after another, each CP-sliced in the zigzag layout (`cp.py`);
- teacher_log_probs, rollout_log_probs and advantages arrive CP-sliced already (the actor
  slices them): they are used as they are; loss_masks arrive whole and are sliced here;
- `sum_of_sample_mean` divides each sample's sum by its rollout's loss-token count (all
  turns of one trajectory share a rollout_id), and slime then averages over rollouts:
  the per-trajectory normalization of DESIGN.md invariant 7;
- a rank whose slices are all empty returns a zero still connected to the logits.

The teacher's signal: its log-prob of each sampled token (teacher_log_probs, slime's own
key) always; its top-k per response token when the loss needs it (`algorithm.opd_loss`
topk_tail / topk_renorm, OPRD's `teacher_topk` failure loss), carried by
`slime_ext.slime.topk` and cut to this rank's positions here. OPRD routes each sample by
its trajectory's outcome, which reaches the loss as a signed branch share in `advantages`
(`slime_ext.slime.oprd`): successes train on the NLL (their loss masks are imitation
masks), failures on the sampled reverse KL in policy-gradient form or the KL to the
teacher's top-k (the shared-support KL needs both full distributions, which only the
local trainer has).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from slime_ext.job.config import JobConfig
from slime_ext.losses import (
    TokenLoss,
    masked_nll,
    reverse_kl_pg_loss,
    sampled_reverse_kl,
    teacher_topk_kl,
)
from slime_ext.slime.cp import ResponseSlice, response_slices
from slime_ext.slime.settings import Parallel, job_config, megatron_parallel
from slime_ext.slime.topk import rows_for
from slime_ext.vocab_parallel import VocabShard, keep_valid_rows, token_logprobs

METRICS = ("opd_reverse_kl", "student_gt_teacher_frac", "loss_tokens", "loss")
"""The keys every call returns (slime sums them across micro-batches by position, then
divides by the step's trajectories: "loss" is then the local trainer's train/loss)."""
TOPK_METRICS = ("teacher_topk_kl",)
"""A top-k loss's further key: the KL to the teacher's top-k, as the local trainer logs it."""
OPRD_METRICS = (
    "success_branch_loss",
    "failure_branch_loss",
    "opd_reverse_kl_success",
    "opd_reverse_kl_failure",
)
"""OPRD's further keys: each branch's mean over its trajectories (0 for a branch the step
lacks); the loss terms without their lambdas, as the local trainer logs them."""


class SlimeBatchError(ValueError):
    """The batch slime passed does not fit the recipe (a missing key, a length mismatch)."""


def loss(
    args: Any,
    batch: dict[str, Any],
    logits: Tensor,
    sum_of_sample_mean: Callable[[Tensor], Tensor],
) -> tuple[Tensor, dict[str, Tensor]]:
    job = job_config(args)
    topk = job.needs_teacher_topk
    parallel = megatron_parallel()
    if logits.dim() != 3 or logits.size(0) != 1:
        raise SlimeBatchError(f"logits must be [1, T_local, V/TP], got {tuple(logits.shape)}")
    rows = logits[0]
    slices = response_slices(
        list(batch["total_lengths"]),
        list(batch["response_lengths"]),
        parallel.cp_rank,
        parallel.cp_size,
    )
    count = sum(len(s.local_rows) for s in slices)
    if count == 0:
        # a short span can land wholly on another CP rank: stay in the graph
        zero = 0.0 * logits.sum()
        keys = METRICS + (OPRD_METRICS if job.algorithm.recipe == "oprd" else ())
        keys += TOPK_METRICS if topk else ()
        return zero, {key: zero.detach() for key in keys}
    row_index = torch.tensor([r for s in slices for r in s.local_rows], device=rows.device)
    targets = torch.cat(
        [
            _response(tokens, length)[torch.tensor(s.response_index, dtype=torch.long)]
            for tokens, length, s in zip(
                batch["unconcat_tokens"], batch["response_lengths"], slices, strict=True
            )
        ]
    ).to(rows.device)
    mask = _local(batch["loss_masks"], batch["response_lengths"], slices).bool()
    local_logits = rows[row_index]
    top = None
    if topk:
        top = TeacherTopK(job, args, parallel, local_logits, batch, slices)
    # a top-k loss reads the student's sampled-token log-prob for metrics only
    shard = _shard(parallel, args, local_logits.size(-1))
    with torch.no_grad() if topk and job.algorithm.recipe != "oprd" else nullcontext():
        student = token_logprobs(
            local_logits,
            targets,
            shard,
            temperature=_temperature(args),
            chunk_size=_chunk_size(args),
            mask=mask,  # every use of `student` is within the loss mask
        )
    recipe = job.algorithm.recipe
    # the old log-probs enter the sampled KL's ratio (OPD, OPSD) and OPRD's failure branch
    reads_old = recipe == "oprd" or (recipe in ("opd", "opsd") and top is None)
    old, clip = _old_logprobs(args, batch, slices) if reads_old else (None, None)
    if old is not None and _recomputed(args):
        old = old + _padding_shift(args, local_logits, targets, shard, mask, student)
    if recipe == "oprd":
        return _oprd_loss(
            job, args, batch, slices, student, mask, sum_of_sample_mean, (old, clip), top
        )
    result, kl = _recipe_loss(
        recipe,
        args,
        batch,
        slices,
        student,
        mask,
        (old, clip),
        top,
        job.algorithm.kl_discount,
    )
    # kl_coef weighs the KL to the teacher only, as in the local trainer
    coef = job.algorithm.kl_coef if kl is not None else 1.0
    total = sum_of_sample_mean(result.per_token * coef)
    if kl is None:
        zero = torch.zeros((), device=rows.device)
        kl_metric, above = zero, zero
    else:
        kl_metric = sum_of_sample_mean(kl.per_token).detach()
        above = sum_of_sample_mean(_above(kl, mask)).detach()
    metrics = {
        "opd_reverse_kl": kl_metric,
        "student_gt_teacher_frac": above,
        "loss_tokens": mask.sum().float().detach(),
        "loss": total.detach(),
    }
    if top is not None:
        metrics["teacher_topk_kl"] = sum_of_sample_mean(result.per_token.detach())
    return total, metrics


class TeacherTopK:
    """The KL to the teacher's top-k on this rank's response rows (`slime_ext.slime.topk`
    carries the rows; ids index the whole vocabulary, the TP shard gathers its own)."""

    def __init__(
        self,
        job: JobConfig,
        args: Any,
        parallel: Parallel,
        local_logits: Tensor,
        batch: dict[str, Any],
        slices: list[ResponseSlice],
    ) -> None:
        self.ids, self.logprobs = rows_for(
            batch, [s.response_index for s in slices], job.teacher.top_k, local_logits.device
        )
        vocab = real_vocab_size(args, local_logits.size(-1) * parallel.tp_size) or (
            local_logits.size(-1) * parallel.tp_size
        )
        if self.ids.numel() and (int(self.ids.min()) < 0 or int(self.ids.max()) >= vocab):
            # an id past the vocabulary would gather nothing: log-prob 0, probability 1
            raise SlimeBatchError(
                f"teacher top-k ids span [{int(self.ids.min())}, {int(self.ids.max())}] of "
                f"a vocabulary of {vocab}: the teacher serves another tokenizer"
            )
        self.logits = local_logits
        # OPRD's teacher_topk failure loss keeps the tail bucket, as the local trainer's
        self.tail = job.algorithm.recipe == "oprd" or job.algorithm.opd_loss == "topk_tail"
        self.shard = _shard(parallel, args, local_logits.size(-1))
        self.temperature = _temperature(args)
        self.chunk_size = _chunk_size(args)

    def kl(self, mask: Tensor) -> TokenLoss:
        """Per token KL(p_S || p_T on its top-k), tail bucket or renormalized (the job's
        loss); 0 off the mask."""
        return teacher_topk_kl(
            self.logits,
            self.ids,
            self.logprobs,
            mask,
            self.temperature,
            self.tail,
            shard=self.shard,
            chunk_size=self.chunk_size,
        )


def _recipe_loss(
    recipe: str,
    args: Any,
    batch: dict[str, Any],
    slices: list[ResponseSlice],
    student: Tensor,
    mask: Tensor,
    behaviour: tuple[Tensor | None, tuple[float, float] | None],
    top: TeacherTopK | None = None,
    kl_discount: float = 0.0,
) -> tuple[TokenLoss, TokenLoss | None]:
    """The per-token loss of the job's recipe, and the sampled reverse KL when a teacher
    scored the tokens (with a top-k loss: a metric, at the rollout's log-probs as the local
    trainer reports it). kl_discount: algorithm.kl_discount, over each sample's tokens."""
    if recipe in ("ssd", "sft"):
        return masked_nll(student, mask), None
    if recipe == "rl":
        advantages = keep_valid_rows(_sliced_given(batch, "advantages", slices), mask)
        per_token = -advantages * student  # 0 off the mask: student is 0 there
        return TokenLoss(per_token, {}), None
    teacher = _sliced_given(batch, "teacher_log_probs", slices)
    if top is not None:
        sampler = _optional_sliced(batch, "rollout_log_probs", slices)
        return top.kl(mask), sampled_reverse_kl(
            student if sampler is None else sampler, teacher, mask
        )
    old, clip = behaviour
    owners = _owners(slices, mask.device) if kl_discount else None
    result = reverse_kl_pg_loss(
        student,
        teacher,
        mask,
        old_logprobs=old,
        clip=clip,
        kl_discount=kl_discount,
        owners=owners,
    )
    return result, sampled_reverse_kl(student if old is None else old, teacher, mask)


def _owners(slices: list[ResponseSlice], device: torch.device) -> Tensor:
    """Each local token's sample, for a discount over a sample's later tokens: refused
    unless this rank holds every sample's response whole and in order (cp 1, which the
    launch plan requires of kl_discount)."""
    for index, piece in enumerate(slices):
        if piece.response_index != list(range(len(piece.response_index))):
            raise ValueError(
                f"algorithm.kl_discount: sample {index}'s response is split across context-"
                "parallel ranks; the discount needs it whole on one rank (parallel.cp 1)"
            )
    sizes = torch.tensor([len(s.response_index) for s in slices], device=device)
    return torch.repeat_interleave(torch.arange(len(slices), device=device), sizes)


def _oprd_loss(
    job: JobConfig,
    args: Any,
    batch: dict[str, Any],
    slices: list[ResponseSlice],
    student: Tensor,
    mask: Tensor,
    sum_of_sample_mean: Callable[[Tensor], Tensor],
    behaviour: tuple[Tensor | None, tuple[float, float] | None],
    top: TeacherTopK | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Success tokens on the NLL, failure tokens on the sampled reverse KL (policy-gradient
    form, as OPD) or, with `top`, the KL to the teacher's top-k with a tail bucket; each
    times its lambda and its trajectory's branch share: slime's reduction then gives
    lambda_+ L_+ + lambda_- L_- (`slime_ext.slime.oprd`)."""
    if batch.get("advantages") is None:
        raise SlimeBatchError(
            "recipe oprd reads each sample's branch share from advantages: run slime with "
            "--custom-advantage-function-path slime_ext.slime.oprd.advantages (and without "
            "--disable-compute-advantages-and-returns)"
        )
    share = _sliced_given(batch, "advantages", slices)
    success, failure = mask & (share > 0), mask & (share < 0)
    weight = share.abs()
    teacher = _sliced_given(batch, "teacher_log_probs", slices)
    old, clip = behaviour
    nll = masked_nll(student, success).per_token
    if top is None:
        kl_pg = reverse_kl_pg_loss(student, teacher, failure, old_logprobs=old, clip=clip)
    else:
        kl_pg = top.kl(failure)
    failure_loss = kl_pg.per_token
    algorithm = job.algorithm
    per_token = weight * (
        algorithm.oprd_success_weight * nll + algorithm.oprd_failure_weight * failure_loss
    )
    kl = sampled_reverse_kl(student if old is None else old, teacher, mask)
    total = sum_of_sample_mean(per_token)

    def branch_mean(values: Tensor) -> Tensor:
        return sum_of_sample_mean(weight * values).detach()

    metrics = {
        "opd_reverse_kl": sum_of_sample_mean(kl.per_token).detach(),
        "student_gt_teacher_frac": sum_of_sample_mean(_above(kl, mask)).detach(),
        "loss_tokens": mask.sum().float().detach(),
        "loss": total.detach(),
        "success_branch_loss": branch_mean(nll.detach()),
        "failure_branch_loss": branch_mean(failure_loss.detach()),
        "opd_reverse_kl_success": branch_mean(kl.per_token * success),
        "opd_reverse_kl_failure": branch_mean(kl.per_token * failure),
    }
    if top is not None:
        metrics["teacher_topk_kl"] = branch_mean(failure_loss.detach())
    return total, metrics


def _old_logprobs(
    args: Any, batch: dict[str, Any], slices: list[ResponseSlice]
) -> tuple[Tensor | None, tuple[float, float] | None]:
    """The log-probs the samples were drawn under, when slime reuses them (its recomputed
    log_probs, or the rollout's with --use-rollout-logprobs), and the PPO clip range
    slime's policy loss would use."""
    old_key = "rollout_log_probs" if getattr(args, "use_rollout_logprobs", False) else "log_probs"
    if batch.get(old_key) is None:
        return None, None
    eps_low = float(getattr(args, "eps_clip", 0.2))
    eps_high = float(getattr(args, "eps_clip_high", None) or eps_low)
    return _sliced_given(batch, old_key, slices), (1.0 - eps_low, 1.0 + eps_high)


def _recomputed(args: Any) -> bool:
    """The old log-probs are slime's recomputed ones (not the rollout's)."""
    return not getattr(args, "use_rollout_logprobs", False)


def _padding_shift(
    args: Any, logits: Tensor, targets: Tensor, shard: VocabShard, mask: Tensor, student: Tensor
) -> Tensor:
    """What slime's recomputed old log-probs lack where Megatron padded the output layer:
    slime's log-softmax runs over the padding columns too, which take probability mass
    from every token (the engines have no such columns, and `student` leaves them out),
    so its log-probs sit log(1 + padded mass) below. The shift comes from this step's
    logits: exact when a rollout trains in one optimizer step (the plan's global batch is
    a rollout's trajectories, so the old log-probs were computed under these weights);
    off by the padded mass's change within a rollout otherwise (nothing for a trained
    model, whose padding columns carry no mass to speak of; 0 without padding)."""
    if shard.real_vocab_size is None:
        return torch.zeros_like(student)
    with torch.no_grad():
        padded = token_logprobs(
            logits,
            targets,
            dataclasses.replace(shard, real_vocab_size=None),
            temperature=_temperature(args),
            chunk_size=_chunk_size(args),
            mask=mask,
        )
    return student.detach() - padded


def _optional_sliced(batch: dict[str, Any], key: str, slices: list[ResponseSlice]) -> Tensor | None:
    return None if batch.get(key) is None else _sliced_given(batch, key, slices)


def _temperature(args: Any) -> float:
    return float(getattr(args, "rollout_temperature", 1.0))


def _above(kl: TokenLoss, mask: Tensor) -> Tensor:
    """1 on loss tokens where the student's log-prob exceeds the teacher's (k_t > 0)."""
    return ((kl.per_token > 0) & mask).float()


def _response(tokens: Tensor, response_length: int) -> Tensor:
    return tokens[len(tokens) - int(response_length) :]


def _local(
    values: Sequence[Tensor], response_lengths: Sequence[int], slices: list[ResponseSlice]
) -> Tensor:
    """Whole-response per-sample tensors (loss_masks) cut to this rank's positions."""
    pieces = []
    for value, length, s in zip(values, response_lengths, slices, strict=True):
        if len(value) != int(length):
            raise SlimeBatchError(f"a loss mask of {len(value)} for a response of {length}")
        pieces.append(value[torch.tensor(s.response_index, dtype=torch.long)])
    return torch.cat(pieces)


def _sliced_given(batch: dict[str, Any], key: str, slices: list[ResponseSlice]) -> Tensor:
    """A per-sample key the actor CP-sliced already: concatenated, lengths asserted."""
    values = batch.get(key)
    if values is None:
        raise SlimeBatchError(
            f"the batch has no {key!r}: for OPD every sample (aborted placeholders too) "
            "must carry it; slime copies it only when the first sample has it"
        )
    for index, (value, s) in enumerate(zip(values, slices, strict=True)):
        if len(value) != len(s.local_rows):
            raise SlimeBatchError(
                f"{key}[{index}] holds {len(value)} values where this rank holds "
                f"{len(s.local_rows)} response tokens (invariant 2: lengths are asserted)"
            )
    device = values[0].device if isinstance(values[0], Tensor) else None
    return torch.cat([torch.as_tensor(v, dtype=torch.float32, device=device) for v in values])


def real_vocab_size(args: Any, padded: int) -> int | None:
    """The checkpoint's vocabulary (Megatron-LM's --vocab-size, from MODEL_ARGS) where
    Megatron padded the output layer past it (`padded` columns: a multiple of 128 x TP),
    else None. The padded columns' logits are masked out: the engines sample over the
    checkpoint's rows only, and a padded column's logit (0 for the zero rows Megatron
    adds) would otherwise take probability mass from every token the student sampled."""
    vocab = getattr(args, "vocab_size", None)
    return int(vocab) if vocab and int(vocab) < padded else None


def _shard(parallel: Parallel, args: Any, local_columns: int) -> VocabShard:
    """This rank's part of the output layer (`local_columns` of the padded vocabulary)."""
    real = real_vocab_size(args, local_columns * parallel.tp_size)
    if parallel.tp_size == 1:
        return VocabShard(real_vocab_size=real)
    return VocabShard(parallel.tp_group, parallel.tp_rank * local_columns, real)


def _chunk_size(args: Any) -> int | None:
    size = int(getattr(args, "log_probs_chunk_size", -1) or -1)
    return size if size > 0 else None
