"""Rollout metrics for W&B from the samples slime collected in one rollout step.

    --custom-rollout-log-function-path slime_ext.slime.metrics.log_rollout

slime calls `log_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time)`
with the flattened samples before training (slime/observability/rollout_metrics.py,
log_rollout_data); a truthy return would skip its own logging. Ours adds the DESIGN.md
rollout/ and perf/ metrics, computed once per trajectory (samples of one rollout_id share
a summary), into `rollout_extra_metrics`, which slime's default logging then writes in
the same W&B call; it returns False so that logging still runs. OPSD's hint counts are
the run's so far (the latest); OPRD's reminder counts are the step's (each trajectory's
own, added up), as the local trainer logs them. It also hands the step's samples to
`slime_ext.slime.topk.record_step` and `slime_ext.slime.tree.record_step`: slime splits
exactly this list by DP rank next, and the teacher's top-k rows and the packed samples'
trees ride that split. And it stops the job when every rollout of a step failed on its
sandbox or its teacher (`check_infrastructure`).

perf/processed_tokens_per_loss_token is the local trainer's: the tokens the training
forward runs over (every kept sample's, padding excluded) per loss-carrying token, so the
layout's cost (per turn: every context again; tree-packed: about 1) shows in every run.
"""

from __future__ import annotations

import logging
from typing import Any

from rollout.infra_watch import InfrastructureWatch, RolloutsFailedError
from rollout.reminders import ReminderStats
from rollout.runner import summary_metrics
from slime_ext.losses import masked_mean
from slime_ext.slime import topk, tree
from slime_ext.slime.samples import (
    FLEET_STATS_KEY,
    HINT_STATS_KEY,
    METADATA_KEY,
    REMINDER_STATS_KEY,
    rollout_id_of,
)

logger = logging.getLogger(__name__)
_WATCH = InfrastructureWatch()
"""The job's: slime's RolloutManager (one per job) calls log_rollout once per step."""


def log_rollout(
    rollout_id: int,
    args: Any,
    samples: list[Any],
    rollout_extra_metrics: dict[str, Any] | None,
    rollout_time: float,
) -> bool:
    topk.record_step(samples)  # the teacher's top-k rows, for slime's DP split (topk.py)
    tree.record_step(samples)  # the trees of packed samples, the same way (tree.py)
    check_infrastructure(rollout_id, samples)
    metrics = sample_metrics(samples)
    if rollout_extra_metrics is not None:
        rollout_extra_metrics.update(metrics)
        return False
    # slime's rollout function returned no metrics dict to extend (a replayed rollout:
    # slime then logs nothing of the rollout): log ours separately, to W&B and the console
    from slime.observability import logging_utils, metric_utils

    step = metric_utils.compute_rollout_step(args, rollout_id)
    logger.info("opd rollout %d: %s", rollout_id, metrics)
    logging_utils.log(args, metrics | {"rollout/step": step}, step_key="rollout/step")
    return False


def check_infrastructure(rollout_id: int, samples: list[Any]) -> None:
    """Stop the job when its peers are gone (rollout.infra_watch's rule, the local
    trainer's): raised here, in slime's RolloutManager before training, the error ends
    train.py with the peer's address in its reason."""
    summaries: dict[int, dict[str, Any]] = {}
    for sample in samples:
        summary = (sample.metadata or {}).get(METADATA_KEY)
        if summary is not None and "num_turns" in summary:  # an episode, not an SFT record
            summaries.setdefault(rollout_id_of(sample), summary)
    if not summaries:
        return
    outcomes = [(s["status"], s.get("status_reason") or "") for s in summaries.values()]
    verdict = _WATCH.verdict(outcomes)
    if verdict is not None:
        raise RolloutsFailedError(
            f"rollout {rollout_id}: {verdict}; nothing was trained on them. Fix the cause "
            "and launch the job again: it resumes from its last checkpoint"
        )


