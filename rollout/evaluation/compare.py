"""Paired comparison of two evaluation runs, instance by instance.

Two runs' pass rates are compared on the instances both evaluated (the paired set): the
2x2 table (both solved, only A, only B, neither), each run's rate with its Wilson interval,
the net gain only_a - only_b and the exact McNemar p-value of the discordant instances. Per
benchmark and pooled over all benchmarks.

A run's headline (its report's solved count, or its records' over its own instance set)
differs from the other's by exactly the paired net gain when both runs evaluated the same
instances once each and the reports match the records. `compare_runs` checks that and
names every reason it does not hold: instance sets that differ, duplicated instance ids,
reported totals or solved counts that disagree with the records.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from rollout.evaluation.stats import mcnemar_exact, wilson_interval

CONFIDENCE = 0.95
"""Coverage of the rate intervals in a comparison."""
EXAMPLES_SHOWN = 3
"""Instance ids quoted in a problem's message (the comparison keeps all of them)."""


class ReportedScore(BaseModel):
    """A run's headline on one benchmark as its report states it, over its own instances."""

    model_config = ConfigDict(frozen=True)

    solved: int = Field(ge=0)
    total: int = Field(ge=0)

    @model_validator(mode="after")
    def _solved_within_total(self) -> ReportedScore:
        if self.solved > self.total:
            raise ValueError(f"reported solved ({self.solved}) exceeds the total ({self.total})")
        return self


class RunOutcomes(BaseModel):
    """One evaluation run: which instances it solved, and what its report claims."""

    model_config = ConfigDict(frozen=True)

    name: str
    solved: dict[str, dict[str, bool]]
    """benchmark -> instance id -> solved; one entry per distinct instance evaluated."""
    reported: dict[str, ReportedScore] = Field(default_factory=dict)
    """benchmark -> the report's headline; where absent, the records' count stands in."""
    duplicates: dict[str, list[str]] = Field(default_factory=dict)
    """benchmark -> instance ids that occurred more than once among the run's records."""


