"""Rounds (rollout/rounds.py): admission in job order, a batch cut only when every
generating member has sent its turn, and no member able to stall the others by failing,
leaving or being cancelled at any point."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import pytest

from rollout.chat import ChatRenderer
from rollout.policy import Generation, GenerationRequest, PolicyError, SamplingParams
from rollout.rounds import Rounds
from rollout.runner import Runner, RunnerConfig
from rollout.tasks.arithmetic import make_tasks
from rollout.trajectory import TrajectoryStatus
from slime_ext.local.loop import tir_harness
from tests.scripted_policy import FAIL, ScriptedPolicy, say, tool

PARAMS = SamplingParams(max_new_tokens=4)


class Echo:
    """Each request's first id back, the batches it was given recorded (by first id)."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.fail_on = fail_on

    async def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        ids = [request.input_ids[0] for request in requests]
        self.batches.append(ids)
        await asyncio.sleep(0)
        if self.fail_on in ids:
            raise RuntimeError("the forward failed")
        return [Generation(output_ids=[i], logprobs=[0.0], finish_reason="stop") for i in ids]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_jobs_are_admitted_in_order_as_members_leave_and_a_round_waits_for_all() -> None:
    async def scenario() -> None:
        policy = Echo()
        rounds = Rounds(policy, capacity=2, jobs=3)
        a, b, c = (rounds.member(i) for i in range(3))
        await asyncio.wait_for(a.admitted(), 1)
        await asyncio.wait_for(b.admitted(), 1)
        waiting_c = asyncio.create_task(c.admitted())
        first_a = asyncio.create_task(a.generate([10], PARAMS))
        await _settle()
        assert policy.batches == [] and not waiting_c.done()  # b has not sent its turn
        first_b = asyncio.create_task(b.generate([20], PARAMS))
        assert [g.output_ids for g in await asyncio.gather(first_a, first_b)] == [[10], [20]]
        assert policy.batches == [[10, 20]]  # job order
        second_b = asyncio.create_task(b.generate([21], PARAMS))
        await _settle()
        assert policy.batches == [[10, 20]]  # a is busy (its tool)
        a.leave()  # a stops generating: c takes its place in the same call
        await asyncio.wait_for(waiting_c, 1)
        await _settle()
        assert policy.batches == [[10, 20]]  # c is a member now: the round waits for it
        first_c = asyncio.create_task(c.generate([30], PARAMS))
        await asyncio.gather(second_b, first_c)
        assert policy.batches == [[10, 20], [21, 30]]
        a.leave()  # idempotent
        with pytest.raises(PolicyError, match="outside its round"):
            await a.generate([11], PARAMS)

    asyncio.run(scenario())


def test_a_member_cancelled_while_it_waits_for_its_round_is_not_decoded_nor_waited_for() -> None:
    async def scenario() -> None:
        policy = Echo()
        rounds = Rounds(policy, capacity=2, jobs=2)
        a, b = rounds.member(0), rounds.member(1)
        pending_a = asyncio.create_task(a.generate([10], PARAMS))
        await _settle()
        pending_a.cancel()  # its deadline, while b's tool runs
        with contextlib.suppress(asyncio.CancelledError):
            await pending_a
        a.leave()
        assert (await asyncio.wait_for(b.generate([20], PARAMS), 1)).output_ids == [20]
        assert policy.batches == [[20]]

    asyncio.run(scenario())


def test_a_failed_batch_fails_each_of_its_members_and_the_rounds_go_on() -> None:
    async def scenario() -> None:
        policy = Echo(fail_on=20)
        rounds = Rounds(policy, capacity=2, jobs=2)
        a, b = rounds.member(0), rounds.member(1)
        results = await asyncio.gather(
            a.generate([10], PARAMS), b.generate([20], PARAMS), return_exceptions=True
        )
        assert all(isinstance(r, PolicyError) and "forward failed" in str(r) for r in results)
        b.leave()
        assert (await asyncio.wait_for(a.generate([11], PARAMS), 1)).output_ids == [11]

    asyncio.run(scenario())


class BatchedScripted(ScriptedPolicy):
    """The scripted policy decoding batches (each request as it would alone)."""

    async def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        return list(
            await asyncio.gather(
                *(self.generate(r.input_ids, r.params, r.session_id) for r in requests)
            )
        )


@pytest.mark.timeout(60)
def test_in_rounds_every_trajectory_ends_whatever_its_neighbours_did(
    factory_tokenizer: Any,
) -> None:
    """Sixteen trajectories, 4 at a time, in rounds: some answer at once, some call the
    tool twice, one's harness fails to start, one's generation fails (its batch's members
    end aborted with it); every one ends with a status, none waits for ever."""
    tasks = make_tasks(16, "train", seed=2)

    def script_for(task_id: str, sample: int) -> Any:
        position = [t.task_id for t in tasks].index(task_id)
        if position == 9:
            return FAIL
        calls = [tool("python", code="print(1)")] * (position % 3)
        return [*calls, say("\\boxed{0}")]

    harness = tir_harness()
    start = harness.start

    async def failing_start(task: Any) -> Any:
        if task.task_id == tasks[5].task_id:
            raise RuntimeError("no sandbox")
        return await start(task)

    harness.start = failing_start  # type: ignore[method-assign]
    config = RunnerConfig(concurrency=4, max_turns=4, max_new_tokens=32, rounds=True)
    policy = BatchedScripted(factory_tokenizer, script_for)
    runner = Runner(harness, policy, ChatRenderer(factory_tokenizer, harness.tools), config)
    trajectories = asyncio.run(asyncio.wait_for(runner.run(tasks), 50))
    assert len(trajectories) == 16
    assert all(t.status is not None for t in trajectories)
    assert trajectories[5].status == TrajectoryStatus.ABORTED
    assert trajectories[9].status == TrajectoryStatus.ABORTED
    finished = [t for i, t in enumerate(trajectories) if t.status == TrajectoryStatus.COMPLETED]
    assert len(finished) >= 10
    assert {t.num_turns for t in finished} == {1, 2, 3}


def test_rounds_refuse_a_policy_that_cannot_decode_a_batch(factory_tokenizer: Any) -> None:
    harness = tir_harness()
    policy = ScriptedPolicy(factory_tokenizer, lambda task_id, sample: [say("x")])
    with pytest.raises(ValueError, match="generate_batch"):
        Runner(harness, policy, ChatRenderer(factory_tokenizer, harness.tools),
               RunnerConfig(rounds=True))  # fmt: skip
