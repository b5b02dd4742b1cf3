"""The rollout deletes its teacher sessions: when a trajectory ends, however it ends, the
runner deletes the session its turns were scored with, after the last of those requests,
best-effort (a failed delete is counted, never the trajectory's failure)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import rollout.runner as runner_module
from rollout.chat import ChatRenderer
from rollout.harness.tir import TIRHarness
from rollout.policy import GenerationAborted
from rollout.runner import Runner, RunnerConfig, rollout_metrics
from rollout.trajectory import TrajectoryStatus
from sandbox import SandboxDiedError
from slime_ext.models.factory import build_checkpoint
from teacher_server.api import ScoreItem, ScoreResult
from teacher_server.app import create_app
from teacher_server.client import TeacherClient, TeacherUnavailable
from teacher_server.hf_backend import HFBackend
from teacher_server.metrics import ServerMetrics
from tests.live_server import serve_in_thread
from tests.test_runner import (
    FAULT_TASKS,
    REPLIES,
    TASKS,
    FaultPlan,
    FaultyHarness,
    FaultyPolicy,
    FaultyTeacher,
    ScriptedPolicy,
    cancel_mid_run,
)

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.timeout(120)]
TRAJECTORIES = [f"{task.task_id}#0" for task in FAULT_TASKS]


class SessionTeacher(FaultyTeacher):
    """FaultyTeacher with DELETE: records each session's deletes, and any score of that
    session still in flight at its delete or started after it."""

    def __init__(self, plan: FaultPlan, drop_error: BaseException | None = None) -> None:
        super().__init__(plan)
        self.drop_error = drop_error
        self.hang = False
        self.scored: set[str] = set()
        self.in_flight: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.out_of_order: list[str] = []

    async def score(self, items: Sequence[ScoreItem]) -> list[ScoreResult]:
        [item] = items
        session = item.session_id
        assert session is not None
        if self.dropped[session]:
            self.out_of_order.append(f"{session} scored after its delete")
        self.scored.add(session)
        self.in_flight[session] += 1
        try:
            return await super().score(items)
        finally:
            self.in_flight[session] -= 1

    async def drop_session(self, session_id: str) -> bool:
        if self.in_flight[session_id]:
            self.out_of_order.append(f"{session_id} deleted while scored")
        self.dropped[session_id] += 1
        if self.hang:
            await asyncio.sleep(3600)
        await asyncio.sleep(0)
        if self.drop_error is not None:
            raise self.drop_error
        return True


def _runner(factory_tokenizer: Any, plan: FaultPlan, teacher: Any, scoring: str) -> Runner:
    renderer = ChatRenderer(factory_tokenizer)
    return Runner(
        FaultyHarness(plan),
        FaultyPolicy(renderer, plan),
        renderer,
        RunnerConfig(concurrency=3, teacher_scoring=scoring, trajectory_timeout_s=30),  # type: ignore[arg-type]
        teacher=teacher,
    )


class EngineAbort(GenerationAborted):
    """An engine abort as FaultPlan raises it (one message argument)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, partial_tokens=3)


ENDINGS = [
    ("", 1, TypeError),  # no fault: all complete
    ("teacher.score", 1, TypeError),
    ("teacher.score", 2, asyncio.CancelledError),
    ("policy.generate", 2, EngineAbort),
    ("episode.step", 2, SandboxDiedError),
    ("sandbox.exec", 1, KeyError),
    ("episode.reward", 1, RecursionError),
    ("episode.close", 1, TypeError),
    ("harness.start", 1, TypeError),  # before any turn: nothing scored, nothing to delete
]


