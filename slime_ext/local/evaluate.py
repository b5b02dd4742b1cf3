"""Greedy held-out evaluation of a policy (TIR or mini-SWE tasks), and paired comparisons."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rollout.chat import ChatRenderer
from rollout.evaluation.stats import wilson_interval
from rollout.harness.base import Harness
from rollout.policy import Policy, SamplingParams
from rollout.runner import Runner, RunnerConfig
from rollout.tasks import mini_swe
from rollout.tasks.arithmetic import make_tasks
from rollout.trajectory import Task, Trajectory

HELDOUT_SEED = 1
"""The held-out problems `opd demo` scores before and after, and periodic evaluation scores
during `opd train`: one fixed set, so runs of any seed compare on it."""


MINI_SWE_HELDOUT_SEED = -1
"""mini-SWE's held-out tasks: training draws them with the job's seed (model.seed >= 0)."""


def heldout_tasks(count: int, harness: str = "tir") -> list[Task]:
    """The first `count` held-out problems of a harness's tasks (arithmetic for tir,
    mini-SWE repositories for swe), never drawn for training."""
    if harness == "swe":
        return mini_swe.generate_tasks(count, seed=MINI_SWE_HELDOUT_SEED)
    return make_tasks(count, "heldout", seed=HELDOUT_SEED)


def tasks_apart_from_test(harness: str, count: int, seed: int, n_test: int) -> list[Task]:
    """`count` held-out kind tasks drawn with `seed` (in order: the first ones of a larger
    draw), none with the statement of one of the first `n_test` held-out test tasks
    (`heldout_tasks`); ValueError when fewer than `count` are left."""
    test = {task.prompt for task in heldout_tasks(n_test, harness)}
    if harness == "swe":
        pool = mini_swe.generate_tasks(count + n_test, seed=seed)
    else:
        pool = make_tasks(count + n_test, "heldout", seed=seed)
    chosen = [task for task in pool if task.prompt not in test][:count]
    if len(chosen) < count:
        raise ValueError(f"only {len(chosen)} of {count} tasks of seed {seed} are not test tasks")
    return chosen


async def evaluate(
    policy: Policy,
    tokenizer: Any,
    tasks: Sequence[Task],
    harness: Harness,
    *,
    concurrency: int = 32,
    max_turns: int = 4,
    max_new_tokens: int = 64,
    max_context_tokens: int = 1024,
    rounds: bool = False,
) -> list[Trajectory]:
    """One greedy trajectory per task, in task order (`rounds`: decoded in rounds,
    rollout/rounds.py; the policy must decode batches)."""
    renderer = ChatRenderer(tokenizer, harness.tools)
    config = RunnerConfig(
        concurrency=concurrency,
        max_turns=max_turns,
        max_new_tokens=max_new_tokens,
        max_context_tokens=max_context_tokens,
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0),
        rounds=rounds,
    )
    return await Runner(harness, policy, renderer, config).run(tasks)


def correct(trajectories: Sequence[Trajectory]) -> list[float]:
    return [1.0 if (t.reward or 0.0) > 0 else 0.0 for t in trajectories]


def accuracy_metrics(scores: Sequence[float]) -> dict[str, float]:
    """The eval/ metrics of one held-out evaluation (`correct` scores): accuracy, its 95%
    Wilson interval, and the number of problems."""
    if not scores:
        raise ValueError("an evaluation needs at least one problem")
    solved = round(sum(scores))
    low, high = wilson_interval(solved, len(scores))
    return {
        "eval/heldout_accuracy": solved / len(scores),
        "eval/heldout_accuracy_ci95_low": low,
        "eval/heldout_accuracy_ci95_high": high,
        "eval/heldout_problems": float(len(scores)),
    }


def paired_difference(
    before: Sequence[float], after: Sequence[float]
) -> tuple[float, float, float]:
    """Mean of after - before over the same problems, with a normal 95% interval."""
    if len(before) != len(after) or not before:
        raise ValueError("paired scores need the same, non-empty set of problems")
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    mean = sum(diffs) / len(diffs)
    variance = sum((d - mean) ** 2 for d in diffs) / max(len(diffs) - 1, 1)
    half = 1.96 * math.sqrt(variance / len(diffs))
    return mean, mean - half, mean + half
