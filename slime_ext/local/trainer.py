"""The embedded trainer's update: per-turn samples, `slime_ext.losses`, AdamW with
Megatron's learning-rate schedule (`scheduled_lr`).

The same losses as the cluster path: OPD is `reverse_kl_pg_loss` against the teacher's
log-probs of each turn's span; RL is REINFORCE with group-normalized outcome advantages;
SFT is `masked_nll`. OPRD routes by outcome: success trajectories train on `masked_nll`
(invalid turns masked), failures on the reverse KL to a reminded self-teacher:
`topk_shared_support_kl` against an in-process frozen copy of the student (`SelfTeacher`),
`teacher_topk_kl` with a tail bucket against the teacher service's top-k, or the sampled
reverse KL against the service's log-probs (what slime's loss trains). Every loss
is reduced per trajectory (DESIGN.md invariant 7). The LM head runs only on span
positions, fused and chunked (`fused_lm_head`), so the [tokens x vocab] logits never exist
whole.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor
from torch.optim.lr_scheduler import LRScheduler

from rollout.masking import loss_mask_for
from rollout.reminders import teacher_view
from rollout.runner import TeacherContext
from rollout.trajectory import Trajectory
from slime_ext.flex_tree import flex_tree
from slime_ext.hybrid_tree import is_hybrid
from slime_ext.losses import (
    masked_mean,
    masked_nll,
    outcome_routed,
    reverse_kl_pg_loss,
    sampled_reverse_kl,
    teacher_topk_kl,
    topk_shared_support_kl,
    trajectory_token_weights,
    weighted_sum,
)
from slime_ext.turns import (
    Layout,
    LossKind,
    PackingUnsupported,
    TurnBatch,
    check_packable,
    packed_batch,
    per_turn_batch,
    trunk_then_branches,
)
from slime_ext.vocab_parallel import PerTokenKernel, fused_lm_head, token_logprobs

TrainRecipe = Literal["opd", "oprd", "rl", "sft"]


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lr: float = Field(default=1e-4, gt=0)
    """See AlgorithmConfig.lr."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """See AlgorithmConfig.lr_schedule."""
    lr_warmup_steps: int = Field(default=0, ge=0)
    """See AlgorithmConfig.lr_warmup_steps."""
    min_lr: float = Field(default=0.0, ge=0)
    """See AlgorithmConfig.min_lr."""
    lr_decay_steps: int | None = Field(default=None, ge=1)
    """Optimizer steps the schedule spans, warmup included (algorithm.steps; Megatron's
    --lr-decay-iters): cosine and linear reach min_lr there. constant needs none."""
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)
    temperature: float = Field(default=1.0, gt=0)
    """The rollout's sampling temperature; student log-probs use the same."""
    kl_coef: float = Field(default=1.0, ge=0)
    pg_clip: float | None = None
    """PPO clip of the OPD ratio against the rollout's log-probs; None: fresh samples."""
    train_on_invalid_turns: bool = True
    """KL and RL losses train on tier-1/2 turns."""
    mask_invalid_turns: bool = True
    """Imitation losses (SFT, SSD) leave tier-1/2 turns out; off trains on them too (the
    masking ablation)."""
    reward_weight: float = Field(default=0.0, ge=0)
    """See AlgorithmConfig.reward_weight."""
    kl_discount: float = Field(default=0.0, ge=0, lt=1)
    """See AlgorithmConfig.kl_discount."""
    chunk_size: int = Field(default=64, ge=1)
    """Tokens per LM-head chunk."""
    opd_loss: Literal["sampled", "topk_tail", "topk_renorm"] = "sampled"
    """See AlgorithmConfig.opd_loss."""
    sequence_layout: Literal["auto", "packed", "per_turn"] = "auto"
    """See AlgorithmConfig.sequence_layout."""
    oprd_success_weight: float = Field(default=1.0, ge=0)
    """See AlgorithmConfig.oprd_success_weight."""
    oprd_failure_weight: float = Field(default=1.0, ge=0)
    """See AlgorithmConfig.oprd_failure_weight."""
    oprd_failure_loss: Literal["shared_support", "teacher_topk", "sampled"] = "shared_support"
    """See AlgorithmConfig.oprd_failure_loss."""
    oprd_support_k: int = Field(default=100, ge=1)
    """See AlgorithmConfig.oprd_support_k."""
    packed_kernel: Literal["auto", "kv", "mask", "flex"] = "auto"
    """How a packed trajectory is evaluated: kv runs the trunk causally, then its branches
    on the trunk's key/value prefix (gradients flow through it), one trajectory at a time;
    mask runs the whole batch in one forward with the [L, L] attention rule (dense on CPU:
    O(L^2) memory); flex runs each trajectory through FlexAttention with the rule as a
    block mask (slime_ext.flex_tree; for CUDA: torch has no CPU backward, training there
    refuses). auto: mask up to MASK_MAX_TOKENS per trajectory, kv beyond (bench/packing.py,
    tree_attention kernel: on the 40-turn ~16k-token trajectory kv is 6.2x faster than per
    turn, mask 4.5x; on one demo-sized trajectory, 455 packed tokens, both take the same
    time, and the mask batches a step's trajectories in one forward)."""

    @model_validator(mode="after")
    def _decay_has_an_end(self) -> TrainerConfig:
        if self.lr_schedule != "constant" and self.lr_decay_steps is None:
            raise ValueError(
                f"lr_schedule {self.lr_schedule!r} decays over lr_decay_steps: set it "
                "(the run's optimizer steps)"
            )
        return self


