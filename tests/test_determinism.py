"""A run's samples are a function of (seed, task, sample index, turn): not of how the local
policy batches requests, how fast tools answer, or how loaded the machine is."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.chat import ChatRenderer, RecordedTurn
from rollout.harness.base import Episode, StepOutcome
from rollout.harness.tir import TIRHarness
from rollout.policy import (
    SGLANG_MAX_SEED,
    Generation,
    GenerationRequest,
    HFPolicy,
    Policy,
    SamplingParams,
    SGLangPolicy,
    request_seed,
)
from rollout.runner import Runner, RunnerConfig
from rollout.tasks.arithmetic import make_tasks
from rollout.trajectory import Task, Trajectory, read_jsonl
from slime_ext.job.config import config_from_dict
from slime_ext.local.loop import LocalRun, tir_harness
from slime_ext.models.refs import bundled_models
from teacher_server.app import create_app
from teacher_server.hf_backend import HFBackend
from teacher_server.metrics import ServerMetrics
from tests import host_load
from tests.live_server import serve_in_thread
from tests.scripted_policy import ScriptedPolicy, say, tool

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
PROMPT = [5, 17, 99, 230, 41, 8, 77, 12, 300, 4]


@pytest.fixture(scope="module")
def student() -> tuple[Any, Any]:
    """The bundled demo student: it calls the python tool, so tool latency is real."""
    path, _ = bundled_models()
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


class SlowTools:
    """The TIR harness with every step delayed by a random 0..max_delay_s (its own seed):
    trajectories reach the policy in another order and in other company."""

    def __init__(self, harness: TIRHarness, delay_seed: int, max_delay_s: float) -> None:
        self.harness = harness
        self.name, self.tools = harness.name, harness.tools
        self.rng = random.Random(delay_seed)
        self.max_delay_s = max_delay_s

    def initial_messages(self, task: Task) -> Any:
        return self.harness.initial_messages(task)

    async def start(self, task: Task) -> Episode:
        return _SlowEpisode(await self.harness.start(task), self)


class _SlowEpisode:
    def __init__(self, episode: Episode, harness: SlowTools) -> None:
        self.episode, self.harness = episode, harness

    async def step(self, turn: RecordedTurn) -> StepOutcome:
        await asyncio.sleep(self.harness.rng.uniform(0, self.harness.max_delay_s))
        return await self.episode.step(turn)

    async def reward(self) -> float:
        return await self.episode.reward()

    def details(self) -> dict[str, Any]:
        return self.episode.details()

    async def close(self) -> None:
        await self.episode.close()


class Unkeyed:
    """A policy whose requests lose their sampling key: the pre-key behaviour, where every
    request drew from the policy's one shared stream in the order requests arrived."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        unkeyed = params.model_copy(update={"sampling_key": None})
        return await self.policy.generate(input_ids, unkeyed, session_id)


class RecordedBatches:
    """HFPolicy, each batch it is given recorded by its requests' sampling keys."""

    def __init__(self, policy: HFPolicy, batches: list[list[str]]) -> None:
        self.policy, self.batches = policy, batches

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        raise AssertionError("in rounds every generation goes through generate_batch")

    async def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        self.batches.append([str(request.params.sampling_key) for request in requests])
        return await self.policy.generate_batch(requests)


def _rollouts(
    student: tuple[Any, Any],
    *,
    concurrency: int,
    delay_seed: int,
    max_delay_s: float,
    policy_options: dict[str, Any] | None = None,
    unkeyed: bool = False,
    rounds: list[list[str]] | None = None,
) -> list[Trajectory]:
    """`rounds`: decode in rounds, each batch's sampling keys appended there."""
    model, tokenizer = student
    harness = SlowTools(tir_harness(), delay_seed, max_delay_s)
    policy: Policy = HFPolicy(model, tokenizer.eos_token_id, seed=7, **(policy_options or {}))
    if unkeyed:
        policy = Unkeyed(policy)
    if rounds is not None:
        policy = RecordedBatches(cast(HFPolicy, policy), rounds)
    config = RunnerConfig(
        rounds=rounds is not None,
        concurrency=concurrency,
        max_turns=3,
        max_new_tokens=40,
        max_context_tokens=1024,
        sampling=SamplingParams(max_new_tokens=40, temperature=1.0),
    )
    runner = Runner(harness, policy, ChatRenderer(tokenizer, harness.tools), config)
    tasks = make_tasks(6, "train", seed=4)
    return asyncio.run(runner.run(tasks, samples_per_task=2, rollout_step=3))


def _samples(trajectories: list[Trajectory]) -> list[list[list[int]]]:
    return [[turn.span_ids for turn in t.turns] for t in trajectories]


def _logprobs(trajectories: list[Trajectory]) -> list[list[list[float]]]:
    return [[turn.logprobs for turn in t.turns] for t in trajectories]


