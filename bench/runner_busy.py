"""How busy the runner keeps the policy: the fraction of wall time the generation engine
has at least one request in flight, at 1, 8 and 32 concurrent trajectories.

A simulated policy (one engine that serves concurrent requests, `model_s` per turn) and
sandbox (`sandbox_s` per turn) scaled down from the reference report's 9.5 s + 4.5 s per
turn. Run sequentially, the engine idles while each sandbox runs (9.5 / 14 = 68% busy);
the runner should overlap them. Goal: >= 90% busy at enough concurrency.

    .venv/bin/python bench/runner_busy.py [--scale 0.01] [--turns 6] [--trajectories 64]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from rollout.chat import ChatRenderer, Message, RecordedTurn
from rollout.harness.base import StepOutcome
from rollout.policy import Generation, SamplingParams
from rollout.runner import Runner, RunnerConfig
from rollout.trajectory import Task
from slime_ext.models.factory import build_tokenizer


class SimulatedEngine:
    """Counts the time during which at least one generation is in flight."""

    def __init__(self, renderer: ChatRenderer, model_s: float, jitter: float) -> None:
        self.renderer = renderer
        self.model_s = model_s
        self.jitter = jitter
        self.rng = random.Random(0)
        self.in_flight = 0
        self.busy_s = 0.0
        self._busy_since = 0.0

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        if self.in_flight == 0:
            self._busy_since = time.perf_counter()
        self.in_flight += 1
        await asyncio.sleep(_draw(self.rng, self.model_s, self.jitter))
        self.in_flight -= 1
        if self.in_flight == 0:
            self.busy_s += time.perf_counter() - self._busy_since
        ids = [*self.renderer.encode("run"), self.renderer.eos_id]
        return Generation(
            output_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop", model_s=self.model_s
        )


def _draw(rng: random.Random, mean_s: float, jitter: float) -> float:
    """Uniform in mean * [1 - jitter, 1 + jitter]: real turns vary, which keeps
    concurrent trajectories from moving in lockstep."""
    return mean_s * rng.uniform(1 - jitter, 1 + jitter)


class SimulatedEpisode:
    def __init__(self, sandbox_s: float, turns: int, jitter: float, seed: float) -> None:
        self.sandbox_s = sandbox_s
        self.turns = turns
        self.jitter = jitter
        self.rng = random.Random(seed)
        self.steps = 0

    async def step(self, turn: RecordedTurn) -> StepOutcome:
        await asyncio.sleep(_draw(self.rng, self.sandbox_s, self.jitter))
        self.steps += 1
        done = self.steps >= self.turns
        return StepOutcome(observation=None if done else "ok", done=done, reason="done")

    async def reward(self) -> float:
        return 0.0

    def details(self) -> dict[str, Any]:
        return {"steps": self.steps}

    async def close(self) -> None:
        pass


class SimulatedHarness:
    name = "simulated"

    def __init__(self, sandbox_s: float, turns: int, jitter: float) -> None:
        self.sandbox_s = sandbox_s
        self.turns = turns
        self.jitter = jitter
        self.rng = random.Random(1)
        self.tools: list[dict[str, Any]] = []

    def initial_messages(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": task.prompt}]

    async def start(self, task: Task) -> SimulatedEpisode:
        return SimulatedEpisode(self.sandbox_s, self.turns, self.jitter, self.rng.random())


def busy_fraction(
    concurrency: int, trajectories: int, turns: int, model_s: float, sandbox_s: float, jitter: float
) -> float:
    renderer = ChatRenderer(build_tokenizer())
    engine = SimulatedEngine(renderer, model_s, jitter)
    runner = Runner(
        SimulatedHarness(sandbox_s, turns, jitter),
        engine,
        renderer,
        RunnerConfig(concurrency=concurrency, max_turns=turns + 1, max_context_tokens=100_000),
    )
    tasks = [Task(task_id=f"t{i}", kind="simulated", prompt="go") for i in range(trajectories)]
    started = time.perf_counter()
    asyncio.run(runner.run(tasks))
    return engine.busy_s / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scale", type=float, default=0.01, help="of 9.5 s + 4.5 s per turn")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.5,
        help="each duration is uniform in mean * [1 - j, 1 + j]",
    )
    args = parser.parse_args()
    model_s, sandbox_s = 9.5 * args.scale, 4.5 * args.scale
    print(
        f"model {model_s * 1000:.0f} ms + sandbox {sandbox_s * 1000:.0f} ms per turn, "
        f"{args.turns} turns, {args.trajectories} trajectories, jitter {args.jitter} "
        f"(sequential ideal: {model_s / (model_s + sandbox_s):.0%} busy)"
    )
    for concurrency in (1, 8, 32):
        fraction = busy_fraction(
            concurrency,
            args.trajectories if concurrency > 1 else 8,
            args.turns,
            model_s,
            sandbox_s,
            args.jitter,
        )
        verdict = "PASS" if fraction >= 0.9 else "below the 90% goal"
        print(f"concurrency {concurrency:>2}: policy busy {fraction:.1%} ({verdict})")


if __name__ == "__main__":
    main()
