"""Evaluation statistics against scipy / statsmodels (the oracles are dev dependencies only)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import binomtest, norm
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.proportion import proportion_confint

from rollout.evaluation.stats import (
    mcnemar_exact,
    mean_at_k,
    normal_quantile,
    pass_at_k,
    wilson_interval,
)

WILSON_TABLES = [
    (0, 1),
    (1, 1),
    (0, 5),
    (5, 5),
    (1, 2),
    (2, 3),
    (1, 7),
    (0, 495),
    (495, 495),
    (190, 495),
    (209, 495),
    (17, 266),
    (1, 10_000),
]
MCNEMAR_TABLES = [
    (1, 0),
    (0, 1),
    (3, 3),
    (12, 12),
    (50, 38),
    (38, 50),
    (17, 12),
    (67, 50),
    (0, 10),
    (1, 30),
    (2, 200),
    (900, 1100),
    (1000, 1000),
    (980, 1020),
    (3, 1997),
    (5, 1000),
]


def _statsmodels_mcnemar(only_a: int, only_b: int) -> float:
    return float(mcnemar([[7, only_a], [only_b, 11]], exact=True).pvalue)


def _assert_wilson_matches_statsmodels(successes: int, n: int, confidence: float) -> None:
    low, high = wilson_interval(successes, n, confidence)
    oracle_low, oracle_high = proportion_confint(
        successes, n, alpha=1.0 - confidence, method="wilson"
    )
    assert low == pytest.approx(oracle_low, abs=1e-12)
    assert high == pytest.approx(oracle_high, abs=1e-12)


@pytest.mark.parametrize(
    "p",
    [
        *(1e-300, 1e-100, 1e-20, 1e-9, 0.001, 0.02425, 0.025, 0.05, 0.3, 0.5),
        *(0.7, 0.975, 0.995, 1 - 1e-9, 1 - 2**-53),
    ],
)
def test_normal_quantile_matches_scipy_to_machine_precision(p: float) -> None:
    assert normal_quantile(p) == pytest.approx(norm.ppf(p), rel=1e-13, abs=1e-15)


@pytest.mark.parametrize("p", [0.0, 1.0, -0.1, 1.5])
def test_normal_quantile_rejects_probabilities_outside_the_open_unit_interval(p: float) -> None:
    with pytest.raises(ValueError, match="0 < p < 1"):
        normal_quantile(p)


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
@pytest.mark.parametrize(("successes", "n"), WILSON_TABLES)
def test_wilson_interval_equals_statsmodels(successes: int, n: int, confidence: float) -> None:
    _assert_wilson_matches_statsmodels(successes, n, confidence)


def test_wilson_interval_is_exactly_closed_at_zero_and_all_successes() -> None:
    assert wilson_interval(0, 20)[0] == 0.0
    assert wilson_interval(20, 20)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_wilson_interval_narrows_as_confidence_drops() -> None:
    wide, narrow = wilson_interval(190, 495, 0.99), wilson_interval(190, 495, 0.9)
    assert wide[0] < narrow[0] < 190 / 495 < narrow[1] < wide[1]


@pytest.mark.parametrize(
    ("successes", "n", "confidence", "message"),
    [
        (6, 5, 0.95, "exceed"),
        (-1, 5, 0.95, "non-negative"),
        (0, -1, 0.95, "non-negative"),
        (1, 5, 1.0, "confidence"),
        (1, 5, 0.0, "confidence"),
    ],
)
def test_wilson_interval_rejects_impossible_counts(
    successes: int, n: int, confidence: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        wilson_interval(successes, n, confidence)


@given(
    n=st.integers(min_value=1, max_value=5000),
    fraction=st.floats(min_value=0.0, max_value=1.0),
    confidence=st.floats(min_value=0.5, max_value=0.999),
)
def test_wilson_interval_equals_statsmodels_everywhere(
    n: int, fraction: float, confidence: float
) -> None:
    _assert_wilson_matches_statsmodels(round(fraction * n), n, confidence)


@pytest.mark.parametrize(("only_a", "only_b"), MCNEMAR_TABLES)
def test_mcnemar_exact_equals_statsmodels_and_scipy(only_a: int, only_b: int) -> None:
    p = mcnemar_exact(only_a, only_b)
    # statsmodels' binomial tail underflows to 0 where ours still holds ~1e-300 (seen: 2.7e-300)
    assert p == pytest.approx(_statsmodels_mcnemar(only_a, only_b), rel=1e-12, abs=1e-290)
    scipy_p = binomtest(only_a, only_a + only_b, 0.5).pvalue
    assert p == pytest.approx(scipy_p, rel=1e-12, abs=1e-300)


def test_mcnemar_exact_is_one_without_discordant_pairs() -> None:
    assert mcnemar_exact(0, 0) == 1.0
    assert _statsmodels_mcnemar(0, 0) == 1.0


def test_mcnemar_exact_keeps_tiny_p_values_exact() -> None:
    # 2 * (C(31, 0) + C(31, 1)) / 2**31, and a tail far below 1 - cdf's resolution
    assert mcnemar_exact(30, 1) == 64 / 2**31
    tail = sum(math.comb(1005, i) for i in range(6))
    assert mcnemar_exact(5, 1000) == float(Fraction(2 * tail, 2**1005)) > 0.0


def test_mcnemar_exact_rejects_negative_counts() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        mcnemar_exact(-1, 3)


@given(
    only_a=st.integers(min_value=0, max_value=2500),
    only_b=st.integers(min_value=0, max_value=2500),
)
def test_mcnemar_exact_equals_statsmodels_everywhere(only_a: int, only_b: int) -> None:
    p = mcnemar_exact(only_a, only_b)
    # statsmodels' binomial tail underflows to 0 where ours still holds ~1e-300 (seen: 2.7e-300)
    assert p == pytest.approx(_statsmodels_mcnemar(only_a, only_b), rel=1e-12, abs=1e-290)
    assert p == mcnemar_exact(only_b, only_a)


def _pass_at_k_by_enumeration(n: int, c: int, k: int) -> float:
    """The share of k-subsets of the n samples (c of them correct) holding a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return float(Fraction(sum(any(subset) for subset in subsets), len(subsets)))