MASK_MAX_TOKENS = 2048
"""packed_kernel auto: trajectories up to this many packed tokens go through the mask."""


def scheduled_lr(step: int, config: TrainerConfig) -> float:
    """The learning rate of optimizer step `step` (0: the first): Megatron's
    OptimizerParamScheduler.get_lr (megatron/core/optimizer_param_scheduler.py) with warmup
    from 0 (--lr-warmup-init), so this trainer and slime's train at the same rate."""
    lr, warmup = config.lr, config.lr_warmup_steps
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if config.lr_schedule == "constant" or config.lr_decay_steps is None:
        return lr
    if step > config.lr_decay_steps:
        return config.min_lr
    ratio = (step - warmup) / (config.lr_decay_steps - warmup)
    if config.lr_schedule == "linear":
        coeff = 1.0 - ratio
    else:
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return config.min_lr + coeff * (lr - config.min_lr)


class ScheduledLR(LRScheduler):
    """`scheduled_lr` as a torch scheduler; `last_epoch` counts the optimizer steps taken.
    Its state is that count alone: a resumed run takes the schedule's settings from its
    config."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: TrainerConfig) -> None:
        self.config = config
        super().__init__(optimizer)

    def get_lr(self) -> list[float | Tensor]:
        return [scheduled_lr(self.last_epoch, self.config)] * len(self.optimizer.param_groups)

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_epoch = int(state_dict["last_epoch"])
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr


class MissingTeacherScores(ValueError):
    """OPD needs the teacher's log-probs on every turn."""


@dataclass
class SelfTeacher:
    """OPRD's in-process teacher: a frozen copy of the student that reads each turn through
    `teacher_context` (the student's context with reminders) and scores the student's own
    span there; the trainer reads its full distribution at every span position."""

    model: Any
    teacher_context: TeacherContext


def group_advantages(trajectories: Sequence[Trajectory]) -> list[float]:
    """Reward minus its group's mean, over the group's std (group = same task); a
    trajectory alone in its group is compared with the batch mean."""
    rewards = [t.reward or 0.0 for t in trajectories]
    groups: dict[str, list[int]] = defaultdict(list)
    for index, trajectory in enumerate(trajectories):
        groups[trajectory.task.task_id].append(index)
    batch_mean = sum(rewards) / max(len(rewards), 1)
    advantages = [0.0] * len(trajectories)
    for members in groups.values():
        values = [rewards[i] for i in members]
        if len(members) == 1:
            advantages[members[0]] = values[0] - batch_mean
            continue
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
        for i in members:
            advantages[i] = (rewards[i] - mean) / (std + 1e-6)
    return advantages


