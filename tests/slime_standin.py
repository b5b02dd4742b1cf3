"""A stand-in for the parts of slime our hooks meet, for CI where slime is not installed
(it ships in its CUDA image). Each piece restates, in our own code, the behaviour of the
named file and lines of THUDM/slime at commit SLIME_COMMIT; where slime reads Megatron's
parallel state, these take cp_rank / cp_size as arguments. tests/test_slime_hooks.py
runs the same hooks against the real slime when it is importable.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"


@dataclass
class Sample:
    """slime/utils/types.py L93-151: the fields our hooks read or write."""

    class Status(Enum):  # L130-138
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    status: Sample.Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None


def slime_args(**overrides: Any) -> SimpleNamespace:
    """The argument attributes our hooks read (slime/utils/arguments.py defaults)."""
    values: dict[str, Any] = {
        "rollout_temperature": 1.0,
        "rollout_max_response_len": 64,
        "n_samples_per_prompt": 1,
        "rollout_batch_size": 1,
        "calculate_per_token_loss": False,
        "eps_clip": 0.2,
        "eps_clip_high": None,
        "use_rollout_logprobs": False,
        "log_probs_chunk_size": -1,
        "advantage_estimator": "grpo",
        "rewards_normalization": True,
        "grpo_std_normalization": True,
        "global_batch_size": 1,
        "normalize_advantages": False,
        "use_opd": False,
        "use_critic": False,
        "sglang_router_ip": "127.0.0.1",
        "sglang_router_port": 0,
        "hf_checkpoint": None,
    }
    values.update(overrides)
    return SimpleNamespace(**values)


# --- rollout side --------------------------------------------------------------------


async def generate_and_rm(
    args: Any,
    sample: Sample,
    sampling_params: dict[str, Any],
    generate: Callable[..., Any],
    rm: Callable[..., Any] | None,
    evaluation: bool = False,
) -> Sample | list[Sample]:
    """slime/rollout/sglang_rollout.py L224-289: `evaluation` is passed as a keyword only
    when the function names it; a returned list gets one batched reward call over its
    samples whose reward is None, unless one of them is aborted."""
    if "evaluation" in inspect.signature(generate).parameters:
        result = await generate(args, sample, dict(sampling_params), evaluation=evaluation)
    else:
        result = await generate(args, sample, dict(sampling_params))
    if isinstance(result, list):
        if any(s.status == Sample.Status.ABORTED for s in result):
            return result
        need = [s for s in result if s.reward is None]
        if rm is not None:
            rewards = await rm(args, need)
            for s, reward in zip(need, rewards, strict=False):
                s.reward = reward
        return result
    if result.status != Sample.Status.ABORTED and result.reward is None and rm is not None:
        result.reward = await rm(args, result)
    return result


def validate_rollout_id_annotated(groups: Sequence[Any], depth: int = 0) -> None:
    """slime/observability/rollout_data_utils.py L92-121: a fan-out list (depth >= 2) of
    more than one sample must share one non-None rollout_id."""
    for node in groups:
        if isinstance(node, list):
            if node and not isinstance(node[0], list) and depth + 1 >= 2 and len(node) > 1:
                ids = {s.rollout_id for s in node}
                assert None not in ids and len(ids) == 1, f"siblings carry rollout ids {ids}"
            validate_rollout_id_annotated(node, depth + 1)


def flatten(groups: Sequence[Any]) -> list[Sample]:
    """slime/ray/rollout.py L583-606: nested lists are chained until samples remain."""
    data: list[Any] = list(groups)
    while data and isinstance(data[0], list):
        data = [item for node in data for item in node]
    return data


def convert_samples_to_train_data(
    args: Any,
    samples: list[Sample],
    post_process: Callable[[Any, list[Sample]], tuple[list[float], list[float]]] | None = None,
) -> dict[str, Any]:
    """slime/ray/rollout.py L635-752 (the keys our loss reads)."""
    if post_process is not None:  # L608-610
        raw, rewards = post_process(args, samples)
    else:
        raw = [float(s.reward) for s in samples]  # type: ignore[arg-type]
        rewards = list(raw)
    assert len(raw) == len(samples) and len(rewards) == len(samples)  # L644-645
    used = {s.rollout_id for s in samples if s.rollout_id is not None}
    rollout_ids, fresh = [], 0
    for s in samples:  # L647-655: a None id gets the smallest unused integer
        if s.rollout_id is None:
            while fresh in used:
                fresh += 1
            used.add(fresh)
            rollout_ids.append(fresh)
        else:
            rollout_ids.append(s.rollout_id)
    loss_masks = []
    for s in samples:  # L669-683
        if s.loss_mask is None:
            s.loss_mask = [1] * s.response_length
        assert len(s.loss_mask) == s.response_length
        if s.remove_sample:
            s.loss_mask = [0] * s.response_length
        loss_masks.append(s.loss_mask)
    totals: dict[int, int] = {}
    for rid, mask in zip(rollout_ids, loss_masks, strict=True):  # L695-700
        totals[rid] = totals.get(rid, 0) + sum(mask)
    data: dict[str, Any] = {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": rewards,
        "raw_reward": raw,
        "loss_masks": loss_masks,
        "rollout_ids": rollout_ids,
        "rollout_mask_sums": [totals[rid] for rid in rollout_ids],
    }
    if samples[0].rollout_log_probs is not None:  # L715-716: the first sample decides
        data["rollout_log_probs"] = [s.rollout_log_probs for s in samples]
    if samples[0].teacher_log_probs is not None:  # L746-747
        data["teacher_log_probs"] = [s.teacher_log_probs for s in samples]
    return data


# --- trainer side --------------------------------------------------------------------


def logit_offsets(
    total_length: int, response_length: int, cp_rank: int, cp_size: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """slime/backends/megatron_utils/cp_utils.py L9-44: each chunk's global positions and
    the response-logit positions inside it (empty ones become (0, 0))."""
    prompt = total_length - response_length
    size = (total_length + 2 * cp_size - 1) // (2 * cp_size)
    chunks = [
        (cp_rank * size, (cp_rank + 1) * size),
        ((2 * cp_size - cp_rank - 1) * size, (2 * cp_size - cp_rank) * size),
    ]
    logits = []
    for begin, end in chunks:
        span = (max(begin, prompt - 1), min(end, total_length - 1))
        logits.append(span if span[0] < span[1] else (0, 0))
    return chunks, logits


def slice_with_cp(tokens: Tensor, cp_rank: int, cp_size: int, pad_value: float = 0) -> Tensor:
    """cp_utils.py L179-209: pad to 2*CP equal chunks; rank r keeps r and 2CP-1-r."""
    if cp_size == 1:
        return tokens
    size = (len(tokens) + 2 * cp_size - 1) // (2 * cp_size)
    pad = 2 * cp_size * size - len(tokens)
    padded = torch.cat([tokens, tokens.new_full((pad, *tokens.shape[1:]), pad_value)])
    first = padded[cp_rank * size : (cp_rank + 1) * size]
    second = padded[(2 * cp_size - cp_rank - 1) * size : (2 * cp_size - cp_rank) * size]
    return torch.cat([first, second])


def slice_log_prob_with_cp(
    values: Sequence[float], total_length: int, response_length: int, cp_rank: int, cp_size: int
) -> list[float]:
    """cp_utils.py L212-236: what the actor does to teacher and rollout log-probs."""
    assert len(values) == response_length
    if cp_size == 1:
        return list(values)
    prompt = total_length - response_length
    _, logits = logit_offsets(total_length, response_length, cp_rank, cp_size)
    out: list[float] = []
    for begin, end in logits:
        out += list(values[begin - (prompt - 1) : end - (prompt - 1)])
    return out


def get_sum_of_sample_mean(
    total_lengths: list[int],
    response_lengths: list[int],
    loss_masks: list[Tensor],
    sample_denoms: list[Tensor],
    cp_rank: int,
    cp_size: int,
) -> Callable[[Tensor], Tensor]:
    """cp_utils.py L47-124 (per-rollout denominators, calculate_per_token_loss off)."""
    if cp_size == 1:
        lengths, masks = list(response_lengths), list(loss_masks)
    else:
        lengths, masks = [], []
        for total, response, mask in zip(total_lengths, response_lengths, loss_masks, strict=True):
            prompt = total - response
            _, logits = logit_offsets(total, response, cp_rank, cp_size)
            # token offsets are logit offsets + 1 (and (0, 0) when empty)
            pieces = [
                mask[(b + 1 if e > b else 0) - prompt : (e + 1 if e > b else 0) - prompt]
                for b, e in logits
            ]
            local = torch.cat(pieces)
            lengths.append(len(local))
            masks.append(local)

    def sum_of_sample_mean(x: Tensor) -> Tensor:
        total = x.new_zeros(())
        for x_i, mask, denom in zip(x.split(lengths), masks, sample_denoms, strict=False):
            total = total + (x_i * mask).sum() / torch.clamp_min(denom, 1)
        return total

    return sum_of_sample_mean


def pack_logits_for_rank(
    full_logits: Sequence[Tensor], cp_rank: int, cp_size: int, vocab: slice
) -> Tensor:
    """slime/backends/megatron_utils/data.py L75-87 applied to the model's output: every
    sample CP-sliced and concatenated; this TP rank's vocabulary columns; [1, T_local, V/TP]."""
    rows = [slice_with_cp(logits, cp_rank, cp_size)[:, vocab] for logits in full_logits]
    return torch.cat(rows)[None]


