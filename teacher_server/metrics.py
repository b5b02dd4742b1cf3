"""A few Prometheus metrics, rendered as the text exposition format."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class ServerMetrics:
    """Counters shared by the HTTP layer and the backend (thread-safe increments)."""

    requests_total: int = 0
    items_total: int = 0
    errors_total: dict[int, int] = field(default_factory=dict)
    tokens_scored_total: int = 0
    """Span tokens whose log-probs were returned."""
    tokens_computed_total: int = 0
    """Tokens the model actually ran over (padding included)."""
    cached_tokens_total: int = 0
    """Prefix tokens reused from a session's cache."""
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    latency_sum_s: float = 0.0
    connections: int = 0
    """Client connections open now."""
    connections_closed_total: dict[str, int] = field(default_factory=dict)
    """Connections the server's limits closed (connections.py), by reason: header_timeout,
    evicted (the one idle longest, at the cap) or over_cap (a newcomer, none idle)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_tokens(self, scored: int = 0, computed: int = 0, cached: int = 0) -> None:
        with self._lock:
            self.tokens_scored_total += scored
            self.tokens_computed_total += computed
            self.cached_tokens_total += cached

    def count_error(self, status: int) -> None:
        """A request refused before it reached a route (the guard's 401, 408, 413, 503)."""
        with self._lock:
            self.errors_total[status] = self.errors_total.get(status, 0) + 1

    def count_connection(self, delta: int) -> None:
        """A connection opened (+1) or lost (-1)."""
        with self._lock:
            self.connections += delta

    def count_closed_connection(self, reason: str) -> None:
        with self._lock:
            self.connections_closed_total[reason] = self.connections_closed_total.get(reason, 0) + 1

    def observe_request(self, items: int, latency_s: float, status: int) -> None:
        with self._lock:
            self.requests_total += 1
            self.items_total += items
            if status >= 400:
                self.errors_total[status] = self.errors_total.get(status, 0) + 1
            bucket = next(
                (i for i, bound in enumerate(LATENCY_BUCKETS_S) if latency_s <= bound),
                len(LATENCY_BUCKETS_S),
            )
            self.latency_counts[bucket] += 1
            self.latency_sum_s += latency_s

    def render(self, extra: str = "") -> str:
        with self._lock:
            lines = [
                "# TYPE opd_teacher_requests_total counter",
                f"opd_teacher_requests_total {self.requests_total}",
                "# TYPE opd_teacher_items_total counter",
                f"opd_teacher_items_total {self.items_total}",
                "# TYPE opd_teacher_errors_total counter",
                *(
                    f'opd_teacher_errors_total{{code="{code}"}} {count}'
                    for code, count in sorted(self.errors_total.items())
                ),
                "# TYPE opd_teacher_tokens_scored_total counter",
                f"opd_teacher_tokens_scored_total {self.tokens_scored_total}",
                "# TYPE opd_teacher_tokens_computed_total counter",
                f"opd_teacher_tokens_computed_total {self.tokens_computed_total}",
                "# TYPE opd_teacher_cache_hit_tokens_total counter",
                f"opd_teacher_cache_hit_tokens_total {self.cached_tokens_total}",
                "# TYPE opd_teacher_connections gauge",
                f"opd_teacher_connections {self.connections}",
                "# TYPE opd_teacher_connections_closed_total counter",
                *(
                    f'opd_teacher_connections_closed_total{{reason="{reason}"}} {count}'
                    for reason, count in sorted(self.connections_closed_total.items())
                ),
                "# TYPE opd_teacher_request_latency_seconds histogram",
            ]
            cumulative = 0
            for bound, count in zip(LATENCY_BUCKETS_S, self.latency_counts, strict=False):
                cumulative += count
                lines.append(
                    f'opd_teacher_request_latency_seconds_bucket{{le="{bound}"}} {cumulative}'
                )
            total = sum(self.latency_counts)
            lines += [
                f'opd_teacher_request_latency_seconds_bucket{{le="+Inf"}} {total}',
                f"opd_teacher_request_latency_seconds_sum {self.latency_sum_s:.6f}",
                f"opd_teacher_request_latency_seconds_count {total}",
            ]
        return "\n".join(lines) + "\n" + extra
