"""When a cluster job stops because its peers are gone (rollout.infra_watch, the local
trainer's rule, applied in slime's rollout log hook): the samples of a step whose every
trajectory failed on the teacher or a sandbox, as our generate hook returns them."""

from __future__ import annotations

from typing import Any

import pytest

from rollout.infra_watch import INFRA_FAILED_STEPS, InfrastructureWatch, RolloutsFailedError
from rollout.trajectory import Task, Trajectory, TrajectoryStatus
from slime_ext.slime import metrics
from slime_ext.slime.samples import to_samples
from tests.slime_driver import sample_class

TEACHER_DOWN = "TeacherUnavailable: POST http://10.0.0.7:8100/v1/score: connection refused"


def _step(statuses: list[TrajectoryStatus]) -> list[Any]:
    """One rollout step's flattened samples: one trajectory per status, no turns."""
    samples = []
    for index, status in enumerate(statuses):
        failed = status in (TrajectoryStatus.TEACHER_ERROR, TrajectoryStatus.SANDBOX_ERROR)
        trajectory = Trajectory(
            trajectory_id=f"t{index}",
            trunk_ids=[1, 2, 3],
            task=Task(task_id=f"task{index}", kind="tir", prompt="2 + 3?", answer="5"),
            status=status,
            status_reason=TEACHER_DOWN if failed else "answered",
        )
        base = sample_class()(index=index, prompt="2 + 3?", rollout_id=index)
        samples += to_samples(trajectory, base, "kl")
    return samples


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> InfrastructureWatch:
    fresh = InfrastructureWatch()
    monkeypatch.setattr(metrics, "_WATCH", fresh)
    return fresh


def test_a_first_step_that_only_fails_on_the_teacher_stops_the_job_naming_it(
    watch: InfrastructureWatch,
) -> None:
    with pytest.raises(RolloutsFailedError, match="rollout 0: all 3 rollouts failed") as raised:
        metrics.check_infrastructure(0, _step([TrajectoryStatus.TEACHER_ERROR] * 3))
    assert "http://10.0.0.7:8100" in str(raised.value)


def test_after_a_trained_step_it_takes_three_failed_steps_in_a_row(
    watch: InfrastructureWatch,
) -> None:
    failed = [TrajectoryStatus.TEACHER_ERROR, TrajectoryStatus.SANDBOX_ERROR]
    metrics.check_infrastructure(0, _step([TrajectoryStatus.COMPLETED, *failed]))
    for rollout_id in range(1, INFRA_FAILED_STEPS):
        metrics.check_infrastructure(rollout_id, _step(failed))
    # one rollout that got through resets the count
    metrics.check_infrastructure(3, _step([TrajectoryStatus.TRUNCATED, *failed]))
    for rollout_id in range(4, 4 + INFRA_FAILED_STEPS - 1):
        metrics.check_infrastructure(rollout_id, _step(failed))
    with pytest.raises(RolloutsFailedError, match=r"and in the 2 steps before"):
        metrics.check_infrastructure(9, _step(failed))


def test_aborted_trajectories_are_the_policys_not_a_peers(watch: InfrastructureWatch) -> None:
    metrics.check_infrastructure(0, _step([TrajectoryStatus.ABORTED] * 2))
    assert watch.failed_steps == 0 and watch.stepped
