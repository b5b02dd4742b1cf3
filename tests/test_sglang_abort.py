"""SGLang's abort (slime ends a rollout step by POSTing /abort_request {"abort_all": true}
to every engine) against the stand-in: what SGLangPolicy maps it to, and how the Runner
ends the trajectories it cut (invariant 5: aborted, with a reason; the unfinished turn is
never recorded, so never trained)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import torch

from rollout.chat import ChatRenderer, Message, RecordedTurn
from rollout.harness.base import StepOutcome
from rollout.policy import SamplingParams, SGLangPolicy
from rollout.runner import ENGINE_ABORT_REASON, Runner, RunnerConfig, rollout_metrics
from rollout.trajectory import Task, TrajectoryStatus
from slime_ext.cpu_runtime.sglang_http import StandinState, create_standin
from slime_ext.models.factory import build_model
from tests.live_server import serve_in_thread

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.timeout(120)]
PROMPT = [5, 17, 99, 230, 41, 8, 77]
GREEDY = SamplingParams(max_new_tokens=200, temperature=0)


@pytest.fixture(scope="module")
def model(factory_tokenizer: Any) -> Any:
    return build_model("qwen3-tiny", factory_tokenizer, seed=5).eval()


@contextmanager
def _standin(model: Any, **options: Any) -> Iterator[tuple[str, StandinState]]:
    app = create_standin(model, context_length=1024, **options)
    with serve_in_thread(app) as url:
        yield url, app.state.standin


async def _until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the stand-in never reached the awaited state"
        await asyncio.sleep(0.005)


async def _abort(url: str, body: dict[str, Any]) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/abort_request", json=body)
    assert response.status_code == 200 and response.content == b""  # as SGLang answers


def test_abort_all_maps_to_abort_with_the_tokens_so_far(model: Any) -> None:
    """One request decoding, one queued behind it (max_running_requests=1): after
    abort_all the first answers its greedy prefix, the second nothing."""

    async def run() -> tuple[Any, Any, Any, dict[str, Any]]:
        policy = SGLangPolicy(url)
        try:
            first = asyncio.create_task(policy.generate(PROMPT, GREEDY, "traj-a"))
            await _until(lambda: len(state.running) == 1)
            second = asyncio.create_task(policy.generate(PROMPT[:4], GREEDY, "traj-b"))
            await _until(lambda: len(state.waiting) == 1 and _most_tokens(state) >= 3)
            await _abort(url, {"abort_all": True})
            cut, never_started = await first, await second
            async with httpx.AsyncClient() as client:
                loads = (await client.get(f"{url}/v1/loads", params={"include": "core"})).json()
            unaborted = SamplingParams(max_new_tokens=len(cut.output_ids), temperature=0)
            return cut, never_started, await policy.generate(PROMPT, unaborted), loads
        finally:
            await policy.close()

    with _standin(model, token_delay_s=0.01, max_running_requests=1) as (url, state):
        cut, never_started, reference, loads = asyncio.run(run())
    assert cut.finish_reason == "abort" and cut.abort_message == "Aborted"
    assert 3 <= len(cut.output_ids) < GREEDY.max_new_tokens
    assert cut.output_ids == reference.output_ids  # the tokens so far, none re-sampled
    assert torch.allclose(torch.tensor(cut.logprobs), torch.tensor(reference.logprobs))
    assert never_started.finish_reason == "abort"
    assert never_started.abort_message == "Abort in waiting queue"
    assert never_started.output_ids == [] and never_started.logprobs == []
    [load] = loads["loads"]
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0


def test_abort_by_rid_ends_that_request_and_an_unknown_rid_is_ignored(model: Any) -> None:
    params = SamplingParams(max_new_tokens=40, temperature=0)

    async def run() -> tuple[Any, Any]:
        policy = SGLangPolicy(url)
        try:
            tasks = [asyncio.create_task(policy.generate(PROMPT, params)) for _ in range(2)]
            await _until(lambda: len(state.running) == 2 and _fewest_tokens(state) >= 2)
            await _abort(url, {"rid": "no-such-request"})
            target = sorted(state.running)[0]
            await _abort(url, {"rid": target})
            first, second = await asyncio.gather(*tasks)
            return first, second
        finally:
            await policy.close()

    with _standin(model, token_delay_s=0.01) as (url, state):
        first, second = asyncio.run(run())
    finishes = sorted([first.finish_reason, second.finish_reason])
    assert finishes == ["abort", "length"]
    aborted = first if first.finish_reason == "abort" else second
    assert 2 <= len(aborted.output_ids) < params.max_new_tokens


class EchoEpisode:
    """Answers every action with 'ok' and never ends; counts the actions it ran."""

    def __init__(self, executed: list[RecordedTurn]) -> None:
        self.executed = executed

    async def step(self, turn: RecordedTurn) -> StepOutcome:
        self.executed.append(turn)
        return StepOutcome(observation="ok")

    async def reward(self) -> float:
        return 1.0

    def details(self) -> dict[str, Any]:
        return {"steps": len(self.executed)}

    async def close(self) -> None:
        pass


class EchoHarness:
    name = "echo"

    def __init__(self) -> None:
        self.tools: list[dict[str, Any]] = []
        self.executed: dict[str, list[RecordedTurn]] = {}

    def initial_messages(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": task.prompt}]

    async def start(self, task: Task) -> EchoEpisode:
        return EchoEpisode(self.executed.setdefault(task.task_id, []))


def test_the_runner_ends_engine_aborted_trajectories_without_their_unfinished_turn(
    model: Any, factory_tokenizer: Any
) -> None:
    """Two trajectories share one running slot; abort_all lands while one decodes (its
    tokens so far come back) and the other's next turn waits (it gets none)."""
    harness = EchoHarness()
    renderer = ChatRenderer(factory_tokenizer)
    config = RunnerConfig(concurrency=2, max_turns=6, max_new_tokens=24)
    tasks = [Task(task_id=name, kind="echo", prompt=f"task {name}") for name in ("a", "b")]

    async def run() -> list[Any]:
        policy = SGLangPolicy(url)
        try:
            rollout = asyncio.create_task(Runner(harness, policy, renderer, config).run(tasks))
            await _until(
                lambda: (
                    len(state.received_headers) >= 3
                    and len(state.waiting) == 1
                    and _most_tokens(state) >= 1
                )
            )
            await _abort(url, {"abort_all": True})
            return await rollout
        finally:
            await policy.close()

    with _standin(model, token_delay_s=0.01, max_running_requests=1) as (url, state):
        trajectories = asyncio.run(run())
        generate_requests = len(state.received_headers)
    for trajectory in trajectories:
        assert trajectory.status is TrajectoryStatus.ABORTED
        assert trajectory.status_reason == ENGINE_ABORT_REASON
        assert trajectory.reward is None
        assert all(turn.finish_reason != "abort" for turn in trajectory.turns)
        # the sandbox ran the action of every recorded turn, and of no unfinished one
        assert len(harness.executed[trajectory.task.task_id]) == trajectory.num_turns
    records = {t.metadata["engine_abort"]["message"]: t.metadata for t in trajectories}
    assert sorted(records) == ["Abort in waiting queue", "Aborted"]
    assert records["Aborted"]["engine_abort"]["dropped_tokens"] >= 1
    assert records["Abort in waiting queue"]["engine_abort"]["dropped_tokens"] == 0
    for trajectory in trajectories:
        assert trajectory.metadata["engine_abort"]["turn"] == trajectory.num_turns
    # every /generate but the two cut ones became a turn, and no more
    assert sum(t.num_turns for t in trajectories) == generate_requests - 2
    assert sum(t.num_turns for t in trajectories) >= 1
    assert rollout_metrics(trajectories)[f"rollout/abort_count/{ENGINE_ABORT_REASON}"] == 2


