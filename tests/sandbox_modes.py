"""The isolation modes the LocalSandbox tests run in: strict (bubblewrap), skipped with the
reason when it cannot run here, and basic; and `run` for the sandboxes' coroutines."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from sandbox.jail import find_bwrap, probe_strict

T = TypeVar("T")


def strict_problem() -> str | None:
    """None when strict isolation works here, else why not."""
    bwrap = find_bwrap()
    return "bubblewrap is not installed" if bwrap is None else probe_strict(bwrap)


STRICT = pytest.param(
    "strict",
    marks=pytest.mark.skipif(
        strict_problem() is not None, reason=f"strict isolation: {strict_problem()}"
    ),
)
BOTH = [STRICT, "basic"]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)
