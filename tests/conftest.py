"""Shared fixtures. Hypothesis runs a smaller, deadline-free profile under CI."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests import host_load

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

LONGEST_FIRST = (
    "test_launch_slurm.py",
    "test_slime_train.py",
    "test_slime_loop.py",
    "test_launch_ssh.py",
    "test_rehearsal.py",
    "test_launch.py",
    "test_determinism.py",
    "test_megatron_step.py",
    "test_local_training.py",
    "test_fleet.py",
)
"""The files that take longest here (minutes each: whole jobs on Slurm, Ray and ssh),
collected first: `make test` hands whole files to its workers (pytest-xdist, --dist
loadfile) in collection order (--no-loadscope-reorder: xdist would otherwise start with
the files of most tests), so none of them is left to run alone at the end."""


@pytest.fixture(autouse=True)
def _apart_from_host_load(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that bounds wall time never runs while another test process loads every
    core (tests/host_load.py)."""
    if request.node.path.name not in host_load.WALL_CLOCK_BOUNDED:
        yield
        return
    with host_load.held(exclusive=False):
        yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order


@pytest.fixture(scope="session")
def factory_tokenizer():  # type: ignore[no-untyped-def]
    from slime_ext.models.factory import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def factory_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved factory checkpoint (qwen3-tiny) shared by the session's tests."""
    from slime_ext.models.factory import build_checkpoint

    return build_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("factory") / "qwen3-tiny")


@pytest.fixture(scope="session")
def unpadded_student(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The tiny factory student with one embedding row per token, and its torch_dist
    checkpoint by slime's converter (about 17 s): made once for the whole-job tests
    (tests/test_launch_slurm.py, test_launch_ssh.py, test_slime_loop.py), which only read
    it (their jobs save elsewhere)."""
    from tests.test_slime_train import make_student

    return make_student(tmp_path_factory.mktemp("student"), vocab=None)
