"""Statistics of evaluation results: pass-rate intervals, paired tests, pass@k.

Pure python (math and exact integers), so reports need no scipy at runtime:
- `wilson_interval(successes, n, confidence)`: the Wilson score interval of a pass rate.
- `mcnemar_exact(only_a, only_b)`: the exact two-sided McNemar p-value of two paired runs,
  from their discordant instances alone.
- `pass_at_k(n, c, k)`: the unbiased pass@k estimate from n samples of which c are correct
  (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").
- `mean_at_k(correct)`: avg@k, the fraction of one problem's k samples that are correct.
- `normal_quantile(p)`: the standard normal inverse CDF that the interval needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Acklam's rational approximation of the normal quantile (relative error 1.15e-9), polished
# below by one Halley step on math.erfc to about machine precision.
_ACKLAM_A = (
    -3.969683028665376e01,
    2.209460984245205e02,
    -2.759285104469687e02,
    1.383577518672690e02,
    -3.066479806614716e01,
    2.506628277459239e00,
)
_ACKLAM_B = (
    -5.447609879822406e01,
    1.615858368580409e02,
    -1.556989798598866e02,
    6.680131188771972e01,
    -1.328068155288572e01,
)
_ACKLAM_C = (
    -7.784894002430293e-03,
    -3.223964580411365e-01,
    -2.400758277161838e00,
    -2.549732539343734e00,
    4.374664141464968e00,
    2.938163982698783e00,
)
_ACKLAM_D = (
    7.784695709041462e-03,
    3.224671290700398e-01,
    2.445134137142996e00,
    3.754408661907416e00,
)
_ACKLAM_LOW = 0.02425


def _polynomial(coefficients: Sequence[float], x: float) -> float:
    value = 0.0
    for coefficient in coefficients:
        value = value * x + coefficient
    return value


def normal_quantile(p: float) -> float:
    """The z with P[Z <= z] = p for a standard normal Z, 0 < p < 1 (accurate to ~1e-15)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"a normal quantile needs 0 < p < 1, got {p}")
    if p > 0.5:  # 1 - p is exact here, and the lower tail keeps its relative precision
        return -normal_quantile(1.0 - p)
    if p < _ACKLAM_LOW:
        q = math.sqrt(-2.0 * math.log(p))
        z = _polynomial(_ACKLAM_C, q) / (_polynomial(_ACKLAM_D, q) * q + 1.0)
    else:
        q = p - 0.5
        r = q * q
        z = _polynomial(_ACKLAM_A, r) * q / (_polynomial(_ACKLAM_B, r) * r + 1.0)
    # one Halley step on Phi(z) - p; the density is divided out in log space, as it
    # underflows in the far tail before p does
    relative_error = 0.5 * math.erfc(-z / math.sqrt(2.0)) / p - 1.0
    step = relative_error * math.sqrt(2.0 * math.pi) * math.exp(math.log(p) + z * z / 2.0)
    return z - step / (1.0 + z * step / 2.0)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval (low, high) of the rate successes / n; (0, 1) when n == 0."""
    if n < 0 or successes < 0:
        raise ValueError(f"counts must be non-negative, got successes={successes}, n={n}")
    if successes > n:
        raise ValueError(f"successes ({successes}) exceed the number of trials ({n})")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence}")
    if n == 0:
        return 0.0, 1.0
    # the lower tail's quantile: 1 - (1 - confidence) / 2 would round away digits of alpha
    z = -normal_quantile((1.0 - confidence) / 2.0)
    rate = successes / n
    denominator = 1.0 + z * z / n
    center = (rate + z * z / (2.0 * n)) / denominator
    half_width = z * math.sqrt(rate * (1.0 - rate) / n + z * z / (4.0 * n * n)) / denominator
    low = 0.0 if successes == 0 else max(0.0, center - half_width)
    high = 1.0 if successes == n else min(1.0, center + half_width)
    return low, high


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar p-value from the discordant pair counts (1.0 when none).

    Under the null each discordant instance is A's or B's with probability 1/2, so
    p = min(1, 2 P[X <= min(only_a, only_b)]) with X ~ Bin(only_a + only_b, 1/2). The tail is
    summed in exact integers and divided once (correctly rounded); that is quick for the
    few thousand discordant instances an evaluation has.
    """
    if only_a < 0 or only_b < 0:
        raise ValueError(f"counts must be non-negative, got only_a={only_a}, only_b={only_b}")
    discordant = only_a + only_b
    smaller = min(only_a, only_b)
    if 2 * smaller >= discordant:  # equal counts (or none): the two tails cover everything
        return 1.0
    term, tail = 1, 1  # C(discordant, 0) and the tail sum so far
    for i in range(1, smaller + 1):
        term = term * (discordant - i + 1) // i
        tail += term
    return min(1.0, 2 * tail / 2**discordant)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n - c, k) / C(n, k).

    Exact integers and one correctly rounded division, so a tiny pass@k keeps its
    relative precision (no 1 - x cancellation).
    """
    if n < 1:
        raise ValueError(f"pass@k needs at least one sample, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"the correct count must lie in [0, n={n}], got c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must lie in [1, n={n}] (k samples drawn from n), got k={k}")
    all_draws = math.comb(n, k)
    return (all_draws - math.comb(n - c, k)) / all_draws


def mean_at_k(correct: Sequence[bool | int]) -> float:
    """avg@k of one problem: the fraction of its k samples that are correct (each 0 or 1)."""
    if not correct:
        raise ValueError("avg@k needs at least one sample")
    if any(value not in (0, 1) for value in correct):
        raise ValueError("each sample's correctness must be a bool (or 0/1)")
    return sum(correct) / len(correct)
