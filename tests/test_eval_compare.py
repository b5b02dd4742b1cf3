"""Paired comparison of evaluation runs: the 2x2 counts, and why headlines fail to reconcile."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from statsmodels.stats.contingency_tables import mcnemar

from rollout.evaluation.compare import (
    Comparison,
    ReportedScore,
    RunOutcomes,
    compare_runs,
    comparison_markdown,
)
from rollout.evaluation.stats import wilson_interval


def _paired_records(
    prefix: str, both: int, only_a: int, only_b: int, neither: int
) -> tuple[dict[str, bool], dict[str, bool]]:
    """Two runs' records over the same instances with the given 2x2 table."""
    outcomes = (
        [(True, True)] * both
        + [(True, False)] * only_a
        + [(False, True)] * only_b
        + [(False, False)] * neither
    )
    ids = [f"{prefix}-{i:04d}" for i in range(len(outcomes))]
    return (
        {i: solved_a for i, (solved_a, _) in zip(ids, outcomes, strict=True)},
        {i: solved_b for i, (_, solved_b) in zip(ids, outcomes, strict=True)},
    )


def _reference_runs() -> tuple[RunOutcomes, RunOutcomes]:
    """The reference report: OPD vs base on SWE-bench Verified (495) and Pro (266).

    Its headlines (Verified: base 190, OPD 209) say +19; the per-instance records behind
    them (hand-made to the report's paired counts: OPD-only 50, base-only 38) say +12.
    """
    verified_opd, verified_base = _paired_records("django__django", 152, 50, 38, 255)
    pro_opd, pro_base = _paired_records("pro", 45, 17, 12, 192)
    opd = RunOutcomes(
        name="opd",
        solved={"swe-bench-verified": verified_opd, "swe-bench-pro": pro_opd},
        reported={"swe-bench-verified": ReportedScore(solved=209, total=495)},
        duplicates={"swe-bench-verified": [f"django__django-{i:04d}" for i in range(7)]},
    )
    base = RunOutcomes(
        name="base",
        solved={"swe-bench-verified": verified_base, "swe-bench-pro": pro_base},
        reported={"swe-bench-verified": ReportedScore(solved=190, total=495)},
    )
    return opd, base


def test_paired_counts_are_the_two_by_two_table_of_the_shared_instances() -> None:
    records_a, records_b = _paired_records("math", 3, 2, 1, 4)
    comparison = compare_runs(
        RunOutcomes(name="a", solved={"math": records_a}),
        RunOutcomes(name="b", solved={"math": records_b}),
    )
    (math,) = comparison.benchmarks
    paired = math.paired
    assert (paired.both, paired.only_a, paired.only_b, paired.neither) == (3, 2, 1, 4)
    assert (paired.n, paired.solved_a, paired.solved_b, paired.net) == (10, 5, 4, 1)
    assert paired.net_pp == pytest.approx(10.0)
    assert (paired.rate_a, paired.rate_b) == (0.5, 0.4)
    assert paired.interval_a == wilson_interval(5, 10)
    assert paired.mcnemar_p == 1.0  # 2 vs 1 discordant: as even as three can be
    assert math.headline_delta == 1 and math.reconciles and comparison.reconciles
    assert comparison.combined == paired


def test_instance_sets_that_differ_are_left_out_of_the_pairs_and_flagged() -> None:
    records_a, records_b = _paired_records("x", 2, 1, 1, 1)
    records_a |= {"only-a-1": True, "only-a-2": True}
    records_b |= {"only-b-1": False}
    comparison = compare_runs(
        RunOutcomes(name="a", solved={"bench": records_a}),
        RunOutcomes(name="b", solved={"bench": records_b}),
    )
    (bench,) = comparison.benchmarks
    assert bench.paired.n == 5 and bench.paired.net == 0
    assert bench.headline_delta == 2
    assert bench.instances_only_in_a == ["only-a-1", "only-a-2"]
    assert bench.instances_only_in_b == ["only-b-1"]
    assert not bench.reconciles and not comparison.reconciles
    assert bench.problems == [
        "the headline difference +2 (a 5/7 = 71.4%, b 3/6 = 50.0%) is not the paired net gain "
        "+0 (only a 1, only b 1)",
        "the instance sets differ: 2 only in a (e.g. only-a-1, only-a-2), 1 only in b "
        "(e.g. only-b-1); the paired counts leave them out",
    ]
    assert comparison.problems == [f"bench: {problem}" for problem in bench.problems]


def test_differing_instance_sets_are_flagged_even_when_the_headlines_happen_to_agree() -> None:
    records_a, records_b = _paired_records("x", 2, 0, 0, 1)
    records_a |= {"extra-a": False}
    records_b |= {"extra-b": False}
    comparison = compare_runs(
        RunOutcomes(name="a", solved={"bench": records_a}),
        RunOutcomes(name="b", solved={"bench": records_b}),
    )
    (bench,) = comparison.benchmarks
    assert bench.headline_delta == bench.paired.net == 0
    assert not bench.reconciles
    assert [problem.split(":")[0] for problem in bench.problems] == ["the instance sets differ"]


def test_duplicates_and_reports_that_contradict_the_records_are_flagged() -> None:
    records_a, records_b = _paired_records("x", 2, 1, 0, 1)
    comparison = compare_runs(
        RunOutcomes(
            name="a",
            solved={"bench": records_a},
            reported={"bench": ReportedScore(solved=3, total=6)},
            duplicates={"bench": ["x-0001", "x-0000", "x-0001"]},
        ),
        RunOutcomes(
            name="b",
            solved={"bench": records_b},
            reported={"bench": ReportedScore(solved=2, total=4)},
        ),
    )
    (bench,) = comparison.benchmarks
    assert bench.headline_delta == bench.paired.net == 1
    assert bench.problems == [
        "a has 2 duplicated instance ids (e.g. x-0000, x-0001)",
        "a reports 6 instances but has records of 4 distinct instances",
    ]