@pytest.mark.timeout(300)
def test_samples_do_not_depend_on_batching_concurrency_or_tool_latency(
    student: tuple[Any, Any],
) -> None:
    """Twelve trajectories twice: 12 at once with instant tools, three decoded at a time,
    then 3 at once with tools delayed at random, one decoded at a time; the same ids and
    log-probs."""
    wide = _rollouts(
        student, concurrency=12, delay_seed=0, max_delay_s=0.0, policy_options={"decode_threads": 3}
    )
    narrow = _rollouts(
        student, concurrency=3, delay_seed=1, max_delay_s=0.05, policy_options={"decode_threads": 1}
    )
    assert sum(t.num_turns for t in wide) > len(wide)  # tool calls came back to the policy
    assert _samples(wide) == _samples(narrow)
    assert _logprobs(wide) == _logprobs(narrow)  # bit for bit, not approximately
    assert [t.status for t in wide] == [t.status for t in narrow]
    assert [t.reward for t in wide] == [t.reward for t in narrow]
    assert len({tuple(s[0]) for s in _samples(wide)}) > len(wide) // 2  # samples differ


@pytest.mark.timeout(300)
def test_rounds_batch_by_the_schedule_so_tool_latency_changes_no_bit(
    student: tuple[Any, Any],
) -> None:
    """Twelve trajectories, 4 at a time, decoded in rounds: with instant tools and with
    tools delayed at random, the same batches (the same turns together, in the same order)
    and so the same ids and log-probs, bit for bit. The control: decoded alone, the same
    trajectories' log-probs differ in their last bits (batch mates do change them: the
    equality is the schedule's doing)."""
    fast_batches: list[list[str]] = []
    slow_batches: list[list[str]] = []
    fast = _rollouts(student, concurrency=4, delay_seed=0, max_delay_s=0.0, rounds=fast_batches)
    slow = _rollouts(student, concurrency=4, delay_seed=1, max_delay_s=0.05, rounds=slow_batches)
    assert fast_batches == slow_batches
    assert max(len(batch) for batch in fast_batches) == 4  # batched, at most 4 at once
    assert sum(len(batch) for batch in fast_batches) == sum(t.num_turns for t in fast)
    assert _samples(fast) == _samples(slow)
    assert _logprobs(fast) == _logprobs(slow)
    assert [t.reward for t in fast] == [t.reward for t in slow]
    alone = _rollouts(student, concurrency=4, delay_seed=0, max_delay_s=0.0)
    assert _logprobs(alone) != _logprobs(fast)


@pytest.mark.timeout(300)
def test_without_keys_or_with_shared_forwards_the_samples_depend_on_timing(
    student: tuple[Any, Any],
) -> None:
    """The negative controls: one shared random stream (no sampling keys, the old
    behaviour) gives other tokens at other concurrency; shared forwards
    (batch_invariant=False) keep the keyed draws but round logits differently."""
    shared_stream, shared_forwards = (
        [
            _rollouts(
                student,
                concurrency=concurrency,
                delay_seed=concurrency,
                max_delay_s=0.02,
                policy_options=options,
                unkeyed=unkeyed,
            )
            for concurrency in (12, 4)
        ]
        for options, unkeyed in (({}, True), ({"batch_invariant": False}, False))
    )
    assert _samples(shared_stream[0]) != _samples(shared_stream[1])
    assert _logprobs(shared_forwards[0]) != _logprobs(shared_forwards[1])


def test_a_keyed_request_samples_the_same_alone_or_among_others(student: tuple[Any, Any]) -> None:
    model, tokenizer = student
    params = SamplingParams(max_new_tokens=12, temperature=1.0, sampling_key="task#0/turn-0")

    async def among_others(policy: HFPolicy) -> Generation:
        others = [
            policy.generate(PROMPT[i:] * 3, params.model_copy(update={"sampling_key": f"o{i}"}))
            for i in range(5)
        ]
        mine, *_ = await asyncio.gather(policy.generate(PROMPT, params), *others)
        return mine

    alone = asyncio.run(HFPolicy(model, tokenizer.eos_token_id, seed=1).generate(PROMPT, params))
    policy = HFPolicy(model, tokenizer.eos_token_id, seed=1)
    state = policy.generator.get_state()
    together = asyncio.run(among_others(policy))
    assert together.output_ids == alone.output_ids and together.logprobs == alone.logprobs
    assert torch.equal(policy.generator.get_state(), state)  # keyed: the shared stream unused
    other_seed = asyncio.run(
        HFPolicy(model, tokenizer.eos_token_id, seed=2).generate(PROMPT, params)
    )
    assert other_seed.output_ids != alone.output_ids


def test_greedy_draws_nothing_and_is_the_same_in_both_modes(student: tuple[Any, Any]) -> None:
    model, tokenizer = student
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    prompts = [PROMPT, PROMPT[3:], PROMPT * 4]

    async def generate(policy: HFPolicy) -> list[Generation]:
        return list(await asyncio.gather(*(policy.generate(p, greedy) for p in prompts)))

    invariant = HFPolicy(model, tokenizer.eos_token_id)
    state = invariant.generator.get_state()
    one_by_one = asyncio.run(generate(invariant))
    batched = asyncio.run(generate(HFPolicy(model, tokenizer.eos_token_id, batch_invariant=False)))
    assert torch.equal(invariant.generator.get_state(), state)
    assert [g.output_ids for g in one_by_one] == [g.output_ids for g in batched]