def call_loss(
    args: Any,
    batch: dict[str, Any],
    logits: Tensor,
    loss_fn: Callable[..., tuple[Tensor, dict[str, Tensor]]],
    cp_rank: int,
    cp_size: int,
    num_microbatches: int,
    step_global_batch_size: int,
    dp_cp_size: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """slime/backends/megatron_utils/loss.py L1283-1383: the custom loss's call site and
    the scaling applied to what it returns (calculate_per_token_loss off)."""
    reducer = get_sum_of_sample_mean(
        batch["total_lengths"],
        batch["response_lengths"],
        batch["loss_masks"],
        batch["rollout_mask_sums"],
        cp_rank,
        cp_size,
    )
    loss, log = loss_fn(args, batch, logits, reducer)
    assert loss.dim() == 0 and all(torch.as_tensor(v).dim() == 0 for v in log.values())
    return loss * num_microbatches / step_global_batch_size * dp_cp_size, log


def custom_advantages(
    args: Any,
    data: dict[str, Any],
    cp_rank: int,
    cp_size: int,
    advantage_fn: Callable[[Any, dict[str, Any]], None],
) -> None:
    """slime/backends/megatron_utils/loss.py L704-761 on one rank with
    --custom-advantage-function-path (kl_coef 0, no whitening, no OPD penalty): `kl` is
    zeros shaped like the rank's CP slice of each sample's log-probs (the rollout's here;
    the actor's recomputed log_probs have the same shape), then the function fills
    advantages and returns; this rank's advantages are kept in `data`."""
    rollout_data = dict(data)
    rollout_data["kl"] = [
        torch.zeros(len(slice_log_prob_with_cp(values, len(tokens), response, cp_rank, cp_size)))
        for values, tokens, response in zip(
            data["rollout_log_probs"], data["tokens"], data["response_lengths"], strict=True
        )
    ]
    advantage_fn(args, rollout_data)
    assert len(rollout_data["returns"]) == len(rollout_data["advantages"]) == len(data["tokens"])
    data["advantages"] = rollout_data["advantages"]


def batch_for_rank(
    data: dict[str, Any], indices: Sequence[int], cp_rank: int, cp_size: int
) -> dict[str, Any]:
    """The keys a micro-batch of samples carries into the loss: model.py L584-602 and the
    actor's CP slicing of rollout/teacher log-probs (actor.py L284-299)."""
    tokens = [torch.tensor(data["tokens"][i]) for i in indices]
    totals = [len(t) for t in tokens]
    responses = [data["response_lengths"][i] for i in indices]
    batch: dict[str, Any] = {
        "unconcat_tokens": tokens,
        "total_lengths": totals,
        "response_lengths": responses,
        "loss_masks": [torch.tensor(data["loss_masks"][i], dtype=torch.int) for i in indices],
        "rollout_mask_sums": [torch.tensor(float(data["rollout_mask_sums"][i])) for i in indices],
        "advantages": [data["advantages"][i] for i in indices] if "advantages" in data else None,
        "log_probs": None,
    }
    for key in ("rollout_log_probs", "teacher_log_probs"):
        if key in data:
            batch[key] = [
                torch.tensor(
                    slice_log_prob_with_cp(data[key][i], total, response, cp_rank, cp_size)
                )
                for i, total, response in zip(indices, totals, responses, strict=True)
            ]
        else:
            batch[key] = None
    return batch
