"""Keeping the test that loads every core apart from the tests that bound wall time, across
test processes (`make test` runs two: pytest-xdist).

tests/test_determinism.py runs a training beside a busy loop on every core; a test in
another process that asserts a deadline (a sandbox killed within its window, a service
answering within seconds, a latency ratio) would then measure that load, not the code. The
loading test holds a host-wide lock exclusively while it loads the host; each test of
WALL_CLOCK_BOUNDED holds it shared while it runs (tests/conftest.py), so neither starts
while the other runs. `host_lock` is any such host-wide lock (tests/docker_images.py builds
its images under one).
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path

WALL_CLOCK_BOUNDED = frozenset(
    {
        "test_sandbox_docker.py",
        "test_sandbox_local.py",
        "test_sandbox_python_worker.py",
        "test_sandbox_security.py",
        "test_sandbox_worker_attacks.py",
        "test_teacher_connections.py",
        "test_teacher_session_cache.py",
    }
)
"""Test files whose assertions bound wall time."""


@contextlib.contextmanager
def host_lock(name: str, exclusive: bool = True) -> Iterator[None]:
    """`name`'s lock on this host, across test processes, held while the block runs."""
    with open(Path(tempfile.gettempdir()) / f"opd-test-{name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield


def held(exclusive: bool) -> contextlib.AbstractContextManager[None]:
    """The host-load lock: exclusive while every core is loaded, shared while a test of
    WALL_CLOCK_BOUNDED runs."""
    return host_lock("host-load", exclusive)
