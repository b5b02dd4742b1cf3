"""Outcome rewards on slime: one reward per trajectory, however many samples it became.

    --custom-rm-path                  slime_ext.slime.reward.reward
    --custom-reward-post-process-path slime_ext.slime.reward.post_process_rewards

The generate hook already sets each sample's reward to its trajectory's (the harness grades
inside the episode), so slime calls `reward` only for samples that lack one; it accepts a
sample or a list (slime/rollout/rm_hub, batched_async_rm). slime's default post-process
normalizes over the flattened list of samples, weighting a trajectory by its turn count
(slime/ray/rollout.py, _post_process_rewards): ours normalizes one reward per rollout_id
within its prompt group (group_index) and gives every sample its trajectory's value.
Removed placeholders (aborted trajectories) stay out of the group statistics.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from slime_ext.slime.samples import METADATA_KEY, rollout_id_of
from slime_ext.slime.settings import UNSUPPORTED_SLIME_ARGS, HookConfigError

STD_ESTIMATORS = ("grpo", "gspo", "cispo")
MEAN_ESTIMATORS = (*STD_ESTIMATORS, "reinforce_plus_plus_baseline")


async def reward(args: Any, samples: Any) -> Any:
    """The trajectory's reward recorded by the generate hook (a list for a list)."""
    if getattr(args, "group_rm", False) or (
        isinstance(samples, list) and any(isinstance(s, list) for s in samples)
    ):
        raise HookConfigError(f"--group-rm: {UNSUPPORTED_SLIME_ARGS['group_rm']}")
    if isinstance(samples, list):
        return [_trajectory_reward(s) for s in samples]
    return _trajectory_reward(samples)


def _trajectory_reward(sample: Any) -> float:
    summary = (sample.metadata or {}).get(METADATA_KEY)
    if summary is None:
        raise ValueError(
            "the sample carries no trajectory summary: was it made by "
            "slime_ext.slime.generate.generate?"
        )
    return float(summary["reward"] or 0.0)


def post_process_rewards(args: Any, samples: list[Any]) -> tuple[list[float], list[float]]:
    """(raw, normalized) per sample: group-normalized per trajectory, as slime expects."""
    raw = raw_rewards(args, samples)
    estimator = getattr(args, "advantage_estimator", "grpo")
    if not getattr(args, "rewards_normalization", True) or estimator not in MEAN_ESTIMATORS:
        return raw, list(raw)
    use_std = estimator in STD_ESTIMATORS and getattr(args, "grpo_std_normalization", True)
    per_rollout: dict[int, float] = {}
    groups: dict[Any, list[int]] = defaultdict(list)
    for sample, value in zip(samples, raw, strict=True):
        rid = rollout_id_of(sample)
        if rid in per_rollout or sample.remove_sample:
            continue
        per_rollout[rid] = value
        groups[sample.group_index].append(rid)
    normalized: dict[int, float] = {}
    for members in groups.values():
        values = [per_rollout[rid] for rid in members]
        mean = statistics.fmean(values)
        std = statistics.stdev(values) if len(values) > 1 else 0.0  # unbiased, as torch.std
        for rid, value in zip(members, values, strict=True):
            normalized[rid] = (value - mean) / (std + 1e-6) if use_std else value - mean
    return raw, [normalized.get(rollout_id_of(s), 0.0) for s in samples]


def raw_rewards(args: Any, samples: list[Any]) -> list[float]:
    """Each sample's reward as slime reads it (Sample.get_reward_value: --reward-key)."""
    return [
        float(s.get_reward_value(args)) if hasattr(s, "get_reward_value") else float(s.reward)
        for s in samples
    ]
