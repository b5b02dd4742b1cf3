"""The layout a cluster job trains in: `algorithm.sequence_layout` resolved when the plan
is made, so that the generate hook (which makes the samples) and Megatron (whose layer
spec must take them) agree.

- packed: one tree-packed sample per trajectory, every token once (slime_ext.slime.samples,
  tree, tree_attention); exact only for students whose every layer is full attention;
- per_turn: a sample per turn, its whole context recomputed (about the trajectory's turn
  count times its tokens: ~20x for the report's 57-turn SWE trajectories).

`auto` packs a student known to be full-attention (its config.json, readable where the plan
is made), and stays per turn for a hybrid or recurrent one (Qwen3.5, Qwen3-Next: their
linear-attention state has no mask for a branch, and slime's layers for them do not yet run
a branch from the trunk's state as the embedded trainer does, slime_ext.hybrid_tree) and
for a student the plan cannot see; the plan says which and why. sft / ssd train slime on pre-tokenized per-turn records.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from slime_ext.job.config import ConfigError, JobConfig

HYBRID_NAME = re.compile(
    r"qwen3[._-]?5|qwen3[._-]?next|mamba|jamba|rwkv|lfm2|falcon[._-]?h1|hybrid", re.IGNORECASE
)
"""Names of hybrid or recurrent families (a student path or slime's model script)."""
PER_TURN_COST = "each turn recomputes its whole context"


@dataclass(frozen=True)
class Resolved:
    layout: str
    """"packed" or "per_turn"."""
    why: str


def resolve(job: JobConfig) -> Resolved:
    wanted = job.algorithm.sequence_layout
    if job.algorithm.recipe in ("sft", "ssd"):
        if wanted == "packed":
            raise ConfigError(
                "algorithm.sequence_layout packed: recipes sft and ssd train slime on "
                "pre-tokenized per-turn records (slime_ext.slime.sft_rollout); use auto or "
                "per_turn"
            )
        return Resolved("per_turn", f"recipe {job.algorithm.recipe}: pre-tokenized turns")
    if wanted == "per_turn":
        return Resolved("per_turn", f"algorithm.sequence_layout per_turn ({PER_TURN_COST})")
    reason = unpackable_student(job)
    if wanted == "packed":
        if reason is not None and reason.known:
            raise ConfigError(f"algorithm.sequence_layout packed: {reason.text}; use per_turn")
        return Resolved("packed", "algorithm.sequence_layout packed")
    if reason is None:
        return Resolved("packed", "auto: the student is full-attention (its config.json)")
    return Resolved("per_turn", f"auto: {reason.text}, so per turn ({PER_TURN_COST})")


@dataclass(frozen=True)
class Reason:
    text: str
    known: bool
    """False: the plan could not tell (packing may still be right: set it explicitly)."""


def unpackable_student(job: JobConfig) -> Reason | None:
    """Why the student cannot be trained tree-packed, or None when it can."""
    from slime_ext.turns import unpackable_reason

    student = Path(job.model.student)
    if (student / "config.json").is_file():
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(student, local_files_only=True)
        except (OSError, ValueError, KeyError) as err:
            return Reason(f"{student}/config.json does not load here ({err})", known=False)
        why = unpackable_reason(config)
        return None if why is None else Reason(f"{student}: {why}", known=True)
    names = [str(student), str(job.cluster.model_args_script or "")]
    hybrid = [name for name in names if HYBRID_NAME.search(name)]
    if hybrid:
        return Reason(
            f"{hybrid[0]} names a hybrid (linear-attention) or recurrent family, whose "
            "state has no mask for a branch",
            known=True,
        )
    return Reason(
        f"{student}/config.json is not readable where the plan is made, so its layers are "
        "unknown (set algorithm.sequence_layout: packed for a full-attention student)",
        known=False,
    )
