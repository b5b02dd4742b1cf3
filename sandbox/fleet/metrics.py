"""Latency samples the fleet reports in its metrics."""

from __future__ import annotations

from collections import deque


class LatencySamples:
    """A latency histogram: count and mean of all, quantiles of the latest `keep`."""

    def __init__(self, keep: int = 10_000) -> None:
        self.latest: deque[float] = deque(maxlen=keep)
        self.count = 0
        self.total = 0.0

    def add(self, value: float) -> None:
        self.latest.append(value)
        self.count += 1
        self.total += value

    def summary(self) -> dict[str, float]:
        if not self.count:
            return {"count": 0}
        ordered = sorted(self.latest)

        def quantile(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return {
            "count": self.count,
            "mean": self.total / self.count,
            "p50": quantile(0.5),
            "p90": quantile(0.9),
            "p99": quantile(0.99),
            "max": ordered[-1],
        }
