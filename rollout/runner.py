"""The async driver: many trajectories at once, each ending with a status and a reason.

Per trajectory: a sandbox (the harness's episode), a deadline, context and generation
budgets per turn, and optionally the teacher's log-probs of every turn's span, requested
as soon as the turn is sampled so scoring overlaps the next turn's generation (per_turn),
or once the trajectory has ended (after: e.g. a critic hint that needs the whole run).
Nothing is dropped: a trajectory that fails, whatever it raised, is recorded with the
failure's status (only a cancellation of the rollout itself propagates); an episode whose
close() failed keeps its status and says so in metadata["close_error"]. An
engine abort (finish_reason 'abort': slime ending a rollout step with SGLang's
/abort_request) ends the trajectory aborted; the unfinished turn is counted, not recorded.
Turns scored per turn or after share a teacher session (the trajectory id, so the teacher
reuses each turn's prefix); when the trajectory ends, however it ends, the runner deletes
that session, best-effort: a failed delete is logged and counted in
metadata["teacher_session_error"], never the trajectory's failure.

Each generation carries a sampling key (`sampling_key`: the task, the sample index, the
turn and, when given, the rollout step), so what a trajectory samples is a function of
the run's seed and those, not of how many trajectories run beside it or how fast their
tools answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, cast, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from rollout.chat import ChatRenderer, Message, TrajectoryBuilder
from rollout.harness.base import SUBMITTED_REASON, Episode, Harness
from rollout.masking import MaskStats
from rollout.policy import (
    BatchPolicy,
    Generation,
    GenerationAborted,
    Policy,
    PolicyError,
    SamplingParams,
)
from rollout.rounds import RoundMember, Rounds
from rollout.trajectory import (
    DEADLINE_REASON,
    MaskTier,
    Task,
    Trajectory,
    TrajectoryStatus,
    Turn,
    infrastructure_abort,
    write_jsonl,
)
from sandbox import SandboxError
from teacher_server.api import ScoreItem, TrajectoryScoreRequest, TrajectoryTurn
from teacher_server.client import TeacherClient, TeacherError

logger = logging.getLogger(__name__)

TEACHER_SESSION_DROP_TIMEOUT_S = 10.0
"""How long the end of a trajectory waits for the teacher to delete its session."""

ENGINE_ABORT_REASON = "engine abort"
"""The status reason of a trajectory whose generation the engine aborted (slime's end of a
rollout step); metadata["engine_abort"] says what the engine said and how many tokens of
the unfinished turn were dropped."""

TeacherContext = Callable[[Task, list[int], Sequence[Turn]], list[int]]
"""Maps turn k's context ids to the teacher's (a hint or reminders inserted; identity for
OPD), given the turns before it (their actions and observations: OPRD's reminders)."""


@runtime_checkable
class AttemptTeacherContext(Protocol):
    """A teacher context that may read the finished attempt first (OPSD with a hint written
    after the trajectory, by a critic or by the student): when `reads_attempt`, the runner
    awaits `for_trajectory` once the episode ended and scores every turn with the view it
    returns (teacher_scoring 'after')."""

    reads_attempt: bool

    def __call__(
        self, task: Task, student_ids: list[int], earlier_turns: Sequence[Turn]
    ) -> list[int]: ...

    async def for_trajectory(self, task: Task, messages: Sequence[Message]) -> TeacherContext: ...


def teacher_context_record(view: TeacherContext, task: Task) -> dict[str, Any] | None:
    """What a teacher view added for `task` (a hint and why there was none), kept in the
    trajectory's metadata["teacher_context"] so a run can be audited: the view's
    `record(task)` where it has one (HintedTeacherContext and its per-attempt views)."""
    record = getattr(view, "record", None)
    return record(task) if callable(record) else None


class RunnerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    concurrency: int = Field(default=8, ge=1)
    """Trajectories in flight at once."""
    max_turns: int = Field(default=16, ge=1)
    max_new_tokens: int = Field(default=512, ge=1)
    """Generation budget of one turn (reference layout: 12,288)."""
    max_context_tokens: int = Field(default=4096, ge=2)
    """Longest context + generation of one turn (reference layout: 65,536)."""
    trajectory_timeout_s: float = Field(default=600.0, gt=0)
    sampling: SamplingParams | None = None
    """Defaults to temperature 1, untruncated, max_new_tokens as above."""
    teacher_scoring: Literal["none", "per_turn", "after", "trajectory"] = "none"
    """per_turn: each span as soon as it is sampled (overlaps the next turn); after: every
    span once the trajectory ended; trajectory: one tree-packed request for the whole
    trajectory once it ended (hf teacher; each token computed once)."""
    teacher_top_k: int = Field(default=0, ge=0)
    rounds: bool = False
    """Decode in rounds (rollout/rounds.py): every generating trajectory's next turn in one
    batch, cut when all have sent theirs, rows in job order; which turns share a batch is
    fixed by the jobs and `concurrency`, not by timing. Needs a policy that decodes
    batches (HFPolicy). False: each request goes to the policy as it comes."""


def sampling_key(trajectory_id: str, turn: int, rollout_step: int | None = None) -> str:
    """The random stream of one turn's generation (`SamplingParams.sampling_key`)."""
    key = f"{trajectory_id}/turn-{turn}"
    return key if rollout_step is None else f"step-{rollout_step}/{key}"


def _ends_trajectory(error: BaseException) -> bool:
    """Whether `error` ends one trajectory rather than the whole rollout: any Exception, and
    a CancelledError this task was not asked for (a callee awaited a future someone else
    cancelled). A cancellation of the rollout itself, KeyboardInterrupt and SystemExit
    propagate."""
    if isinstance(error, asyncio.CancelledError):
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)  # Python 3.11+; 3.10 propagates all
        return cancelling is not None and cancelling() == 0
    return isinstance(error, Exception)


