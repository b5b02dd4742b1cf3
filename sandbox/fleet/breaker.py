"""A host's circuit breaker: after repeated infrastructure failures no new sandbox goes
to the host for a cooldown, then one start may probe it."""

from __future__ import annotations

from typing import Literal


class CircuitBreaker:
    """Closed: new sandboxes may go to the host. `failures_to_open` infrastructure
    failures in a row open it; after `cooldown_s` one start may probe (half open): its
    success closes the breaker, its failure opens it again."""

    def __init__(self, failures_to_open: int, cooldown_s: float) -> None:
        self.failures_to_open = failures_to_open
        self.cooldown_s = cooldown_s
        self.state: Literal["closed", "open", "half_open"] = "closed"
        self.failures = 0
        self.opened_at = 0.0
        self.opens = 0

    def accepts(self, now: float) -> bool:
        if self.state == "open":
            return now >= self.reopens_at
        return self.state == "closed"

    @property
    def reopens_at(self) -> float:
        return self.opened_at + self.cooldown_s

    def placed(self) -> None:
        """A start goes to the host (the probe, when the breaker was open)."""
        if self.state == "open":
            self.state = "half_open"

    def succeeded(self) -> None:
        self.state, self.failures = "closed", 0

    def failed(self, now: float) -> None:
        self.failures += 1
        if self.state != "closed" or self.failures >= self.failures_to_open:
            self.trip(now)

    def undecided(self) -> None:
        """A probe ended without a verdict (its caller gave up first): another may go."""
        if self.state == "half_open":
            self.state = "open"

    def trip(self, now: float) -> None:
        """Open now (a failure while open restarts the cooldown)."""
        if self.state != "open":
            self.opens += 1
        self.state, self.opened_at = "open", now