class PairedCounts(BaseModel):
    """Two runs on the instances both evaluated: the 2x2 table and what follows from it.

    With no paired instance the rates are 0, the intervals (0, 1) and the p-value 1.
    """

    model_config = ConfigDict(frozen=True)

    both: int = Field(ge=0)
    only_a: int = Field(ge=0)
    only_b: int = Field(ge=0)
    neither: int = Field(ge=0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def n(self) -> int:
        return self.both + self.only_a + self.only_b + self.neither

    @computed_field  # type: ignore[prop-decorator]
    @property
    def solved_a(self) -> int:
        return self.both + self.only_a

    @computed_field  # type: ignore[prop-decorator]
    @property
    def solved_b(self) -> int:
        return self.both + self.only_b

    @computed_field  # type: ignore[prop-decorator]
    @property
    def rate_a(self) -> float:
        return self.solved_a / self.n if self.n else 0.0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def rate_b(self) -> float:
        return self.solved_b / self.n if self.n else 0.0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def interval_a(self) -> tuple[float, float]:
        return wilson_interval(self.solved_a, self.n, CONFIDENCE)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def interval_b(self) -> tuple[float, float]:
        return wilson_interval(self.solved_b, self.n, CONFIDENCE)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def net(self) -> int:
        """Instances A gains over B: only_a - only_b (= solved_a - solved_b)."""
        return self.only_a - self.only_b

    @computed_field  # type: ignore[prop-decorator]
    @property
    def net_pp(self) -> float:
        """The net gain in percentage points of the paired instances."""
        return 100.0 * self.net / self.n if self.n else 0.0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def mcnemar_p(self) -> float:
        return mcnemar_exact(self.only_a, self.only_b)


class Headline(BaseModel):
    """The score a run states for itself on one benchmark, and where it was taken from."""

    model_config = ConfigDict(frozen=True)

    solved: int
    total: int
    source: Literal["reported", "records"]

    @property
    def rate(self) -> float:
        return self.solved / self.total if self.total else 0.0


class BenchmarkComparison(BaseModel):
    """Runs A and B on one benchmark: paired counts, headlines, and why they disagree."""

    model_config = ConfigDict(frozen=True)

    benchmark: str
    paired: PairedCounts
    headline_a: Headline | None
    """None when run A has no results on this benchmark."""
    headline_b: Headline | None
    instances_only_in_a: list[str]
    """Instances A evaluated and B did not (sorted); they are outside the paired counts."""
    instances_only_in_b: list[str]
    problems: list[str]
    """Why the headlines do not differ by the paired net gain, or cannot be compared."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def headline_delta(self) -> int | None:
        """headline_a.solved - headline_b.solved; None unless both runs have results."""
        if self.headline_a is None or self.headline_b is None:
            return None
        return self.headline_a.solved - self.headline_b.solved

    @computed_field  # type: ignore[prop-decorator]
    @property
    def reconciles(self) -> bool:
        return not self.problems


class Comparison(BaseModel):
    """Runs A and B over every benchmark either evaluated, and pooled over all of them."""

    model_config = ConfigDict(frozen=True)

    name_a: str
    name_b: str
    benchmarks: list[BenchmarkComparison]
    """One per benchmark in either run, sorted by name."""
    combined: PairedCounts
    """The paired counts summed over benchmarks (McNemar on the pooled discordant pairs)."""
    problems: list[str]
    """Every benchmark's problems, each prefixed with its benchmark's name."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def reconciles(self) -> bool:
        return not self.problems


def compare_runs(a: RunOutcomes, b: RunOutcomes) -> Comparison:
    """Compare run `a` with run `b` per benchmark and pooled; see the module docstring."""
    names = sorted(a.solved.keys() | b.solved.keys() | a.reported.keys() | b.reported.keys())
    benchmarks = [_compare_benchmark(benchmark, a, b) for benchmark in names]
    combined = PairedCounts(
        both=sum(c.paired.both for c in benchmarks),
        only_a=sum(c.paired.only_a for c in benchmarks),
        only_b=sum(c.paired.only_b for c in benchmarks),
        neither=sum(c.paired.neither for c in benchmarks),
    )
    problems = [f"{c.benchmark}: {problem}" for c in benchmarks for problem in c.problems]
    return Comparison(
        name_a=a.name, name_b=b.name, benchmarks=benchmarks, combined=combined, problems=problems
    )


def _compare_benchmark(benchmark: str, a: RunOutcomes, b: RunOutcomes) -> BenchmarkComparison:
    records_a, records_b = a.solved.get(benchmark, {}), b.solved.get(benchmark, {})
    outcomes = [(records_a[i], records_b[i]) for i in records_a.keys() & records_b]
    paired = PairedCounts(
        both=sum(solved_a and solved_b for solved_a, solved_b in outcomes),
        only_a=sum(solved_a and not solved_b for solved_a, solved_b in outcomes),
        only_b=sum(solved_b and not solved_a for solved_a, solved_b in outcomes),
        neither=sum(not (solved_a or solved_b) for solved_a, solved_b in outcomes),
    )
    comparison = BenchmarkComparison(
        benchmark=benchmark,
        paired=paired,
        headline_a=_headline(a, benchmark),
        headline_b=_headline(b, benchmark),
        instances_only_in_a=sorted(records_a.keys() - records_b),
        instances_only_in_b=sorted(records_b.keys() - records_a),
        problems=[],
    )
    return comparison.model_copy(update={"problems": _problems(comparison, a, b)})


def _headline(run: RunOutcomes, benchmark: str) -> Headline | None:
    if benchmark in run.reported:
        reported = run.reported[benchmark]
        return Headline(solved=reported.solved, total=reported.total, source="reported")
    if benchmark not in run.solved:
        return None
    records = run.solved[benchmark]
    return Headline(solved=sum(records.values()), total=len(records), source="records")


def _problems(comparison: BenchmarkComparison, a: RunOutcomes, b: RunOutcomes) -> list[str]:
    benchmark, paired = comparison.benchmark, comparison.paired
    problems = [
        f"{run.name} has no records on this benchmark"
        for run in (a, b)
        if benchmark not in run.solved
    ]
    delta = comparison.headline_delta
    if delta is not None and delta != paired.net:
        problems.append(
            f"the headline difference {delta:+d} ({a.name} {_score(comparison.headline_a)}, "
            f"{b.name} {_score(comparison.headline_b)}) is not the paired net gain "
            f"{paired.net:+d} (only {a.name} {paired.only_a}, only {b.name} {paired.only_b})"
        )
    only_a, only_b = comparison.instances_only_in_a, comparison.instances_only_in_b
    if benchmark in a.solved and benchmark in b.solved and (only_a or only_b):
        problems.append(
            f"the instance sets differ: {len(only_a)} only in {a.name}{_examples(only_a)}, "
            f"{len(only_b)} only in {b.name}{_examples(only_b)}; the paired counts leave them out"
        )
    for run in (a, b):
        problems.extend(_record_problems(run, benchmark))
    return problems


def _record_problems(run: RunOutcomes, benchmark: str) -> list[str]:
    """Where a run's own records contradict themselves or its report."""
    problems: list[str] = []
    duplicated = sorted(set(run.duplicates.get(benchmark, ())))
    if duplicated:
        problems.append(
            f"{run.name} has {len(duplicated)} duplicated instance ids{_examples(duplicated)}"
        )
    records, reported = run.solved.get(benchmark, {}), run.reported.get(benchmark)
    if reported is None:
        return problems
    if reported.total != len(records):
        problems.append(
            f"{run.name} reports {reported.total} instances but has records of "
            f"{len(records)} distinct instances"
        )
    if reported.solved != sum(records.values()):
        problems.append(
            f"{run.name} reports {reported.solved} solved but its records show "
            f"{sum(records.values())} solved"
        )
    return problems


def _score(headline: Headline | None) -> str:
    if headline is None:
        return "no results"
    return f"{headline.solved}/{headline.total} = {100.0 * headline.rate:.1f}%"


def _examples(instance_ids: Iterable[str]) -> str:
    shown = list(instance_ids)[:EXAMPLES_SHOWN]
    return f" (e.g. {', '.join(shown)})" if shown else ""


def comparison_markdown(comparison: Comparison) -> str:
    """A markdown report: the paired table per benchmark and pooled, then reconciliation."""
    name_a, name_b = comparison.name_a, comparison.name_b
    lines = [
        f"# {name_a} (A) vs {name_b} (B)",
        "",
        "Counts over the instances both runs evaluated; rates with Wilson "
        f"{100 * CONFIDENCE:.0f}% intervals; exact McNemar p on the instances only one solved.",
        "",
        "| benchmark | n | Both | Only A | Only B | Neither | A | B | net | McNemar p |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [(c.benchmark, c.paired) for c in comparison.benchmarks]
    for label, paired in [*rows, ("combined", comparison.combined)]:
        lines.append(
            f"| {label} | {paired.n} | {paired.both} | {paired.only_a} | {paired.only_b} "
            f"| {paired.neither} | {_rate(paired.solved_a, paired.rate_a, paired.interval_a)} "
            f"| {_rate(paired.solved_b, paired.rate_b, paired.interval_b)} "
            f"| {paired.net:+d} ({paired.net_pp:+.1f}pp) | {paired.mcnemar_p:.3g} |"
        )
    lines += ["", "## Reconciliation", ""]
    for c in comparison.benchmarks:
        headline_delta = ""
        if c.headline_a is not None and c.headline_b is not None:
            delta_pp = 100.0 * (c.headline_a.rate - c.headline_b.rate)
            headline_delta = f": {c.headline_delta:+d} ({delta_pp:+.1f}pp)"
        lines.append(
            f"- {c.benchmark}: headline {name_a} {_score(c.headline_a)}, "
            f"{name_b} {_score(c.headline_b)}{headline_delta}; paired net {c.paired.net:+d} "
            f"of {c.paired.n}"
        )
    lines.append("")
    if comparison.reconciles:
        lines.append("The headline differences equal the paired net gains on every benchmark.")
    else:
        lines.append("The headlines do not reconcile with the paired counts:")
        lines += [f"- {problem}" for problem in comparison.problems]
    return "\n".join(lines) + "\n"


def _rate(solved: int, rate: float, interval: tuple[float, float]) -> str:
    low, high = interval
    return f"{solved} ({100 * rate:.1f}% [{100 * low:.1f}, {100 * high:.1f}])"