def _error_text(error: BaseException) -> str:
    message = str(error)[:500]
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _log_if_unexpected(trajectory_id: str, during: str, error: BaseException) -> None:
    """A traceback for errors outside the families a harness, sandbox, policy or teacher
    is meant to raise: they are bugs (or hostile input) someone has to read."""
    if not isinstance(error, (asyncio.TimeoutError, SandboxError, TeacherError, PolicyError)):
        logger.error(
            "trajectory %s: %s raised %s",
            trajectory_id,
            during,
            type(error).__name__,
            exc_info=error,
        )


def _status_for(error: BaseException) -> tuple[TrajectoryStatus, str]:
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return TrajectoryStatus.ABORTED, DEADLINE_REASON
    if isinstance(error, SandboxError):
        return TrajectoryStatus.SANDBOX_ERROR, _error_text(error)
    if isinstance(error, TeacherError):
        return TrajectoryStatus.TEACHER_ERROR, _error_text(error)
    if isinstance(error, GenerationAborted):
        return TrajectoryStatus.ABORTED, ENGINE_ABORT_REASON
    if isinstance(error, PolicyError):
        return TrajectoryStatus.ABORTED, f"policy: {error}"
    return TrajectoryStatus.ABORTED, f"unexpected {_error_text(error)}"


