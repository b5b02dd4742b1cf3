"""The invalid-turn classifier (DESIGN.md invariant 4) and per-run masking statistics.

Tier 1: the turn has no valid action (no tool call, unknown tool, malformed arguments).
Tier 2: the action ran and the top-level shell refused it: command not found (exit 127)
or a shell syntax error (exit 2). A legitimate failure (a test that fails, a real
traceback, a missing command inside a script the model ran) is valid and trained on.
Which losses drop which tier is the recipe's choice: `loss_mask_for`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from rollout.toolcalls import ToolCallError
from rollout.trajectory import MaskTier, Trajectory

# Messages from the shell that ran the model's command (bash -c / -lc, or sh/dash), not
# from a script it started: those name the script ("./run.sh: line 3: ...").
_SHELL = r"(?:(?:/usr)?/bin/)?(?:ba|da)?sh"
_NOT_FOUND = re.compile(
    rf"^{_SHELL}: (?:line \d+: |-c: line \d+: |\d+: )?\S.*?: (?:command )?not found\s*$",
    re.MULTILINE,
)
_SYNTAX = re.compile(
    rf"^{_SHELL}: (?:-c: )?(?:line \d+: |\d+: )?(?:syntax error|unexpected EOF while looking for)",
    re.MULTILINE,
)
COMMAND_NOT_FOUND_EXIT = 127
SHELL_SYNTAX_EXIT = 2


def shell_refused(exit_code: int | None, output: str) -> bool:
    """True when the shell itself rejected the command (command not found, syntax error)."""
    if exit_code == COMMAND_NOT_FOUND_EXIT:
        return bool(_NOT_FOUND.search(output))
    if exit_code == SHELL_SYNTAX_EXIT:
        return bool(_SYNTAX.search(output))
    return False


def classify_turn(
    parse_error: ToolCallError | None,
    exit_code: int | None = None,
    output: str = "",
    shell: bool = True,
) -> MaskTier:
    """The tier of one turn: its tool-call parse error (if any), then how its command ended.

    `output` is the command's stderr (or stderr + stdout); `shell` is False for tools that
    do not run a shell (the TIR python tool), whose failures are always trained on.
    """
    if parse_error is not None:
        return MaskTier.INVALID_ACTION
    if shell and shell_refused(exit_code, output):
        return MaskTier.SHELL_ERROR
    return MaskTier.VALID


def loss_mask_for(
    tier: MaskTier,
    loss: Literal["imitation", "kl"],
    train_kl_on_invalid: bool = True,
    imitate_invalid: bool = False,
) -> bool:
    """Whether a turn of `tier` carries loss: imitation losses (SFT, SSD, OPRD's success
    NLL) leave invalid turns out (the error masking; `imitate_invalid` turns it off, for
    its ablation); KL-to-teacher losses train on them unless configured off."""
    if tier is MaskTier.VALID:
        return True
    return train_kl_on_invalid if loss == "kl" else imitate_invalid


@dataclass
class MaskStats:
    """Turns per tier over a run, and the masked share (the reference report: 2.45%)."""

    turns: dict[MaskTier, int] = field(default_factory=lambda: dict.fromkeys(MaskTier, 0))

    def add(self, trajectory: Trajectory) -> None:
        for turn in trajectory.turns:
            self.turns[turn.mask_tier] += 1

    @property
    def total(self) -> int:
        return sum(self.turns.values())

    def metrics(self) -> dict[str, float]:
        total = max(self.total, 1)
        tier1 = self.turns[MaskTier.INVALID_ACTION]
        tier2 = self.turns[MaskTier.SHELL_ERROR]
        return {
            "masked_turn_frac": (tier1 + tier2) / total,
            "masked_turn_frac_tier1": tier1 / total,
            "masked_turn_frac_tier2": tier2 / total,
            "turns": float(self.total),
        }