@pytest.mark.parametrize("scoring", ["per_turn", "after"])
@pytest.mark.parametrize(("point", "occurrence", "error"), ENDINGS)
def test_every_trajectory_deletes_its_session_once_after_its_last_score(
    factory_tokenizer: Any,
    point: str,
    occurrence: int,
    error: type[BaseException],
    scoring: str,
) -> None:
    plan = FaultPlan("victim#0", point, occurrence, error)
    teacher = SessionTeacher(plan)
    trajectories = asyncio.run(_runner(factory_tokenizer, plan, teacher, scoring).run(FAULT_TASKS))
    assert {t.trajectory_id for t in trajectories} == set(TRAJECTORIES)
    assert teacher.scored >= {"a#0", "b#0"}
    assert dict(teacher.dropped) == dict.fromkeys(teacher.scored, 1)
    assert teacher.out_of_order == []
    a, victim, b = trajectories
    assert a.status is b.status is TrajectoryStatus.COMPLETED
    if point and not point.endswith(".close"):
        assert victim.status is not TrajectoryStatus.COMPLETED
    assert all("teacher_session_error" not in (t.metadata or {}) for t in trajectories)


def test_a_cancelled_rollout_deletes_its_sessions_before_it_propagates(
    factory_tokenizer: Any,
) -> None:
    plan = FaultPlan()
    teacher = SessionTeacher(plan)
    runner = _runner(factory_tokenizer, plan, teacher, "per_turn")
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancel_mid_run(runner, plan))
    assert teacher.scored == set(TRAJECTORIES)
    assert dict(teacher.dropped) == dict.fromkeys(TRAJECTORIES, 1)
    assert teacher.out_of_order == []


@pytest.mark.parametrize("failure", ["error", "hang"])
def test_a_failed_delete_is_counted_never_the_trajectorys_failure(
    factory_tokenizer: Any, failure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = FaultPlan()
    teacher = SessionTeacher(plan, TeacherUnavailable("teacher down"))
    if failure == "hang":
        teacher.hang = True
        monkeypatch.setattr(runner_module, "TEACHER_SESSION_DROP_TIMEOUT_S", 0.05)
    trajectories = asyncio.run(
        _runner(factory_tokenizer, plan, teacher, "per_turn").run(FAULT_TASKS)
    )
    expected = "TeacherUnavailable" if failure == "error" else "TimeoutError"
    for trajectory in trajectories:
        assert trajectory.status is TrajectoryStatus.COMPLETED and trajectory.reward == 1.0
        assert all(turn.teacher_logprobs is not None for turn in trajectory.turns)
        assert trajectory.metadata["teacher_session_error"].startswith(expected)
    assert rollout_metrics(trajectories)[f"rollout/teacher_session_error_count/{expected}"] == 3


def test_a_runner_that_scores_no_turn_deletes_no_session(factory_tokenizer: Any) -> None:
    plan = FaultPlan()
    teacher = SessionTeacher(plan)
    trajectories = asyncio.run(_runner(factory_tokenizer, plan, teacher, "none").run(FAULT_TASKS))
    assert [t.status for t in trajectories] == [TrajectoryStatus.COMPLETED] * 3
    assert not teacher.scored and not teacher.dropped


@pytest.mark.timeout(180)
def test_the_teacher_holds_no_session_after_a_rollout(
    factory_tokenizer: Any, tmp_path: Path
) -> None:
    """Sessions used to stay in the teacher's cache until evicted: under churn, budget
    spent on trajectories that had ended."""
    metrics = ServerMetrics()
    backend = HFBackend(build_checkpoint("qwen3-tiny", tmp_path / "t", seed=3), metrics)
    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    with serve_in_thread(create_app(backend, metrics)) as url:

        async def run() -> Any:
            async with TeacherClient(url) as teacher:
                runner = Runner(
                    harness,
                    ScriptedPolicy(renderer, REPLIES),
                    renderer,
                    RunnerConfig(concurrency=3, teacher_scoring="per_turn"),
                    teacher=teacher,
                )
                return await runner.run(TASKS)

        trajectories = asyncio.run(run())
    assert all(t.status is TrajectoryStatus.COMPLETED for t in trajectories)
    assert all(turn.teacher_logprobs for t in trajectories for turn in t.turns)
    assert metrics.cached_tokens_total > 0  # turns reused their session's prefix
    sessions = backend.scorer.sessions
    assert len(sessions) == 0 and sessions.in_flight == 0 and sessions.total_bytes == 0
