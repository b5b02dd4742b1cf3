"""The fleet's view of one host (`FleetHost`): its breaker, its slots in use, its last
status, and the rank by which a new sandbox is placed."""

from __future__ import annotations

import asyncio

from sandbox.fleet.breaker import CircuitBreaker
from sandbox.fleet.hosts import HostStatus, SandboxHost


class FleetHost:
    """The fleet's view of one host: breaker, slots in use, last status."""

    def __init__(self, host: SandboxHost, breaker: CircuitBreaker) -> None:
        self.host = host
        self.name = host.name
        self.breaker = breaker
        self.status: HostStatus | None = None
        """None until the host answered once: then it may take one sandbox at a time."""
        self.active = 0
        """Handed-out sandboxes plus starts in flight."""
        self.status_call: asyncio.Future[HostStatus] | None = None

    @property
    def cap(self) -> int:
        return 1 if self.status is None else self.status.max_sandboxes

    def image_key(self, image: str | None) -> str | None:
        """Its image for `image` ("" when unknown yet), None when it cannot run it."""
        return "" if self.status is None else self.status.image_key(image)

    def rank(self, image: str | None) -> tuple[bool, bool, float]:
        """Placement preference: a warm sandbox, the image present, a light load."""
        key = self.image_key(image)
        warm = self.status is not None and bool(key) and self.status.warm.get(key or "", 0) > 0
        holds = self.status is not None and (
            self.status.backend == "local" or key in self.status.images
        )
        return warm, holds, -self.active / self.cap
