"""OPRD on slime: the branch each trajectory trains on, and its weight, carried to the
custom loss in slime's per-token `advantages`.

    --custom-reward-post-process-path  slime_ext.slime.oprd.post_process_rewards
    --custom-advantage-function-path   slime_ext.slime.oprd.advantages

Why this carrier (THUDM/slime at the commit the tests run, tests/slime_cpu.py SLIME_COMMIT):
- a custom loss sees only the keys the trainer's forward_step asks for
  (slime/backends/megatron_utils/model.py, train_one_step.forward_step: tokens, total_lengths,
  response_lengths, loss_masks, log_probs, ref_log_probs, values, advantages, returns,
  rollout_log_probs, teacher_log_probs, rollout_mask_sums): no reward and no metadata
  (Sample.train_metadata becomes train_data["metadata"] in slime/ray/rollout.py,
  _convert_samples_to_train_data, which _split_train_data_by_dp does not ship);
- the reward post-process is the one hook that sees a rollout's samples together
  (slime/ray/rollout.py, _post_process_rewards), as the per-branch means need; the second
  list it returns becomes each sample's train_data["rewards"];
- the custom advantage function turns each rank's rollout_data["rewards"] into per-token
  `advantages` and `returns` shaped like the rank's CP slice of the sample
  (slime/backends/megatron_utils/loss.py, compute_advantages_and_returns).

The value is the trajectory's signed branch share: +G / N+ for a success (raw reward > 0),
-G / N- for a failure, 0 for a removed placeholder. G is --global-batch-size, the rollouts
slime divides a step's loss by (loss.py, loss_function); N+ / N- count the step's live
successes and failures (a step is G consecutive rollout ids in first-seen order:
slime/utils/dp_schedule.py, build_dp_schedule). slime's reduction (each rollout's token
mean, summed, divided by G) times the share is the mean over the branch's trajectories, so
the loss (slime_ext.slime.loss, which applies the lambdas) is L = lambda_+ L_+ +
lambda_- L_-, as the local trainer's `outcome_routed`; an absent branch contributes 0.
"""

from __future__ import annotations

from typing import Any

import torch

from slime_ext.job.slime_flags import OPRD_REFUSED_FLAGS as REFUSED_FLAGS
from slime_ext.slime.reward import raw_rewards
from slime_ext.slime.samples import rollout_id_of
from slime_ext.slime.settings import HookConfigError


def post_process_rewards(args: Any, samples: list[Any]) -> tuple[list[float], list[float]]:
    """(raw rewards, signed branch shares) per sample."""
    raw = raw_rewards(args, samples)
    return raw, branch_shares(samples, raw, int(args.global_batch_size))


def branch_shares(samples: list[Any], raw: list[float], global_batch_size: int) -> list[float]:
    """Each sample's trajectory's signed branch share within its training step."""
    trajectories: dict[int, tuple[bool, bool]] = {}  # (success, live), in first-seen order
    for sample, reward in zip(samples, raw, strict=True):
        trajectories.setdefault(rollout_id_of(sample), (reward > 0, not sample.remove_sample))
    ids = list(trajectories)
    shares: dict[int, float] = {}
    for start in range(0, len(ids), global_batch_size):
        live = [rid for rid in ids[start : start + global_batch_size] if trajectories[rid][1]]
        successes = sum(trajectories[rid][0] for rid in live)
        failures = len(live) - successes
        for rid in live:
            success = trajectories[rid][0]
            shares[rid] = (
                global_batch_size / successes if success else -global_batch_size / failures
            )
    return [shares.get(rollout_id_of(sample), 0.0) for sample in samples]


def advantages(args: Any, rollout_data: dict[str, Any]) -> None:
    """Each sample's branch share on every token of this rank's slice of it, as
    `advantages`; `returns` are the same tensors (slime asks for both; no critic reads them)."""
    for flag, why in REFUSED_FLAGS.items():
        if getattr(args, flag, False):
            raise HookConfigError(f"recipe oprd on slime: {why}")
    # zeros shaped like this rank's CP slice of each sample's log-probs (set just before)
    shapes = rollout_data["kl"]
    shares = [
        torch.full_like(shape, float(share))
        for shape, share in zip(shapes, rollout_data["rewards"], strict=True)
    ]
    rollout_data["advantages"] = shares
    rollout_data["returns"] = shares
