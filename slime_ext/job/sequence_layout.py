"""The layout a cluster job trains in: `algorithm.sequence_layout` resolved when the plan
is made, so that the generate hook (which makes the samples) and Megatron (whose layer
spec must take them) agree.

- packed: one tree-packed sample per trajectory, every token once (slime_ext.slime.samples,
  tree, tree_attention); exact for students whose layers are full attention, and for
  Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next), whose linear-attention layers, slime's own,
  run each branch from the trunk's state where it forks (slime_ext.slime.hybrid_attention);
- per_turn: a sample per turn, its whole context recomputed (about the trajectory's turn
  count times its tokens: ~20x for the report's 57-turn SWE trajectories).

`auto` packs a student known to be one of those (its config.json, readable where the plan
is made, or a Qwen3.5 / Qwen3-Next name in the student path or slime's model script), and
stays per turn for a recurrent one or another hybrid family (Mamba, Jamba, RWKV, ...: no
branch from a state here) and for a student the plan cannot see; the plan says which and
why. sft / ssd train slime on pre-tokenized per-turn records.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_ext.job.config import ConfigError, JobConfig

GATED_DELTA_NAME = re.compile(r"qwen3[._-]?5|qwen3[._-]?next", re.IGNORECASE)
"""Names of Gated DeltaNet hybrid families whose slime layers take tree-packed samples."""
RECURRENT_NAME = re.compile(r"mamba|jamba|rwkv|lfm2|falcon[._-]?h1|hybrid", re.IGNORECASE)
"""Names of other hybrid or recurrent families (a student path or slime's model script)."""
GATED_DELTA_TYPES = ("qwen3_5", "qwen3_next")
"""HF model_type prefixes of those families (slime_ext.slime.hybrid_attention.FAMILIES)."""
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
        why = f"recipe {job.algorithm.recipe}: pre-tokenized turns"
        return Resolved("per_turn", why + _cp_caveat(job))
    if wanted == "per_turn":
        why = f"algorithm.sequence_layout per_turn ({PER_TURN_COST})"
        return Resolved("per_turn", why + _cp_caveat(job))
    reason = unpackable_student(job)
    if wanted == "packed":
        if reason is not None and reason.known:
            raise ConfigError(f"algorithm.sequence_layout packed: {reason.text}; use per_turn")
        return Resolved("packed", "algorithm.sequence_layout packed")
    if reason is None:
        return Resolved("packed", f"auto: {packable_student(job)}")
    return Resolved("per_turn", f"auto: {reason.text}, so per turn ({PER_TURN_COST})")


def _cp_caveat(job: JobConfig) -> str:
    """What a per-turn Gated DeltaNet hybrid under context parallelism should know."""
    if job.parallel.cp == 1 or unpackable_student(job) is not None:
        return ""
    if "Gated DeltaNet" not in packable_student(job):
        return ""
    return (
        "; note: under CP slime's own Gated DeltaNet layers lose the gradient that output "
        "chunks on other CP ranks owe to earlier inputs (measured, docs/packing-on-megatron"
        ".md); packed samples run them through the wrapper that completes it"
    )


def packable_student(job: JobConfig) -> str:
    """Why `auto` packs the student (`unpackable_student` found nothing against it)."""
    student = Path(job.model.student)
    names = [str(student), str(job.cluster.model_args_script or "")]
    readable = (student / "config.json").is_file()
    hybrid = readable and _has_linear_attention(_config(student))
    named = not readable and any(GATED_DELTA_NAME.search(name) for name in names)
    if hybrid or named:
        where = "its config.json" if hybrid else "its name"
        return (
            f"the student is a Gated DeltaNet hybrid ({where}): its linear-attention layers, "
            "slime's, run each branch from the trunk's state (slime_ext.slime.hybrid_attention)"
        )
    return "the student is full-attention (its config.json)"


def _config(student: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(student, local_files_only=True)


def _has_linear_attention(config: Any) -> bool:
    from slime_ext.hybrid_tree import LINEAR_ATTENTION, config_layer_types

    return LINEAR_ATTENTION in config_layer_types(config)


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
        try:
            config = _config(student)
        except (OSError, ValueError, KeyError) as err:
            return Reason(f"{student}/config.json does not load here ({err})", known=False)
        why = unpackable_reason(config)
        model_type = str(getattr(config, "model_type", ""))
        hybrid = why is None and _has_linear_attention(config)
        if hybrid and not model_type.startswith(GATED_DELTA_TYPES):
            why = (
                f"this model ({model_type}) has linear-attention layers slime's layers "
                f"for {', '.join(GATED_DELTA_TYPES)} do not cover, so no branch runs "
                "from the trunk's state"
            )
        return None if why is None else Reason(f"{student}: {why}", known=True)
    names = [str(student), str(job.cluster.model_args_script or "")]
    if any(GATED_DELTA_NAME.search(name) for name in names):
        return None
    recurrent = [name for name in names if RECURRENT_NAME.search(name)]
    if recurrent:
        return Reason(
            f"{recurrent[0]} names a recurrent or hybrid family whose state has no mask "
            "for a branch and no layer here that runs one from a state",
            known=True,
        )
    return Reason(
        f"{student}/config.json is not readable where the plan is made, so its layers are "
        "unknown (set algorithm.sequence_layout: packed for a full-attention or Qwen3.5 / "
        "Qwen3-Next student)",
        known=False,
    )


def layout_warning(job: JobConfig) -> str | None:
    """Where `auto` trains per turn only because it cannot see the student (its config.json
    unreadable where the plan is made): what that costs and the setting that decides it."""
    if job.algorithm.recipe in ("sft", "ssd") or job.algorithm.sequence_layout != "auto":
        return None
    reason = unpackable_student(job)
    if reason is None or reason.known:
        return None
    return (
        f"the sequence layout is per turn because {reason.text.split(' (set ')[0]}: per "
        f"turn, {PER_TURN_COST} (about the turn count times the compute of packed). For "
        "a full-attention or Qwen3.5 / Qwen3-Next student set algorithm.sequence_layout: "
        "packed; for another hybrid or recurrent one, per_turn (and this warning goes)"
    )