def sample_metrics(samples: list[Any]) -> dict[str, float]:
    summaries: dict[int, dict[str, Any]] = {}
    records: dict[int, list[int]] = {}
    kl_by_rollout: dict[int, tuple[float, float, int]] = {}
    for sample in samples:
        summary = (sample.metadata or {}).get(METADATA_KEY)
        if summary is None:
            continue
        rid = rollout_id_of(sample)
        if "num_turns" not in summary:  # a pre-tokenized record (sft_rollout): no episode
            records.setdefault(rid, []).append(int(sample.response_length))
            continue
        summaries.setdefault(rid, summary)
        if sample.teacher_log_probs is None or sample.remove_sample:
            continue
        kl, above, tokens = _sampled_kl(sample)
        old = kl_by_rollout.get(rid, (0.0, 0.0, 0))
        kl_by_rollout[rid] = (old[0] + kl, old[1] + above, old[2] + tokens)
    if records and not summaries:
        return record_metrics(records) | token_metrics(samples)
    metrics = summary_metrics(list(summaries.values())) | token_metrics(samples)
    metrics["rollout/drift_turns"] = float(sum(s.get("drift_turns", 0) for s in summaries.values()))
    hint_stats: list[dict[str, float]] = [
        s[HINT_STATS_KEY] for s in summaries.values() if HINT_STATS_KEY in s
    ]
    if hint_stats:  # counts since the run started, as the local trainer logs them: the latest
        latest = max(hint_stats, key=_hints_asked)
        metrics.update(latest)
    fleet_stats = [s[FLEET_STATS_KEY] for s in summaries.values() if s.get(FLEET_STATS_KEY)]
    if fleet_stats:  # counters since the fleet opened: the latest (most sandboxes acquired)
        metrics.update(max(fleet_stats, key=lambda stats: stats["rollout/sandbox_acquired"]))
    reminder_stats = [s[REMINDER_STATS_KEY] for s in summaries.values() if REMINDER_STATS_KEY in s]
    if reminder_stats:
        step = ReminderStats()
        for counts in reminder_stats:
            step.add(ReminderStats(**counts))
        metrics.update(step.metrics())
    means = [(kl / n, above / n) for kl, above, n in kl_by_rollout.values() if n]
    if means:
        # per trajectory, then over trajectories (invariant 7), at the rollout's log-probs
        metrics["rollout/opd_reverse_kl"] = sum(m[0] for m in means) / len(means)
        metrics["rollout/student_gt_teacher_frac"] = sum(m[1] for m in means) / len(means)
    return metrics


def token_metrics(samples: list[Any]) -> dict[str, float]:
    """perf/processed_tokens, perf/loss_tokens and their ratio over the samples slime
    trains (removed placeholders left out)."""
    kept = [s for s in samples if not s.remove_sample]
    processed = sum(len(s.tokens) for s in kept)
    loss = sum(sum(s.loss_mask) if s.loss_mask is not None else s.response_length for s in kept)
    metrics = {"perf/processed_tokens": float(processed), "perf/loss_tokens": float(loss)}
    if loss:
        metrics["perf/processed_tokens_per_loss_token"] = processed / loss
    return metrics


def record_metrics(records: dict[int, list[int]]) -> dict[str, float]:
    """SFT / SSD data (pre-tokenized records, one list of span lengths per trajectory)."""
    turns = [len(spans) for spans in records.values()]
    spans = [length for lengths in records.values() for length in lengths]
    return {
        "rollout/num_turns": sum(turns) / len(turns),
        "rollout/tokens_per_turn": sum(spans) / len(spans),
        "rollout/trajectories": float(len(turns)),
    }


def _hints_asked(stats: dict[str, float]) -> float:
    return sum(
        stats.get(f"rollout/hint_{key}", 0.0)
        for key in ("count", "leak_refusals", "missing", "errors")
    )


def _sampled_kl(sample: Any) -> tuple[float, float, int]:
    """Sums over the sample's loss tokens of k_t = s - t and of [s > t], and their count."""
    import torch

    mask = torch.tensor(sample.loss_mask or [1] * sample.response_length, dtype=torch.bool)
    student = torch.as_tensor(sample.rollout_log_probs, dtype=torch.float64)
    teacher = torch.as_tensor(sample.teacher_log_probs, dtype=torch.float64)
    count = int(mask.sum())
    k = masked_mean(student - teacher, mask) * count
    above = masked_mean((student > teacher).double(), mask) * count
    return float(k), float(above), count