class Runner:
    def __init__(
        self,
        harness: Harness,
        policy: Policy,
        renderer: ChatRenderer,
        config: RunnerConfig | None = None,
        teacher: TeacherClient | None = None,
        teacher_context: TeacherContext | None = None,
    ) -> None:
        self.harness = harness
        self.policy = policy
        self.renderer = renderer
        self.config = config or RunnerConfig()
        self.teacher = teacher
        self.teacher_context = teacher_context or (lambda _task, ids, _turns: ids)
        if self.config.teacher_scoring != "none" and teacher is None:
            raise ValueError("teacher_scoring is set but no teacher client was given")
        if self._reads_attempt and self.config.teacher_scoring != "after":
            raise ValueError(
                "the teacher context reads the finished attempt (a hint written after the "
                "trajectory): it needs teacher_scoring 'after'"
            )
        if self.config.rounds and not callable(getattr(policy, "generate_batch", None)):
            raise ValueError(
                f"rounds need a policy that decodes batches (generate_batch), and "
                f"{type(policy).__name__} does not: use HFPolicy or set rounds false"
            )
        if self.config.teacher_scoring == "trajectory" and teacher_context is not None:
            raise ValueError(
                "teacher_scoring 'trajectory' scores the student's own contexts; a teacher "
                "context (hint) needs per_turn or after"
            )
        self.sampling = self.config.sampling or SamplingParams(
            max_new_tokens=self.config.max_new_tokens
        )

    def with_teacher_context(self, teacher_context: TeacherContext) -> Runner:
        """The same runner scoring through another view of the teacher's contexts (on
        slime: one that counts a single trajectory's reminders)."""
        return Runner(
            self.harness, self.policy, self.renderer, self.config, self.teacher, teacher_context
        )

    async def run(
        self,
        tasks: Sequence[Task],
        samples_per_task: int = 1,
        out_jsonl: Path | None = None,
        show_progress: bool = False,
        rollout_step: int | None = None,
    ) -> list[Trajectory]:
        """Every (task, sample) pair once; results in input order, appended to out_jsonl.
        `rollout_step`: which rollout of a training run this is (its step), part of every
        sampling key, so a task drawn again in a later epoch samples afresh."""

        def save(_position: int, trajectory: Trajectory) -> None:
            if out_jsonl is not None:
                write_jsonl(out_jsonl, [trajectory])

        jobs = [(task, index) for task in tasks for index in range(samples_per_task)]
        return await self.run_jobs(jobs, save, show_progress, rollout_step=rollout_step)

    async def run_jobs(
        self,
        jobs: Sequence[tuple[Task, int]],
        on_done: Callable[[int, Trajectory], None] | None = None,
        show_progress: bool = False,
        description: str = "rollouts",
        rollout_step: int | None = None,
    ) -> list[Trajectory]:
        """Each (task, sample index) job once, `concurrency` at a time; `on_done(position,
        trajectory)` as each finishes (to save it before the rest are done); results in
        job order. With `rounds`, the jobs are admitted in job order, each as one before it
        stops generating (rollout/rounds.py)."""
        gate = asyncio.Semaphore(self.config.concurrency)
        rounds = (
            Rounds(cast(BatchPolicy, self.policy), self.config.concurrency, len(jobs))
            if self.config.rounds
            else None
        )
        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            disable=not show_progress,
            transient=True,
        ) as progress:
            bar = progress.add_task(description, total=len(jobs))

            async def one(position: int, task: Task, index: int) -> Trajectory:
                if rounds is None:
                    async with gate:
                        trajectory = await self.run_one(task, index, rollout_step)
                else:
                    member = rounds.member(position)
                    await member.admitted()
                    try:
                        trajectory = await self.run_one(task, index, rollout_step, member)
                    finally:
                        member.leave()
                if on_done is not None:
                    on_done(position, trajectory)
                progress.advance(bar)
                return trajectory

            return list(
                await asyncio.gather(
                    *(one(position, task, index) for position, (task, index) in enumerate(jobs))
                )
            )

    async def run_one(
        self,
        task: Task,
        sample_index: int = 0,
        rollout_step: int | None = None,
        member: RoundMember | None = None,
    ) -> Trajectory:
        """One trajectory, ended with a status and a reason whatever its harness, sandbox,
        policy or teacher raise (DESIGN.md invariant 5); only a cancellation of the rollout
        itself (and KeyboardInterrupt, SystemExit) propagates, after the episode is closed.
        `member`: its place in run_jobs' rounds (generates through them, leaves them when
        it stops generating)."""
        trajectory_id = f"{task.task_id}#{sample_index}"
        started = time.monotonic()
        failure: BaseException | None = None
        try:
            messages = self.harness.initial_messages(task)
        except Exception as error:  # recorded with the task's prompt as its only message
            messages, failure = [{"role": "user", "content": task.prompt}], error
        builder = TrajectoryBuilder(self.renderer, task, messages, trajectory_id, sample_index)
        scoring: list[asyncio.Task[None]] = []
        episodes: list[Episode] = []
        views: list[TeacherContext] = [self.teacher_context]  # the last one scored the turns
        status, reason, reward = TrajectoryStatus.TRUNCATED, "max turns", None
        metadata: dict[str, Any] = {}
        try:
            if failure is None:
                status, reason, reward = await asyncio.wait_for(
                    self._episode(task, builder, episodes, scoring, views, rollout_step, member),
                    self.config.trajectory_timeout_s,
                )
        except BaseException as error:
            if not _ends_trajectory(error):
                raise
            failure = error
        finally:
            for pending in scoring:
                pending.cancel()
            await asyncio.gather(*scoring, return_exceptions=True)
            if scoring and (drop_error := await self._drop_session(trajectory_id)) is not None:
                logger.warning(
                    "trajectory %s: its teacher session was not deleted: %s",
                    trajectory_id,
                    _error_text(drop_error),
                )
                metadata["teacher_session_error"] = _error_text(drop_error)
            for episode in episodes:
                if (close_error := await _close(episode)) is not None:
                    _log_if_unexpected(trajectory_id, "closing its episode", close_error)
                    metadata["close_error"] = _error_text(close_error)
        if failure is not None:
            status, reason = _status_for(failure)
            reward = None
            _log_if_unexpected(trajectory_id, "its episode", failure)
            if isinstance(failure, GenerationAborted):
                metadata["engine_abort"] = {
                    "message": failure.engine_message,
                    "turn": len(builder.turns),
                    "dropped_tokens": failure.partial_tokens,
                }
        if episodes and (details := _details(episodes[0])) is not None:
            metadata["episode"] = details
        if self.teacher is not None and (record := teacher_context_record(views[-1], task)):
            metadata["teacher_context"] = record
        trajectory = builder.finish(status, reason, reward, metadata or None)
        trainable = trajectory.status in (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED)
        if self.config.teacher_scoring == "trajectory" and trajectory.turns and trainable:
            try:
                await self._score_whole(trajectory)
            except BaseException as error:
                if not _ends_trajectory(error):
                    raise
                _log_if_unexpected(trajectory_id, "scoring it", error)
                trajectory.status, trajectory.status_reason = _status_for(error)
        trajectory.wall_s = time.monotonic() - started
        return trajectory

    async def _drop_session(self, session_id: str) -> BaseException | None:
        """Delete the teacher's session of a trajectory whose turns were scored with it
        (after every scoring task ended: none stores it back); what failed instead of
        raising it (a rollout's own cancellation still propagates)."""
        assert self.teacher is not None
        try:
            await asyncio.wait_for(
                self.teacher.drop_session(session_id), TEACHER_SESSION_DROP_TIMEOUT_S
            )
        except BaseException as error:
            if not _ends_trajectory(error):
                raise
            return error
        return None

    async def _score_whole(self, trajectory: Trajectory) -> None:
        assert self.teacher is not None
        started = time.perf_counter()
        request = TrajectoryScoreRequest(
            trunk_ids=trajectory.trunk_ids,
            turns=[
                TrajectoryTurn(
                    context_len=turn.context_len,
                    context_suffix_ids=turn.context_suffix_ids,
                    span_ids=turn.span_ids,
                )
                for turn in trajectory.turns
            ],
            top_k=self.config.teacher_top_k,
            temperature=self.sampling.temperature or 1.0,
        )
        results = await self.teacher.score_trajectory(request)
        share = (time.perf_counter() - started) / len(results)
        for turn, result in zip(trajectory.turns, results, strict=True):
            turn.teacher_logprobs = result.logprobs
            turn.teacher_topk_ids = result.top_k_ids
            turn.teacher_topk_logprobs = result.top_k_logprobs
            turn.timings.teacher_s += share

    async def _episode(
        self,
        task: Task,
        builder: TrajectoryBuilder,
        episodes: list[Episode],
        scoring: list[asyncio.Task[None]],
        views: list[TeacherContext],
        rollout_step: int | None,
        member: RoundMember | None,
    ) -> tuple[TrajectoryStatus, str, float | None]:
        try:
            episode = await self.harness.start(task)
            episodes.append(episode)
            generate = self.policy.generate if member is None else member.generate
            status, reason = await self._turns(
                task, builder, episode, scoring, rollout_step, generate
            )
        finally:
            if member is not None:  # its rounds go on without it
                member.leave()
            end_session = getattr(self.policy, "end_session", None)
            if callable(end_session):  # a local policy's prefix of this trajectory
                end_session(builder.trajectory_id)
        reward = await episode.reward()
        if self.config.teacher_scoring == "after" and builder.turns:
            view = self.teacher_context
            if self._reads_attempt:
                assert isinstance(self.teacher_context, AttemptTeacherContext)
                view = await self.teacher_context.for_trajectory(task, builder.messages)
                views.append(view)
            for k in range(len(builder.turns)):
                previous = scoring[-1] if scoring else None
                scoring.append(
                    asyncio.create_task(self._score(task, builder, k, view, after=previous))
                )
        await asyncio.gather(*scoring)
        return status, reason, reward

    async def _turns(
        self,
        task: Task,
        builder: TrajectoryBuilder,
        episode: Episode,
        scoring: list[asyncio.Task[None]],
        rollout_step: int | None,
        generate: Callable[..., Awaitable[Generation]],
    ) -> tuple[TrajectoryStatus, str]:
        for turn in range(self.config.max_turns):
            context = builder.next_context()
            budget = min(
                self.sampling.max_new_tokens, self.config.max_context_tokens - len(context)
            )
            if budget < 1:
                return TrajectoryStatus.TRUNCATED, "context budget"
            key = sampling_key(builder.trajectory_id, turn, rollout_step)
            params = self.sampling.model_copy(
                update={"max_new_tokens": budget, "sampling_key": key}
            )
            generation = await generate(context, params, builder.trajectory_id)
            if generation.finish_reason == "abort":  # a partial span is not a turn
                raise GenerationAborted(
                    generation.abort_message or "abort", len(generation.output_ids)
                )
            if not generation.output_ids:
                raise PolicyError(f"empty generation ({generation.finish_reason})")
            recorded = builder.record_turn(
                generation.output_ids,
                generation.logprobs,
                generation.finish_reason,
                generation.model_s,
            )
            if self.config.teacher_scoring == "per_turn":
                previous = scoring[-1] if scoring else None
                scoring.append(
                    asyncio.create_task(
                        self._score(
                            task, builder, recorded.index, self.teacher_context, after=previous
                        )
                    )
                )
            step_started = time.perf_counter()
            outcome = await episode.step(recorded)
            sandbox_s = time.perf_counter() - step_started
            if outcome.tier is not None:
                builder.set_tier(recorded.index, outcome.tier)
            if outcome.observation is not None:
                builder.record_observation(outcome.observation, sandbox_s=sandbox_s)
            else:
                builder.turns[-1].timings.sandbox_s += sandbox_s
            if outcome.done:
                status = (
                    TrajectoryStatus.TRUNCATED
                    if outcome.truncated
                    else (TrajectoryStatus.COMPLETED)
                )
                return status, outcome.reason or "done"
        return TrajectoryStatus.TRUNCATED, "max turns"

    @property
    def _reads_attempt(self) -> bool:
        context = self.teacher_context
        return isinstance(context, AttemptTeacherContext) and context.reads_attempt

    async def _score(
        self,
        task: Task,
        builder: TrajectoryBuilder,
        k: int,
        view: TeacherContext,
        after: asyncio.Task[None] | None = None,
    ) -> None:
        """The teacher's log-probs of turn k's span, given the teacher's view of its context;
        asked once `after` (the previous turn's scoring) ended, however it ended: the
        teacher's session then always holds turn k-1 when turn k arrives, and what it
        reuses (so the rounding of its log-probs) does not depend on request timing."""
        assert self.teacher is not None
        if after is not None:
            await asyncio.wait([after])
        turn = builder.turns[k]
        context = builder.turn_context_ids(k)
        teacher_context = view(task, context, builder.turns[:k])
        started = time.perf_counter()
        [result] = await self.teacher.score(
            [
                ScoreItem(
                    input_ids=teacher_context + turn.span_ids,
                    span_start=len(teacher_context),
                    top_k=self.config.teacher_top_k,
                    session_id=builder.trajectory_id,
                    temperature=self.sampling.temperature or 1.0,
                )
            ]
        )
        turn.teacher_logprobs = result.logprobs
        turn.teacher_topk_ids = result.top_k_ids
        turn.teacher_topk_logprobs = result.top_k_logprobs
        turn.timings.teacher_s += time.perf_counter() - started