def test_each_turn_of_each_trajectory_and_step_has_its_own_stream(factory_tokenizer: Any) -> None:
    keys: list[tuple[str, int, str | None]] = []

    class Recording(ScriptedPolicy):
        async def generate(
            self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
        ) -> Generation:
            assert session_id is not None
            keys.append((session_id, self.turns[session_id], params.sampling_key))
            return await super().generate(input_ids, params, session_id)

    script = [tool("python", code="print(6 * 7)"), say("It is \\boxed{42}.")]
    harness = tir_harness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    tasks = make_tasks(2, "train", seed=4)
    for step in (0, 1):
        policy = Recording(factory_tokenizer, lambda _task, _sample: script)
        runner = Runner(harness, policy, renderer, RunnerConfig(max_turns=3))
        asyncio.run(runner.run(tasks, samples_per_task=2, rollout_step=step))
    assert len(keys) == 2 * 2 * 2 * 2  # steps x tasks x samples x turns
    assert len({key for _, _, key in keys}) == len(keys)  # no two generations share one
    first = {(session, turn): key for session, turn, key in keys[:8]}
    assert first[f"{tasks[0].task_id}#1", 1] == f"step-0/{tasks[0].task_id}#1/turn-1"


def test_sglang_gets_a_seed_per_keyed_sampled_request() -> None:
    bodies: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 7, None]]}
        return httpx.Response(200, json={"output_ids": [7], "meta_info": meta})

    async def run() -> None:
        policy = SGLangPolicy("http://sglang", seed=3, transport=httpx.MockTransport(answer))
        keyed = SamplingParams(max_new_tokens=4, sampling_key="t#0/turn-0")
        try:
            for params in (
                keyed,
                keyed.model_copy(update={"temperature": 0.0}),
                keyed.model_copy(update={"sampling_key": None}),
            ):
                await policy.generate(PROMPT, params, "t#0")
        finally:
            await policy.close()

    asyncio.run(run())
    seeds = [body["sampling_params"].get("sampling_seed") for body in bodies]
    assert seeds == [request_seed(3, "t#0/turn-0") % SGLANG_MAX_SEED, None, None]


@contextlib.contextmanager
def cpu_hog() -> Iterator[None]:
    """A busy-looping process per core while the block runs (no test that bounds wall
    time runs meanwhile in another test process: tests/host_load.py)."""
    with host_load.held(exclusive=True):
        hogs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 1)
        ]
        try:
            yield
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()


TIMING = ("time", "per_sec")
"""Substrings of the metrics that measure time: the only ones a loaded machine changes."""


def _train(run_dir: Path) -> tuple[list[Any], list[Any]]:
    """Two OPD steps of the bundled student against the bundled teacher, served on
    127.0.0.1 (a service per run: one that served a trajectory id before leaves it
    uncached): the metrics without timings, and each step's trajectories without theirs."""
    job = config_from_dict(
        {
            "model": {"student": "bundled:student", "seed": 0},
            "rollout": {
                "max_turns": 3,
                "max_new_tokens": 32,
                "tasks_per_step": 3,
                "samples_per_task": 2,
                "concurrency": 8,
            },
            "teacher": {"kind": "embedded", "model": "bundled:teacher", "top_k": 4},
            "algorithm": {"recipe": "opd", "opd_loss": "topk_tail", "steps": 2, "lr": 1e-3},
            "logging": {"run_dir": str(run_dir), "wandb_mode": "disabled"},
        }
    )
    student, teacher = bundled_models()
    run = LocalRun(job, student, run_dir, Console(quiet=True))
    metrics = ServerMetrics()
    with serve_in_thread(create_app(HFBackend(teacher, metrics), metrics)) as teacher_url:
        asyncio.run(run.train(make_tasks(100, "train", seed=0), teacher_url))
    logged = [
        {k: v for k, v in json.loads(line).items() if not any(t in k for t in TIMING)}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    untimed = {"wall_s": True, "turns": {"__all__": {"timings"}}}
    steps = [
        [t.model_dump(mode="json", exclude=untimed) for t in read_jsonl(path)]
        for path in sorted((run_dir / "trajectories").glob("step_*.jsonl"))
    ]
    return logged, steps


@pytest.mark.timeout(300)
def test_training_on_a_loaded_machine_gives_the_same_run(tmp_path: Path) -> None:
    """Two OPD steps on an idle machine and again beside a busy loop on every core: the
    same metrics (timings aside) and the same trajectories, token for token."""
    idle_metrics, idle_steps = _train(tmp_path / "idle")
    with cpu_hog():
        loaded_metrics, loaded_steps = _train(tmp_path / "loaded")
    assert len(idle_metrics) == 2 and "train/loss" in idle_metrics[0]
    assert idle_metrics == loaded_metrics
    assert len(idle_steps) == 2 and all(len(step) == 6 for step in idle_steps)
    assert idle_steps == loaded_steps
