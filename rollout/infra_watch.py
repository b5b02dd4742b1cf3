"""When a run must stop because its peers are gone: every rollout of a step failed on its
sandbox or its teacher. One rule for the local trainer (`LocalRun`) and a cluster job
(slime's rollout log hook, `slime_ext.slime.metrics`).

The first step of a process whose rollouts all fail stops the run at once (a set-up that
cannot work: a run of steps that train nothing would look like a run); after a step that
trained, INFRA_FAILED_STEPS such steps in a row stop it (a peer that died and stayed dead).
A step that loses some rollouts trains on the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rollout.trajectory import TrajectoryStatus

INFRASTRUCTURE_FAILURES = (TrajectoryStatus.SANDBOX_ERROR, TrajectoryStatus.TEACHER_ERROR)
INFRA_FAILED_STEPS = 3
"""Steps in a row whose every rollout failed on a sandbox or the teacher: the run stops."""


class RolloutsFailedError(RuntimeError):
    """Every rollout of a step failed on infrastructure (`InfrastructureWatch`)."""


@dataclass
class InfrastructureWatch:
    failed_steps: int = 0
    """Steps in a row whose every rollout failed on a peer."""
    stepped: bool = False
    """A step of this process got rollouts to train on."""

    def verdict(self, outcomes: Sequence[tuple[str, str]]) -> str | None:
        """Take one step's (status, status_reason) per trajectory; why the run must stop
        (the first failure's status and reason, which name the peer), or None."""
        failures = {status.value for status in INFRASTRUCTURE_FAILURES}
        failed = [(status, reason) for status, reason in outcomes if status in failures]
        if not outcomes or len(failed) < len(outcomes):
            self.failed_steps, self.stepped = 0, True
            return None
        self.failed_steps += 1
        if self.stepped and self.failed_steps < INFRA_FAILED_STEPS:
            return None
        status, reason = failed[0]
        before = f", and in the {self.failed_steps - 1} steps before" if self.stepped else ""
        return f"all {len(outcomes)} rollouts failed ({status}: {reason.strip()[:500]}){before}"