def test_slimes_abort_loop_idles_the_standin_and_the_runner_reports_it(
    model: Any, factory_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slime's own abort_server_until_idle (POST /abort_request, then poll /v1/loads until
    no request is left), when slime is installed."""
    control = pytest.importorskip(
        "slime.backends.sglang_utils.server_control", reason="slime is not installed"
    )
    http_utils = pytest.importorskip("slime.utils.http_utils")
    harness = EchoHarness()
    renderer = ChatRenderer(factory_tokenizer)
    config = RunnerConfig(concurrency=1, max_turns=6, max_new_tokens=24)
    task = Task(task_id="slime", kind="echo", prompt="task slime")

    async def run() -> Any:
        policy = SGLangPolicy(url)
        try:
            async with httpx.AsyncClient() as slime_client:
                monkeypatch.setattr(http_utils, "_http_client", slime_client)
                rollout = asyncio.create_task(
                    Runner(harness, policy, renderer, config).run_one(task)
                )
                await _until(lambda: _most_tokens(state) >= 1)
                await asyncio.wait_for(control.abort_server_until_idle(url, 0.05), 20)
                assert not state.running and not state.waiting
                return await rollout
        finally:
            await policy.close()

    with _standin(model, token_delay_s=0.01) as (url, state):
        trajectory = asyncio.run(run())
    assert trajectory.status is TrajectoryStatus.ABORTED
    assert trajectory.status_reason == ENGINE_ABORT_REASON
    assert trajectory.metadata["engine_abort"]["message"] == "Aborted"
    assert len(harness.executed["slime"]) == trajectory.num_turns


def _most_tokens(state: StandinState) -> int:
    return max(state.tokens_so_far().values(), default=0)


def _fewest_tokens(state: StandinState) -> int:
    return min(state.tokens_so_far().values(), default=0)
