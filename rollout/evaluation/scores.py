"""Scores of an evaluation run, per benchmark and averaged over benchmarks.

Per benchmark, over its problems (instances) and k samples of each:
- pass@1 = avg@k: the share of solved trajectories; every trajectory counts, aborted ones
  as unsolved. Interval: Wilson 95% when k = 1; with k > 1 the samples of one problem are
  not independent, so a normal interval over the problems' solved shares.
- net pass@1: the same without the infrastructure aborts (sandbox, server and grading
  failures: `EvalRecord.outcome == "aborted"`), which are counted on their own.
- pass@k: unbiased (Chen et al.) from each problem's n graded samples and c solved.
- timeouts (the trajectory deadline), step-limited trajectories (status truncated),
  average turns, and the share of trajectories that called a tool at least once with the
  pass rate of each side: a math score reached without calling the tool says little about
  tool use (the reference report's caution).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from rollout.evaluation.records import EvalRecord, latest_records
from rollout.evaluation.stats import pass_at_k, wilson_interval
from rollout.trajectory import TrajectoryStatus

ALL_BENCHMARKS = "average"
"""The name of the row that averages the benchmarks (each weighing the same)."""


class BenchmarkScore(BaseModel):
    model_config = ConfigDict(frozen=True)

    benchmark: str
    problems: int
    samples: int
    """k: samples per problem (the most any problem has)."""
    trajectories: int
    solved: int
    pass_at_1: float
    interval: tuple[float, float]
    aborts: int
    net_pass_at_1: float
    net_interval: tuple[float, float]
    pass_at_k: float
    timeouts: int
    step_limited: int
    avg_turns: float
    tool_use_frac: float
    pass_with_tools: float | None
    pass_without_tools: float | None
    statuses: dict[str, int]
    reasons: dict[str, int]
    """Why trajectories were not solved (grader and abort reasons by category, see
    `reason_category`), most common first."""


def score(records: Sequence[EvalRecord]) -> list[BenchmarkScore]:
    """One score per benchmark (in first-seen order), then the average row when there are
    several benchmarks."""
    by_benchmark: dict[str, list[EvalRecord]] = defaultdict(list)
    for record in latest_records(records):
        by_benchmark[record.benchmark].append(record)
    scores = [score_benchmark(name, rows) for name, rows in by_benchmark.items()]
    if len(scores) > 1:
        scores.append(average(scores))
    return scores


def score_benchmark(benchmark: str, records: Sequence[EvalRecord]) -> BenchmarkScore:
    if not records:
        raise ValueError(f"benchmark {benchmark!r} has no records")
    per_problem: dict[str, list[EvalRecord]] = defaultdict(list)
    for record in records:
        per_problem[record.instance_id].append(record)
    k = max(len(samples) for samples in per_problem.values())
    trajectories = len(records)
    solved = sum(r.solved for r in records)
    aborts = sum(r.outcome == "aborted" for r in records)
    net = trajectories - aborts
    if k == 1:
        interval = wilson_interval(solved, trajectories)
        net_interval = wilson_interval(solved, net)
    else:
        interval = _clustered_interval([_share(s) for s in per_problem.values()])
        net_interval = _clustered_interval(
            [_share([r for r in s if r.outcome != "aborted"]) for s in per_problem.values()]
        )
    with_tools = [r for r in records if r.tool_calls > 0]
    without_tools = [r for r in records if r.tool_calls == 0]
    unsolved = Counter(reason_category(r.reason) for r in records if not r.solved)
    return BenchmarkScore(
        benchmark=benchmark,
        problems=len(per_problem),
        samples=k,
        trajectories=trajectories,
        solved=solved,
        pass_at_1=solved / trajectories,
        interval=interval,
        aborts=aborts,
        net_pass_at_1=solved / net if net else 0.0,
        net_interval=net_interval,
        pass_at_k=sum(
            pass_at_k(len(samples), sum(r.solved for r in samples), min(k, len(samples)))
            for samples in per_problem.values()
        )
        / len(per_problem),
        timeouts=sum(r.outcome == "timeout" for r in records),
        step_limited=sum(r.status == TrajectoryStatus.TRUNCATED for r in records),
        avg_turns=sum(r.num_turns for r in records) / trajectories,
        tool_use_frac=len(with_tools) / trajectories,
        pass_with_tools=_share(with_tools),
        pass_without_tools=_share(without_tools),
        statuses=dict(Counter(r.status.value for r in records)),
        reasons=dict(unsolved.most_common()),
    )


def average(scores: Sequence[BenchmarkScore]) -> BenchmarkScore:
    """The unweighted mean of the benchmarks' rates; counts are summed."""

    def mean(values: Sequence[float]) -> float:
        return sum(values) / len(values)

    def mean_interval(intervals: Sequence[tuple[float, float]]) -> tuple[float, float]:
        return (mean([low for low, _ in intervals]), mean([high for _, high in intervals]))

    tools = [s.pass_with_tools for s in scores if s.pass_with_tools is not None]
    no_tools = [s.pass_without_tools for s in scores if s.pass_without_tools is not None]
    statuses: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for s in scores:
        statuses.update(s.statuses)
        reasons.update(s.reasons)
    return BenchmarkScore(
        benchmark=ALL_BENCHMARKS,
        problems=sum(s.problems for s in scores),
        samples=max(s.samples for s in scores),
        trajectories=sum(s.trajectories for s in scores),
        solved=sum(s.solved for s in scores),
        pass_at_1=mean([s.pass_at_1 for s in scores]),
        interval=mean_interval([s.interval for s in scores]),
        aborts=sum(s.aborts for s in scores),
        net_pass_at_1=mean([s.net_pass_at_1 for s in scores]),
        net_interval=mean_interval([s.net_interval for s in scores]),
        pass_at_k=mean([s.pass_at_k for s in scores]),
        timeouts=sum(s.timeouts for s in scores),
        step_limited=sum(s.step_limited for s in scores),
        avg_turns=mean([s.avg_turns for s in scores]),
        tool_use_frac=mean([s.tool_use_frac for s in scores]),
        pass_with_tools=mean(tools) if tools else None,
        pass_without_tools=mean(no_tools) if no_tools else None,
        statuses=dict(statuses),
        reasons=dict(reasons.most_common()),
    )


def reason_category(reason: str) -> str:
    """A reason without its particulars: the part before the first ': ', numbers as N
    ("2 FAIL_TO_PASS and 0 PASS_TO_PASS tests did not pass: test_a, test_b" ->
    "N FAIL_TO_PASS and N PASS_TO_PASS tests did not pass")."""
    return re.sub(r"\d+(\.\d+)?", "N", reason.split(": ", 1)[0]).strip() or "unknown"


def _share(records: Sequence[EvalRecord]) -> float | None:
    return sum(r.solved for r in records) / len(records) if records else None


def _clustered_interval(shares: Sequence[float | None]) -> tuple[float, float]:
    """Normal 95% interval of the mean of per-problem shares, clipped to [0, 1]."""
    values = [s for s in shares if s is not None]
    if not values:
        return (0.0, 1.0)
    mean = sum(values) / len(values)
    if len(values) < 2:
        return (0.0, 1.0)
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    half = 1.96 * math.sqrt(variance / len(values))
    return (max(0.0, mean - half), min(1.0, mean + half))