async def _close(episode: Episode) -> BaseException | None:
    """Close `episode`; what it raised instead of raising it (a rollout's own cancellation
    still propagates)."""
    try:
        await episode.close()
    except BaseException as error:
        if not _ends_trajectory(error):
            raise
        return error
    return None


def _details(episode: Episode) -> dict[str, Any] | None:
    try:
        return episode.details()
    except Exception as error:
        return {"details_error": _error_text(error)}


def trajectory_summary(trajectory: Trajectory) -> dict[str, Any]:
    """What the step metrics need of one trajectory (JSON; travels in slime's metadata)."""
    turns = trajectory.turns
    return {
        "trajectory_id": trajectory.trajectory_id,
        "task_id": trajectory.task.task_id,
        "status": trajectory.status.value,
        "status_reason": trajectory.status_reason,
        "reward": trajectory.reward,
        "num_turns": len(turns),
        "span_tokens": [len(turn.span_ids) for turn in turns],
        "mask_tiers": [int(turn.mask_tier) for turn in turns],
        "model_s": [turn.timings.model_s for turn in turns],
        "sandbox_s": [turn.timings.sandbox_s for turn in turns],
        "teacher_s": [turn.timings.teacher_s for turn in turns],
        "wall_s": trajectory.wall_s,
        "close_error": (trajectory.metadata or {}).get("close_error"),
        "teacher_session_error": (trajectory.metadata or {}).get("teacher_session_error"),
    }


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """rollout/ and perf/ metrics of one step (DESIGN.md names)."""
    return summary_metrics([trajectory_summary(t) for t in trajectories])