def test_a_benchmark_only_one_run_evaluated_is_flagged_and_adds_no_pairs() -> None:
    records_a, records_b = _paired_records("x", 1, 1, 0, 0)
    comparison = compare_runs(
        RunOutcomes(name="a", solved={"shared": records_a, "extra": {"e-1": True}}),
        RunOutcomes(name="b", solved={"shared": records_b}),
    )
    assert [c.benchmark for c in comparison.benchmarks] == ["extra", "shared"]
    extra = comparison.benchmarks[0]
    assert extra.paired.n == 0 and extra.headline_b is None and extra.headline_delta is None
    assert extra.problems == ["b has no records on this benchmark"]
    assert comparison.combined.n == 2 and comparison.combined.net == 1
    assert comparison.problems == ["extra: b has no records on this benchmark"]


def test_a_reported_score_without_records_is_flagged() -> None:
    records_a, records_b = _paired_records("x", 1, 1, 0, 0)
    comparison = compare_runs(
        RunOutcomes(name="a", solved={"shared": records_a}),
        RunOutcomes(
            name="b",
            solved={"shared": records_b},
            reported={"unseen": ReportedScore(solved=3, total=10)},
        ),
    )
    unseen = comparison.benchmarks[1]
    assert unseen.benchmark == "unseen" and unseen.headline_a is None
    assert unseen.problems == [
        "a has no records on this benchmark",
        "b has no records on this benchmark",
        "b reports 10 instances but has records of 0 distinct instances",
        "b reports 3 solved but its records show 0 solved",
    ]


def test_reported_solved_beyond_total_is_rejected() -> None:
    with pytest.raises(ValidationError, match="exceeds the total"):
        ReportedScore(solved=5, total=4)


def test_reference_report_headline_of_plus_19_does_not_reconcile_with_its_paired_plus_12() -> None:
    opd, base = _reference_runs()
    comparison = compare_runs(opd, base)
    pro, verified = comparison.benchmarks
    assert verified.headline_a is not None and verified.headline_b is not None
    assert (verified.headline_a.solved, verified.headline_b.solved) == (209, 190)
    assert f"{100 * verified.headline_a.rate:.1f} {100 * verified.headline_b.rate:.1f}" == (
        "42.2 38.4"
    )
    assert verified.headline_delta == 19
    assert (verified.paired.only_a, verified.paired.only_b, verified.paired.net) == (50, 38, 12)
    assert not verified.reconciles and pro.reconciles and not comparison.reconciles
    assert verified.problems == [
        "the headline difference +19 (opd 209/495 = 42.2%, base 190/495 = 38.4%) is not the "
        "paired net gain +12 (only opd 50, only base 38)",
        "opd has 7 duplicated instance ids (e.g. django__django-0000, django__django-0001, "
        "django__django-0002)",
        "opd reports 209 solved but its records show 202 solved",
    ]


def test_reference_report_combined_mcnemar_pools_verified_and_pro_discordant_pairs() -> None:
    comparison = compare_runs(*_reference_runs())
    combined = comparison.combined
    assert (combined.only_a, combined.only_b, combined.n) == (50 + 17, 38 + 12, 495 + 266)
    oracle = mcnemar([[combined.both, 67], [50, combined.neither]], exact=True).pvalue
    assert combined.mcnemar_p == pytest.approx(oracle, rel=1e-12)
    assert combined.mcnemar_p == pytest.approx(0.1387531689430256, rel=1e-12)


def test_markdown_report_tabulates_each_benchmark_and_lists_the_problems() -> None:
    comparison = compare_runs(*_reference_runs())
    report = comparison_markdown(comparison)
    assert (
        "| benchmark | n | Both | Only A | Only B | Neither | A | B | net | McNemar p |" in report
    )
    assert (
        "| swe-bench-verified | 495 | 152 | 50 | 38 | 255 | 202 (40.8% [36.6, 45.2]) "
        "| 190 (38.4% [34.2, 42.7]) | +12 (+2.4pp) | 0.241 |"
    ) in report
    assert "| combined | 761 | 197 | 67 | 50 | 447 |" in report
    assert "| +17 (+2.2pp) | 0.139 |" in report
    assert "+19 (+3.8pp); paired net +12 of 495" in report
    assert "The headlines do not reconcile with the paired counts:" in report
    for problem in comparison.problems:
        assert f"- {problem}\n" in report


def test_markdown_report_says_so_when_the_counts_reconcile() -> None:
    records_a, records_b = _paired_records("x", 3, 2, 1, 4)
    report = comparison_markdown(
        compare_runs(
            RunOutcomes(name="a", solved={"bench": records_a}),
            RunOutcomes(name="b", solved={"bench": records_b}),
        )
    )
    assert "The headline differences equal the paired net gains on every benchmark." in report
    assert "do not reconcile" not in report


def test_json_dump_carries_the_derived_statistics_and_loads_back() -> None:
    comparison = compare_runs(*_reference_runs())
    dumped = comparison.model_dump(mode="json")
    assert dumped["reconciles"] is False
    assert dumped["combined"]["mcnemar_p"] == comparison.combined.mcnemar_p
    verified = dumped["benchmarks"][1]
    assert verified["headline_delta"] == 19 and verified["paired"]["net"] == 12
    assert Comparison.model_validate(dumped) == comparison
