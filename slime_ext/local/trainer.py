"""The embedded trainer's update: per-turn samples, `slime_ext.losses`, AdamW.

The same losses as the cluster path: OPD is `reverse_kl_pg_loss` against the teacher's
log-probs of each turn's span; RL is REINFORCE with group-normalized outcome advantages;
SFT is `masked_nll`. Every loss is reduced per trajectory (DESIGN.md invariant 7). The
LM head runs only on span positions, fused and chunked (`fused_lm_head`), so the
[tokens x vocab] logits never exist whole.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from rollout.trajectory import Trajectory
from slime_ext.losses import (
    masked_nll,
    reverse_kl_pg_loss,
    sampled_reverse_kl,
    teacher_topk_kl,
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
from slime_ext.vocab_parallel import fused_lm_head, token_logprobs

TrainRecipe = Literal["opd", "rl", "sft"]


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lr: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)
    temperature: float = Field(default=1.0, gt=0)
    """The rollout's sampling temperature; student log-probs use the same."""
    kl_coef: float = Field(default=1.0, ge=0)
    pg_clip: float | None = None
    """PPO clip of the OPD ratio against the rollout's log-probs; None: fresh samples."""
    train_on_invalid_turns: bool = True
    """KL and RL losses train on tier-1/2 turns (imitation never does)."""
    chunk_size: int = Field(default=64, ge=1)
    """Tokens per LM-head chunk."""
    opd_loss: Literal["sampled", "topk_tail", "topk_renorm"] = "sampled"
    """See AlgorithmConfig.opd_loss."""
    sequence_layout: Literal["auto", "packed", "per_turn"] = "auto"
    """See AlgorithmConfig.sequence_layout."""
    packed_kernel: Literal["auto", "kv", "mask"] = "auto"
    """How a packed trajectory is evaluated: kv runs the trunk causally, then its branches
    on the trunk's key/value prefix (gradients flow through it), one trajectory at a time;
    mask runs the whole batch in one forward with the [L, L] attention rule (dense on CPU:
    O(L^2) memory). auto: mask up to MASK_MAX_TOKENS per trajectory, kv beyond
    (bench/packing.py: at 16k tokens kv is 2.8x faster than mask; on the demo's short
    trajectories mask is 10% faster than kv)."""


MASK_MAX_TOKENS = 2048
"""packed_kernel auto: trajectories up to this many packed tokens go through the mask."""


class MissingTeacherScores(ValueError):
    """OPD needs the teacher's log-probs on every turn."""


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
    def __init__(self, model: Any, config: TrainerConfig | None = None) -> None:
        self.model = model
        self.config = config or TrainerConfig()
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=self.config.lr, weight_decay=self.config.weight_decay
        )
        self.pad_id = int(model.config.pad_token_id or 0)
        self.layout: Layout = _resolve_layout(model, self.config.sequence_layout)

    def batch(self, trajectories: Sequence[Trajectory], kind: LossKind) -> TurnBatch:
        invalid = self.config.train_on_invalid_turns
        if self.layout == "per_turn":
            return per_turn_batch(trajectories, kind, invalid, self.pad_id)
        limit = {"mask": None, "kv": 0, "auto": MASK_MAX_TOKENS}[self.config.packed_kernel]
        return packed_batch(trajectories, kind, invalid, self.pad_id, dense_mask_up_to=limit)

    def _hidden_rows(self, batch: TurnBatch) -> Tensor:
        if batch.packs is not None:
            rows = [
                trunk_then_branches(self.model, p)[torch.tensor(p.span_rows)] for p in batch.packs
            ]
            return torch.cat(rows)
        hidden = self.model.base_model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
        ).last_hidden_state
        return hidden.reshape(-1, hidden.shape[-1])[batch.span_rows]

    def span_logprobs(self, batch: TurnBatch) -> Tensor:
        """log p_student(span token) at the configured temperature, for every span token."""
        rows = self._hidden_rows(batch)
        weight = self.model.get_output_embeddings().weight
        temperature = self.config.temperature

        def kernel(logits: Tensor, targets: Tensor) -> Tensor:
            return token_logprobs(logits, targets, temperature=temperature)

        return fused_lm_head(kernel, rows, weight, [batch.targets], self.config.chunk_size)

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
        kind: LossKind = "imitation" if recipe == "sft" else "kl"
        batch = self.batch(trajectories, kind)
        mask = batch.loss_mask
        metrics: dict[str, float] = {
            "train/loss_tokens": float(batch.num_loss_tokens),
            "train/processed_tokens": float(batch.num_processed_tokens),
        }
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
            result = reverse_kl_pg_loss(
                self.span_logprobs(batch),
                batch.teacher_logprobs,
                mask,
                old_logprobs=old,
                clip=self.config.pg_clip,
            )
            per_token = result.per_token * self.config.kl_coef
            metrics.update({f"train/{k}": float(v) for k, v in result.metrics.items()})
        elif recipe == "rl":
            advantages = torch.tensor(group_advantages(trajectories))[batch.trajectory_index]
            per_token = -advantages * self.span_logprobs(batch)
        else:
            result = masked_nll(self.span_logprobs(batch), mask)
            per_token = result.per_token
            metrics["train/nll"] = float(result.metrics["nll"])
        weights = trajectory_token_weights(mask, batch.trajectory_index, batch.num_trajectories)
        loss = weighted_sum(per_token, weights)
        metrics["train/loss"] = float(loss.detach())
        return loss, metrics

    def step(self, trajectories: Sequence[Trajectory], recipe: TrainRecipe) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss, metrics = self.loss(trajectories, recipe)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.model.eval()
        metrics["train/grad_norm"] = float(norm)
        return metrics


def _resolve_layout(model: Any, wanted: str) -> Layout:
    """packed where exact (full-attention models), per turn otherwise; an explicit
    `packed` on a model that cannot take it is an error."""
    if wanted == "per_turn":
        return "per_turn"
    try:
        check_packable(model)
    except PackingUnsupported:
        if wanted == "packed":
            raise
        return "per_turn"
    return "packed"