def summary_metrics(summaries: Sequence[dict[str, Any]]) -> dict[str, float]:
    """rollout/ and perf/ metrics over trajectory summaries (`trajectory_summary`)."""
    count = max(sum(s["num_turns"] for s in summaries), 1)
    trajectories = max(len(summaries), 1)
    stats = MaskStats()
    for summary in summaries:
        for tier in summary["mask_tiers"]:
            stats.turns[MaskTier(tier)] += 1
    statuses = Counter(s["status"] for s in summaries)
    completed = TrajectoryStatus.COMPLETED.value
    aborts = Counter(s["status_reason"] for s in summaries if s["status"] != completed)
    close_errors = Counter(
        s["close_error"].partition(":")[0] for s in summaries if s.get("close_error")
    )
    session_errors = Counter(
        s["teacher_session_error"].partition(":")[0]
        for s in summaries
        if s.get("teacher_session_error")
    )
    rewards = [s["reward"] for s in summaries if s["reward"] is not None]
    invalid = stats.turns[MaskTier.INVALID_ACTION]
    submitted = sum(1 for s in summaries if s["status_reason"] == SUBMITTED_REASON)
    aborted = sum(1 for s in summaries if infrastructure_abort(s["status"], s["status_reason"]))
    return {
        "rollout/num_turns": sum(s["num_turns"] for s in summaries) / trajectories,
        # the agent's health: turns whose action parsed as a valid tool call, and (SWE)
        # trajectories the agent ended by submitting
        "rollout/valid_action_frac": 1.0 - invalid / max(stats.total, 1),
        "rollout/submitted_frac": submitted / trajectories,
        "rollout/aborted": float(aborted),  # the infrastructure ended them (opd eval's aborts)
        "rollout/tokens_per_turn": sum(sum(s["span_tokens"]) for s in summaries) / count,
        "rollout/reward": sum(rewards) / max(len(rewards), 1),
        "rollout/pass_rate": sum(r > 0 for r in rewards) / trajectories,
        "perf/model_time_per_turn": sum(sum(s["model_s"]) for s in summaries) / count,
        "perf/sandbox_time_per_turn": sum(sum(s["sandbox_s"]) for s in summaries) / count,
        "perf/teacher_time_per_turn": sum(sum(s["teacher_s"]) for s in summaries) / count,
        **{f"rollout/{key}": value for key, value in stats.metrics().items()},
        **{f"rollout/status_{key}": float(value) for key, value in statuses.items()},
        **{f"rollout/abort_count/{key}": float(value) for key, value in aborts.items()},
        **{f"rollout/close_error_count/{k}": float(v) for k, v in close_errors.items()},
        **{f"rollout/teacher_session_error_count/{k}": float(v) for k, v in session_errors.items()},
    }