def test_pass_at_k_equals_enumeration_over_subsets() -> None:
    for n in range(1, 9):
        for c, k in itertools.product(range(n + 1), range(1, n + 1)):
            assert pass_at_k(n, c, k) == _pass_at_k_by_enumeration(n, c, k), (n, c, k)


def test_pass_at_k_keeps_relative_precision_of_tiny_estimates() -> None:
    # 1 - C(999, 2) / C(1000, 2) = 2/1000; the ratio form would lose the last digits
    assert pass_at_k(1000, 1, 2) == 0.002
    assert pass_at_k(1000, 1, 1) == 0.001
    assert pass_at_k(200, 100, 101) == 1.0
    assert pass_at_k(5, 0, 5) == 0.0


@pytest.mark.parametrize(
    ("n", "c", "k", "message"),
    [
        (0, 0, 1, "at least one sample"),
        (5, 6, 1, "correct"),
        (5, -1, 1, "correct"),
        (5, 1, 0, "k must"),
        (5, 1, 6, "k must"),
    ],
)
def test_pass_at_k_rejects_impossible_arguments(n: int, c: int, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


def test_mean_at_k_is_the_share_of_correct_samples() -> None:
    assert mean_at_k([True, False, True, True]) == 0.75
    assert mean_at_k([1, 0]) == 0.5
    assert math.isclose(mean_at_k([True] * 3 + [False] * 4), 3 / 7)


@pytest.mark.parametrize(("correct", "message"), [([], "at least one"), ([1, 2], "bool")])
def test_mean_at_k_rejects_empty_or_non_binary_samples(correct: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mean_at_k(correct)