class LocalTrainer:
    def __init__(
        self,
        model: Any,
        config: TrainerConfig | None = None,
        self_teacher: SelfTeacher | None = None,
    ) -> None:
        self.model = model
        self.config = config or TrainerConfig()
        self.self_teacher = self_teacher
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=self.config.lr, weight_decay=self.config.weight_decay
        )
        self.lr_schedule = ScheduledLR(self.optimizer, self.config)
        self.pad_id = int(model.config.pad_token_id or 0)
        self.packed_kernel = self.config.packed_kernel
        if self.packed_kernel == "auto" and is_hybrid(model):
            self.packed_kernel = "kv"  # the only kernel that runs linear attention from a state
        self.layout: Layout = _resolve_layout(
            model, self.config.sequence_layout, self.packed_kernel
        )

    def batch(self, trajectories: Sequence[Trajectory], kind: LossKind) -> TurnBatch:
        invalid = self.config.train_on_invalid_turns
        imitate = not self.config.mask_invalid_turns
        if self.layout == "per_turn":
            return per_turn_batch(trajectories, kind, invalid, self.pad_id, imitate)
        limit = {"mask": None, "kv": 0, "flex": 0, "auto": MASK_MAX_TOKENS}[self.packed_kernel]
        return packed_batch(
            trajectories, kind, invalid, self.pad_id, limit, imitate_invalid=imitate
        )

    def _hidden_rows(self, batch: TurnBatch, model: Any = None) -> Tensor:
        model = self.model if model is None else model
        if batch.packs is not None:
            kernel = flex_tree if self.config.packed_kernel == "flex" else trunk_then_branches
            rows = [kernel(model, p, rows=p.span_rows) for p in batch.packs]
            return torch.cat(rows)
        hidden = model.base_model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
        ).last_hidden_state
        return hidden.reshape(-1, hidden.shape[-1])[batch.span_rows]

    def span_logprobs(self, batch: TurnBatch) -> Tensor:
        """log p_student(span token) at the configured temperature, for every span token."""
        return self._logprobs(self._hidden_rows(batch), self.model, batch.targets)

    def _logprobs(self, rows: Tensor, model: Any, targets: Tensor) -> Tensor:
        weight = model.get_output_embeddings().weight
        temperature = self.config.temperature

        def kernel(logits: Tensor, targets: Tensor) -> Tensor:
            return token_logprobs(logits, targets, temperature=temperature)

        return fused_lm_head(kernel, rows, weight, [targets], self.config.chunk_size)

    def teacher_topk_loss(self, batch: TurnBatch) -> Tensor:
        """Reverse KL to the teacher's top-k at every span position (fused LM head)."""
        if batch.teacher_topk_ids is None or batch.teacher_topk_logprobs is None:
            raise MissingTeacherScores(
                "opd_loss top-k needs teacher top-k on every turn: score with teacher.top_k > 0"
            )
        rows = self._hidden_rows(batch)
        weight = self.model.get_output_embeddings().weight
        temperature, tail = self.config.temperature, self.config.opd_loss == "topk_tail"

        def kernel(logits: Tensor, ids: Tensor, logprobs: Tensor, valid: Tensor) -> Tensor:
            return teacher_topk_kl(logits, ids, logprobs, valid, temperature, tail).per_token

        tensors = [batch.teacher_topk_ids, batch.teacher_topk_logprobs, batch.loss_mask]
        return fused_lm_head(kernel, rows, weight, tensors, self.config.chunk_size)

    def loss(
        self, trajectories: Sequence[Trajectory], recipe: TrainRecipe
    ) -> tuple[Tensor, dict[str, float]]:
        if recipe == "oprd":
            return self.oprd_loss(trajectories)
        kind: LossKind = "imitation" if recipe == "sft" else "kl"
        return self.batch_loss(self.batch(trajectories, kind), recipe, trajectories)

    def batch_loss(
        self,
        batch: TurnBatch,
        recipe: Literal["opd", "rl", "sft"],
        trajectories: Sequence[Trajectory] = (),
    ) -> tuple[Tensor, dict[str, float]]:
        """`loss` on a batch already laid out; `trajectories` (the batch's, in its order)
        only where an outcome reward enters (RL, OPD with reward_weight)."""
        mask = batch.loss_mask
        metrics: dict[str, float] = {
            "train/loss_tokens": float(batch.num_loss_tokens),
            "train/processed_tokens": float(batch.num_processed_tokens),
        }
        student: Tensor | None = None  # the sampled OPD form's student log-probs
        if recipe == "opd" and self.config.opd_loss != "sampled":
            per_token = self.teacher_topk_loss(batch) * self.config.kl_coef
            metrics["train/teacher_topk_kl"] = float(
                (per_token.detach() * mask).sum() / mask.sum().clamp(min=1)
            )
            if batch.teacher_logprobs is not None and batch.sampler_logprobs is not None:
                # the sampled estimator at the rollout's own log-probs, as a metric
                sampled = sampled_reverse_kl(batch.sampler_logprobs, batch.teacher_logprobs, mask)
                metrics.update({f"train/{k}": float(v) for k, v in sampled.metrics.items()})
        elif recipe == "opd":
            if batch.teacher_logprobs is None:
                raise MissingTeacherScores(
                    "OPD needs teacher_logprobs on every turn: run the "
                    "rollout with per-turn teacher scoring"
                )
            old = batch.sampler_logprobs if self.config.pg_clip is not None else None
            student = self.span_logprobs(batch)
            result = reverse_kl_pg_loss(
                student,
                batch.teacher_logprobs,
                mask,
                old_logprobs=old,
                clip=self.config.pg_clip,
                kl_discount=self.config.kl_discount,
                owners=batch.trajectory_index,
            )
            per_token = result.per_token * self.config.kl_coef
            metrics.update({f"train/{k}": float(v) for k, v in result.metrics.items()})
        elif recipe == "rl":
            per_token = self._reward_loss(trajectories, batch, metrics)
        else:
            result = masked_nll(self.span_logprobs(batch), mask)
            per_token = result.per_token
            metrics["train/nll"] = float(result.metrics["nll"])
        if recipe == "opd" and self.config.reward_weight > 0:  # OPD + outcome reward
            reward = self._reward_loss(trajectories, batch, metrics, student)
            per_token = per_token + self.config.reward_weight * reward
        weights = trajectory_token_weights(mask, batch.trajectory_index, batch.num_trajectories)
        loss = weighted_sum(per_token, weights)
        metrics["train/loss"] = float(loss.detach())
        return loss, metrics

    def _reward_loss(
        self,
        trajectories: Sequence[Trajectory],
        batch: TurnBatch,
        metrics: dict[str, float],
        logprobs: Tensor | None = None,
    ) -> Tensor:
        """REINFORCE on group-normalized outcome advantages, per token; logs the share of
        trajectories whose advantage is not 0 (a group whose rewards are all equal, as
        all-failed groups at a weak start, teaches nothing)."""
        values = group_advantages(trajectories)
        metrics["train/nonzero_advantage_frac"] = sum(abs(a) > 1e-6 for a in values) / max(
            len(values), 1
        )
        advantages = torch.tensor(values)[batch.trajectory_index]
        return -advantages * (self.span_logprobs(batch) if logprobs is None else logprobs)

    def oprd_loss(self, trajectories: Sequence[Trajectory]) -> tuple[Tensor, dict[str, float]]:
        """lambda_+ * mean over successes (reward > 0) of their token-mean NLL (tier-1/2 turns
        masked) + lambda_- * mean over failures of their token-mean reverse KL to the
        reminded teacher (tier-1/2 turns kept unless train_on_invalid_turns is off)."""
        config = self.config
        batch = self.batch(trajectories, "kl")
        kl_mask = batch.loss_mask
        imitation = torch.tensor(
            [
                loss_mask_for(turn.mask_tier, "imitation")
                for t in trajectories
                for turn in t.turns
                for _ in turn.span_ids
            ],
            dtype=torch.bool,
        )
        success = torch.tensor([(t.reward or 0.0) > 0 for t in trajectories], dtype=torch.bool)
        token_success = success[batch.trajectory_index]
        rows = self._hidden_rows(batch)
        student = self._logprobs(rows, self.model, batch.targets)
        nll = masked_nll(student, imitation)
        failed = (~token_success).nonzero()[:, 0]
        failure, teacher_logprobs, metrics = self._oprd_failure(
            trajectories, batch, rows, student, failed
        )
        loss, routed = outcome_routed(
            nll.per_token,
            failure,
            imitation,
            batch.trajectory_index,
            success,
            config.oprd_success_weight,
            config.oprd_failure_weight,
            failure_mask=kl_mask,
        )
        success_tokens = imitation & token_success
        failure_tokens = kl_mask & ~token_success
        metrics.update(
            {
                "train/loss": float(loss.detach()),
                "train/loss_tokens": float(success_tokens.sum() + failure_tokens.sum()),
                "train/processed_tokens": float(batch.num_processed_tokens),
                "train/nll": float(masked_mean(nll.per_token.detach(), success_tokens)),
                "train/success_masked_token_frac": float(
                    masked_mean((~imitation).float(), token_success)
                ),
                **{f"train/{k}": float(v) for k, v in routed.items()},
            }
        )
        # the sampled reverse KL (k_t at the rollout's own log-probs), overall and per branch
        sampled = batch.sampler_logprobs if batch.sampler_logprobs is not None else student
        overall = sampled_reverse_kl(sampled, teacher_logprobs, kl_mask).metrics
        metrics["train/opd_reverse_kl"] = float(overall["opd_reverse_kl"])
        metrics["train/student_gt_teacher_frac"] = float(overall["student_gt_teacher_frac"])
        for branch, tokens in (("success", kl_mask & token_success), ("failure", failure_tokens)):
            if tokens.any():  # an absent branch has no KL to report
                kl = sampled_reverse_kl(sampled, teacher_logprobs, tokens).metrics
                metrics[f"train/opd_reverse_kl_{branch}"] = float(kl["opd_reverse_kl"])
        return loss, metrics

    def _oprd_failure(
        self,
        trajectories: Sequence[Trajectory],
        batch: TurnBatch,
        rows: Tensor,
        student: Tensor,
        failed: Tensor,
    ) -> tuple[Tensor, Tensor, dict[str, float]]:
        """The failure branch's per-token KL on the `failed` tokens (0 elsewhere), the
        teacher's log-prob of every span token (for the sampled-KL metrics), and metrics."""
        config, mask = self.config, batch.loss_mask
        weight = self.model.get_output_embeddings().weight
        temperature = config.temperature
        per_token = torch.zeros(len(batch.targets), device=rows.device)
        metrics: dict[str, float] = {}
        if config.oprd_failure_loss == "sampled":  # slime's: only the sampled token's log-prob
            if batch.teacher_logprobs is None:
                raise MissingTeacherScores(
                    "oprd_failure_loss sampled needs the teacher's log-prob of every span token"
                )
            old = batch.sampler_logprobs if config.pg_clip is not None else None
            sampled = reverse_kl_pg_loss(
                student[failed],
                batch.teacher_logprobs[failed],
                mask[failed],
                old_logprobs=None if old is None else old[failed],
                clip=config.pg_clip,
            ).per_token  # on fresh samples its value is k_t: train/opd_reverse_kl_failure
            return per_token.index_add(0, failed, sampled), batch.teacher_logprobs, metrics
        if config.oprd_failure_loss == "shared_support":
            teacher = self.self_teacher
            if teacher is None:
                raise MissingTeacherScores(
                    "oprd_failure_loss shared_support needs the in-process teacher "
                    "(LocalTrainer(self_teacher=...)); a teacher service gives teacher_topk"
                )
            views = [teacher_view(t, teacher.teacher_context) for t in trajectories]
            teacher_batch = self.batch(views, "kl")
            if not torch.equal(teacher_batch.targets, batch.targets):
                raise ValueError("the teacher's spans differ from the student's (invariant 2)")
            teacher_weight = teacher.model.get_output_embeddings().weight.detach()
            with torch.no_grad():
                teacher_rows = self._hidden_rows(teacher_batch, teacher.model)
                teacher_logprobs = self._logprobs(teacher_rows, teacher.model, batch.targets)
            support = min(config.oprd_support_k, int(weight.shape[0]))

            def shared(logits: Tensor, hidden: Tensor, valid: Tensor) -> Tensor:
                teacher_logits = hidden @ teacher_weight.t()
                return topk_shared_support_kl(
                    logits, teacher_logits, valid, support, temperature
                ).per_token

            tensors: list[Tensor] = [teacher_rows[failed], mask[failed]]
            kernel: PerTokenKernel = shared
            name = "train/shared_support_kl"
            metrics["train/teacher_processed_tokens"] = float(teacher_batch.num_processed_tokens)
        else:
            if (
                batch.teacher_topk_ids is None
                or batch.teacher_topk_logprobs is None
                or batch.teacher_logprobs is None
            ):
                raise MissingTeacherScores(
                    "oprd_failure_loss teacher_topk needs the teacher's log-probs and top-k on "
                    "every turn: score with teacher.top_k > 0"
                )
            teacher_logprobs = batch.teacher_logprobs

            def topk(logits: Tensor, ids: Tensor, logprobs: Tensor, valid: Tensor) -> Tensor:
                return teacher_topk_kl(logits, ids, logprobs, valid, temperature, True).per_token

            tensors = [batch.teacher_topk_ids[failed], batch.teacher_topk_logprobs[failed]]
            tensors.append(mask[failed])
            kernel, name = topk, "train/teacher_topk_kl"
        if failed.numel():
            kl = fused_lm_head(kernel, rows[failed], weight, tensors, config.chunk_size)
            per_token = per_token.index_add(0, failed, kl)
            metrics[name] = float(masked_mean(kl.detach(), mask[failed]))
        return per_token, teacher_logprobs, metrics

    def step(self, trajectories: Sequence[Trajectory], recipe: TrainRecipe) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss, metrics = self.loss(trajectories, recipe)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        metrics["train/lr"] = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.lr_schedule.step()
        self.model.eval()
        metrics["train/grad_norm"] = float(norm)
        return metrics

    def skip(self) -> None:
        """A step with nothing to train: the schedule moves on all the same, as slime's
        does (it steps on every rollout), so both modes train step s at the same rate."""
        self.lr_schedule.last_epoch += 1
        self.lr_schedule.load_state_dict(self.lr_schedule.state_dict())


def _resolve_layout(model: Any, wanted: str, kernel: str) -> Layout:
    """packed where exact (full-attention models; Gated DeltaNet hybrids through the kv
    kernel), per turn otherwise; an explicit `packed` on a model that cannot take it is an
    error."""
    if wanted == "per_turn":
        return "per_turn"
    try:
        check_packable(model, kernel)
    except PackingUnsupported:
        if wanted == "packed":
            raise
        return "per_turn"
    return "packed"
