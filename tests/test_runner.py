"""The rollout runner: TIR end to end, robustness under failures, per-turn teacher scores."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout.chat import ChatRenderer, Message, RecordedTurn
from rollout.harness.base import StepOutcome
from rollout.harness.tir import TIRHarness
from rollout.policy import Generation, SamplingParams
from rollout.rewards.math import grade_answer, last_boxed
from rollout.runner import Runner, RunnerConfig, rollout_metrics
from rollout.toolcalls import ToolCall, render_tool_call
from rollout.trajectory import MaskTier, Task, TrajectoryStatus, read_jsonl
from sandbox import SandboxDiedError
from slime_ext.models.factory import build_checkpoint
from teacher_server.api import ScoreItem, ScoreResult
from teacher_server.app import create_app
from teacher_server.client import TeacherClient
from teacher_server.hf_backend import HFBackend
from teacher_server.metrics import ServerMetrics
from tests.live_server import serve_in_thread

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class ScriptedPolicy:
    """Replays fixed replies per task (the test's model), as ids a model would sample."""

    def __init__(self, renderer: ChatRenderer, replies: dict[str, list[str]]) -> None:
        self.renderer = renderer
        self.replies = replies
        self.calls: dict[str, int] = {}

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        assert session_id is not None
        task_id = session_id.split("#")[0]
        index = self.calls.get(session_id, 0)
        self.calls[session_id] = index + 1
        ids = [*self.renderer.encode(self.replies[task_id][index]), self.renderer.eos_id]
        return Generation(output_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")


def _python(code: str, think: str = "Let me compute.") -> str:
    call = render_tool_call(ToolCall(name="python", arguments={"code": code}))
    return f"<think>\n{think}\n</think>\n\n{call}"


def _answer(value: str) -> str:
    return f"<think>\nDone.\n</think>\n\nThe answer is \\boxed{{{value}}}."


TASKS = [
    Task(task_id="mul", kind="tir", prompt="What is 12 * 7 + 3?", answer="87"),
    Task(task_id="half", kind="tir", prompt="What is 3 / 6?", answer="\\frac{1}{2}"),
    Task(task_id="wrong", kind="tir", prompt="What is 2 + 2?", answer="4"),
]
REPLIES = {
    "mul": [_python("x = 12 * 7"), _python("print(x + 3)", "x persists."), _answer("87")],
    "half": ["I am not sure what to do.", _python("print(3 / 6)"), _answer("0.5")],
    "wrong": [_python("print(2 + 2)"), _answer("5")],
}


@pytest.mark.parametrize(
    ("answer", "reference", "expected"),
    [
        ("1/2", "0.5", 1.0),
        ("0.5", "\\frac{1}{2}", 1.0),
        ("\\frac{1}{2}", "1/2", 1.0),
        ("87", "87", 1.0),
        ("86", "87", 0.0),
        (None, "87", 0.0),
        ("x^2+1", "1+x^2", 1.0),
    ],
)
def test_math_grading_accepts_equivalent_forms(
    answer: str | None, reference: str, expected: float
) -> None:
    assert asyncio.run(grade_answer(answer, reference)) == expected


def test_last_boxed_balances_braces() -> None:
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("no answer") is None
    assert last_boxed("\\boxed{unclosed") is None


@pytest.mark.timeout(120)
def test_tir_runner_end_to_end(factory_tokenizer: Any, tmp_path: Path) -> None:
    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    runner = Runner(
        harness,
        ScriptedPolicy(renderer, REPLIES),
        renderer,
        RunnerConfig(concurrency=3, max_new_tokens=256),
    )
    out = tmp_path / "trajectories.jsonl"
    trajectories = asyncio.run(runner.run(TASKS, out_jsonl=out))
    by_task = {t.task.task_id: t for t in trajectories}
    assert by_task["mul"].reward == 1.0 and by_task["half"].reward == 1.0
    assert by_task["wrong"].reward == 0.0
    assert all(t.status is TrajectoryStatus.COMPLETED for t in trajectories)
    assert by_task["mul"].status_reason == "boxed answer"
    # the python worker kept x between calls; the observation is in the next context
    assert "87" in factory_tokenizer.decode(by_task["mul"].trunk_ids)
    half = by_task["half"].turns
    assert [t.mask_tier for t in half] == [MaskTier.INVALID_ACTION, MaskTier.VALID, MaskTier.VALID]
    assert len(list(read_jsonl(out))) == 3
    metrics = rollout_metrics(trajectories)
    assert metrics["rollout/pass_rate"] == pytest.approx(2 / 3)
    assert metrics["rollout/masked_turn_frac_tier1"] == pytest.approx(1 / 8)  # 8 turns


class FlakyEpisode:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.steps = 0

    async def step(self, turn: RecordedTurn) -> StepOutcome:
        await asyncio.sleep(self.rng.uniform(0, 0.02))
        if self.rng.random() < 0.1:
            raise SandboxDiedError("simulated: the sandbox died under the command")
        self.steps += 1
        done = self.steps >= 3
        return StepOutcome(
            observation=None if done else f"ok {self.steps}",
            done=done,
            tier=MaskTier.VALID,
            reason="finished",
        )

    async def reward(self) -> float:
        return 1.0

    def details(self) -> dict[str, Any]:
        return {"steps": self.steps}

    async def close(self) -> None:
        pass


class FlakyHarness:
    """A harness whose sandbox fails 10% of calls (a test double for the runner)."""

    name = "flaky"

    def __init__(self) -> None:
        self.rng = random.Random(0)
        self.tools: list[dict[str, Any]] = []

    def initial_messages(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": task.prompt}]

    async def start(self, task: Task) -> FlakyEpisode:
        return FlakyEpisode(random.Random(self.rng.random()))


class SlowPolicy:
    """Random latency; a few calls hang far past the trajectory deadline."""

    def __init__(self, renderer: ChatRenderer) -> None:
        self.renderer = renderer
        self.rng = random.Random(1)

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        await asyncio.sleep(30.0 if self.rng.random() < 0.04 else self.rng.uniform(0, 0.05))
        ids = [*self.renderer.encode("step"), self.renderer.eos_id]
        return Generation(output_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop")


@pytest.mark.timeout(60)
def test_fifty_concurrent_trajectories_all_end_with_a_status(
    factory_tokenizer: Any, tmp_path: Path
) -> None:
    renderer = ChatRenderer(factory_tokenizer)
    deadline_s = 1.5
    runner = Runner(
        FlakyHarness(),
        SlowPolicy(renderer),
        renderer,
        RunnerConfig(concurrency=50, trajectory_timeout_s=deadline_s),
    )
    tasks = [Task(task_id=f"t{i}", kind="flaky", prompt=f"task {i}") for i in range(50)]
    out = tmp_path / "out.jsonl"
    trajectories = asyncio.run(runner.run(tasks, out_jsonl=out))
    assert len(trajectories) == 50
    assert len({t.trajectory_id for t in read_jsonl(out)}) == 50
    statuses = {t.status for t in trajectories}
    assert TrajectoryStatus.SANDBOX_ERROR in statuses and TrajectoryStatus.ABORTED in statuses
    assert TrajectoryStatus.COMPLETED in statuses
    for trajectory in trajectories:
        assert trajectory.status_reason
        assert trajectory.wall_s <= deadline_s + 0.5
        if trajectory.status is TrajectoryStatus.ABORTED:
            assert trajectory.status_reason == "trajectory deadline"
            assert trajectory.reward is None
    aborts = rollout_metrics(trajectories)
    assert aborts["rollout/abort_count/trajectory deadline"] >= 1


def test_context_budget_truncates(factory_tokenizer: Any) -> None:
    renderer = ChatRenderer(factory_tokenizer)
    runner = Runner(
        FlakyHarness(), SlowPolicy(renderer), renderer, RunnerConfig(max_context_tokens=8)
    )
    [trajectory] = asyncio.run(runner.run([Task(task_id="x", kind="flaky", prompt="p")]))
    assert trajectory.status is TrajectoryStatus.TRUNCATED
    assert trajectory.status_reason == "context budget" and trajectory.num_turns == 0


def _turn_ids(trajectory: Any) -> Sequence[tuple[list[int], list[int]]]:
    return [
        (trajectory.context_ids(k), trajectory.span_ids(k)) for k in range(trajectory.num_turns)
    ]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["per_turn", "after"])
def test_stored_teacher_scores_equal_a_direct_teacher_forward(
    factory_tokenizer: Any, tmp_path: Path, mode: str
) -> None:
    teacher_dir = build_checkpoint("qwen3-tiny", tmp_path / "teacher", seed=8)
    metrics = ServerMetrics()
    backend = HFBackend(teacher_dir, metrics, max_context=4096)
    teacher_model = backend.scorer.model
    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    with serve_in_thread(create_app(backend, metrics)) as url:

        async def run() -> Any:
            async with TeacherClient(url) as teacher:
                runner = Runner(
                    harness,
                    ScriptedPolicy(renderer, REPLIES),
                    renderer,
                    RunnerConfig(concurrency=3, teacher_scoring=mode),
                    teacher=teacher,
                )
                return await runner.run(TASKS)

        trajectories = asyncio.run(run())
    for trajectory in trajectories:
        assert trajectory.status is TrajectoryStatus.COMPLETED
        for (context, span), turn in zip(_turn_ids(trajectory), trajectory.turns, strict=True):
            with torch.no_grad():
                logits = teacher_model(input_ids=torch.tensor([context + span])).logits[0]
            rows = torch.log_softmax(logits[len(context) - 1 : -1].float(), dim=-1)
            expected = rows.gather(-1, torch.tensor(span)[:, None])[:, 0]
            assert turn.teacher_logprobs is not None
            assert torch.allclose(torch.tensor(turn.teacher_logprobs), expected, atol=1e-5)
    assert json.loads(trajectories[0].to_json_line())["turns"][0]["teacher_logprobs"]


class FaultPlan:
    """Counts the await points each trajectory reaches (policy, harness, episode, sandbox,
    teacher) and, at the `occurrence`-th time trajectory `victim` reaches `point`, fails
    there with `error` (a CancelledError: by awaiting a future someone else cancelled)."""

    def __init__(
        self,
        victim: str = "",
        point: str = "",
        occurrence: int = 1,
        error: type[BaseException] = TypeError,
    ) -> None:
        self.victim, self.point, self.occurrence, self.error = victim, point, occurrence, error
        self.seen: dict[str, Counter[str]] = defaultdict(Counter)

    async def reach(self, trajectory_id: str, point: str) -> None:
        await asyncio.sleep(0)
        self.seen[trajectory_id][point] += 1
        hit = trajectory_id == self.victim and point == self.point
        if hit and self.seen[trajectory_id][point] == self.occurrence:
            if self.error is asyncio.CancelledError:
                cancelled = asyncio.get_running_loop().create_future()
                cancelled.cancel()
                await cancelled
            raise self.error("injected")


class FaultySandbox:
    def __init__(self, plan: FaultPlan, trajectory_id: str) -> None:
        self.plan, self.trajectory_id = plan, trajectory_id

    async def exec(self, cmd: str) -> str:
        await self.plan.reach(self.trajectory_id, "sandbox.exec")
        return f"ran {cmd}"

    async def close(self) -> None:
        await self.plan.reach(self.trajectory_id, "sandbox.close")


class FaultyEpisode:
    """Two tool turns through its sandbox, then done with reward 1."""

    def __init__(self, plan: FaultPlan, trajectory_id: str, sandbox: FaultySandbox) -> None:
        self.plan, self.trajectory_id, self.sandbox = plan, trajectory_id, sandbox
        self.steps = 0

    async def step(self, turn: RecordedTurn) -> StepOutcome:
        await self.plan.reach(self.trajectory_id, "episode.step")
        observation = await self.sandbox.exec(f"step {self.steps}")
        self.steps += 1
        done = self.steps >= 2
        return StepOutcome(observation=None if done else observation, done=done, reason="done")

    async def reward(self) -> float:
        await self.plan.reach(self.trajectory_id, "episode.reward")
        return 1.0

    def details(self) -> dict[str, Any]:
        return {"steps": self.steps}

    async def close(self) -> None:
        await self.plan.reach(self.trajectory_id, "episode.close")
        await self.sandbox.close()


class FaultyHarness:
    name = "faulty"

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self.tools: list[dict[str, Any]] = []

    def initial_messages(self, task: Task) -> list[Message]:
        if self.plan.point == "harness.initial_messages" and task.task_id == "victim":
            raise self.plan.error("injected")
        return [{"role": "user", "content": task.prompt}]

    async def start(self, task: Task) -> FaultyEpisode:
        trajectory_id = f"{task.task_id}#0"
        await self.plan.reach(trajectory_id, "harness.start")
        sandbox = FaultySandbox(self.plan, trajectory_id)
        await self.plan.reach(trajectory_id, "sandbox.start")
        return FaultyEpisode(self.plan, trajectory_id, sandbox)


class FaultyPolicy:
    def __init__(self, renderer: ChatRenderer, plan: FaultPlan) -> None:
        self.renderer, self.plan = renderer, plan

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        assert session_id is not None
        await self.plan.reach(session_id, "policy.generate")
        ids = [*self.renderer.encode("step"), self.renderer.eos_id]
        return Generation(output_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop")


class FaultyTeacher:
    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan

    async def score(self, items: Sequence[ScoreItem]) -> list[ScoreResult]:
        [item] = items
        assert item.session_id is not None
        await self.plan.reach(item.session_id, "teacher.score")
        return [ScoreResult(logprobs=[-1.0] * (len(item.input_ids) - item.span_start))]


FAULT_POINTS = [
    ("harness.start", 1),
    ("sandbox.start", 1),
    ("policy.generate", 1),
    ("policy.generate", 2),
    ("teacher.score", 1),
    ("teacher.score", 2),
    ("episode.step", 1),
    ("episode.step", 2),
    ("sandbox.exec", 1),
    ("sandbox.exec", 2),
    ("episode.reward", 1),
    ("episode.close", 1),
    ("sandbox.close", 1),
]
FAULT_TASKS = [Task(task_id=name, kind="faulty", prompt=name) for name in ("a", "victim", "b")]


def _faulty_runner(factory_tokenizer: Any, plan: FaultPlan) -> Runner:
    renderer = ChatRenderer(factory_tokenizer)
    teacher: Any = FaultyTeacher(plan)
    return Runner(
        FaultyHarness(plan),
        FaultyPolicy(renderer, plan),
        renderer,
        RunnerConfig(concurrency=3, teacher_scoring="per_turn", trajectory_timeout_s=30),
        teacher=teacher,
    )


def test_fault_points_are_every_await_of_a_trajectory(factory_tokenizer: Any) -> None:
    plan = FaultPlan()
    trajectories = asyncio.run(_faulty_runner(factory_tokenizer, plan).run(FAULT_TASKS))
    assert [t.status for t in trajectories] == [TrajectoryStatus.COMPLETED] * 3
    reached = sorted(
        (point, n) for point, count in plan.seen["victim#0"].items() for n in range(1, count + 1)
    )
    assert reached == sorted(FAULT_POINTS)


@pytest.mark.parametrize(
    "error",
    [TypeError, KeyError, OverflowError, RecursionError, asyncio.CancelledError, SandboxDiedError],
)
@pytest.mark.parametrize(("point", "occurrence"), FAULT_POINTS)
def test_any_error_at_any_await_ends_only_its_trajectory(
    factory_tokenizer: Any, point: str, occurrence: int, error: type[BaseException]
) -> None:
    plan = FaultPlan("victim#0", point, occurrence, error)
    trajectories = asyncio.run(_faulty_runner(factory_tokenizer, plan).run(FAULT_TASKS))
    a, victim, b = trajectories
    assert a.status is b.status is TrajectoryStatus.COMPLETED and a.reward == b.reward == 1.0
    metrics = rollout_metrics(trajectories)
    if point.endswith(".close"):  # the turns and reward stand; the failed close is counted
        assert victim.status is TrajectoryStatus.COMPLETED and victim.reward == 1.0
        assert victim.metadata["close_error"].partition(":")[0] == error.__name__
        assert metrics[f"rollout/close_error_count/{error.__name__}"] == 1
        return
    if error is SandboxDiedError:
        assert victim.status is TrajectoryStatus.SANDBOX_ERROR
        assert victim.status_reason == "SandboxDiedError: injected"
    else:
        assert victim.status is TrajectoryStatus.ABORTED
        assert victim.status_reason.startswith(f"unexpected {error.__name__}")
    assert victim.reward is None
    assert metrics[f"rollout/abort_count/{victim.status_reason}"] == 1
    assert not any(key.startswith("rollout/close_error_count/") for key in metrics)
    if point not in ("harness.start", "sandbox.start"):  # the started episode was closed
        assert plan.seen["victim#0"]["sandbox.close"] == 1


def test_an_error_building_the_first_messages_ends_only_its_trajectory(
    factory_tokenizer: Any,
) -> None:
    plan = FaultPlan("victim#0", "harness.initial_messages", 1, KeyError)
    a, victim, b = asyncio.run(_faulty_runner(factory_tokenizer, plan).run(FAULT_TASKS))
    assert a.status is b.status is TrajectoryStatus.COMPLETED
    assert victim.status is TrajectoryStatus.ABORTED
    assert victim.status_reason == "unexpected KeyError: 'injected'"
    assert "victim#0" not in plan.seen  # no episode was started


async def cancel_mid_run(runner: Runner, plan: FaultPlan) -> None:
    """Run FAULT_TASKS and cancel the rollout once its episodes took 3 steps."""
    rollout = asyncio.create_task(runner.run(FAULT_TASKS))
    while sum(seen["episode.step"] for seen in plan.seen.values()) < 3:
        await asyncio.sleep(0)
    rollout.cancel()
    await rollout


def test_a_cancelled_rollout_propagates_after_closing_its_episodes(
    factory_tokenizer: Any,
) -> None:
    plan = FaultPlan()
    runner = _faulty_runner(factory_tokenizer, plan)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancel_mid_run(runner, plan))
    assert [plan.seen[f"{t.task_id}#0"]["sandbox.close"] for t in FAULT_TASKS] == [1, 1, 1]


class Halt(BaseException):
    """Not an Exception (as KeyboardInterrupt and SystemExit are not): ends the rollout."""


def test_a_base_exception_in_a_trajectory_ends_the_rollout(factory_tokenizer: Any) -> None:
    plan = FaultPlan("victim#0", "episode.step", 1, Halt)
    with pytest.raises(Halt):
        asyncio.run(_faulty_runner(factory_tokenizer, plan).run(FAULT_TASKS))
