"""The SGLang stand-in ENGINE (slime_ext/cpu_runtime/sglang_engine.py) under slime's own
engine code (tests/engine_driver.py drives it): two `SGLangEngine` Ray actors launch it
and register with the real sglang-router; weights move through slime's distributed and
colocated transports and from disk; pause, flush, memory release and shutdown behave as
slime relies on them.

What must hold: each trajectory's turns reach one engine and both engines serve; after
each update the engines' top-k log-probs of a fixed prompt equal the updated model's
(and differ before: the check can fail); an update naming a parameter the model lacks is
refused and changes nothing; a paused engine aborts what it runs; a released engine
refuses to generate and to take weights; slime's external-engine check accepts the
engine's /server_info and catches a mismatch; shutdown leaves the router without workers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from slime_ext.models.factory import build_checkpoint
from tests import slime_job
from tests.slime_driver import require_slime

require_slime()
pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(
        __import__("importlib").util.find_spec("sglang_router") is None,
        reason="sglang_router is not installed (pip install sglang-router==0.3.2)",
    ),
]
MATCH = 1e-5
"""fp32 forwards of one model in two processes: equal to rounding."""


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("engine")
    hf_dir = build_checkpoint("qwen3-tiny", root / "student", seed=3)
    with slime_job.cpu_cluster(Path(tmp_path_factory.mktemp("r")), gpus=2) as cluster:
        spec = {"gcs_address": cluster.gcs_address, "hf_dir": str(hf_dir), "directory": str(root)}
        (root / "spec.json").write_text(json.dumps(spec))
        command = [
            sys.executable, "-m", "tests.engine_driver", str(root / "spec.json"),
            str(root / "observed.json"),
        ]  # fmt: skip
        env = slime_job.driver_env(cluster)
        slime_job.run(command, root / "driver.log", env=env, timeout_s=360, cwd=slime_job.ROOT)
    return json.loads((root / "observed.json").read_text())


def test_engines_register_with_the_router_and_keep_each_trajectory_on_one(
    observed: dict[str, Any],
) -> None:
    assert observed["registered"] == sorted(observed["urls"])
    sessions = {k: v for k, v in observed["sessions"].items() if k.startswith("task-")}
    assert len(sessions) == 8
    for session, counts in sessions.items():
        assert sorted(counts) == [0, 3], f"{session}'s turns were split: {counts}"
    assert all(any(counts[i] for counts in sessions.values()) for i in range(2))
    # the negative control: a router that ignores the routing key splits trajectories (each
    # one by chance kept whole 1 time in 4: all 8 kept, 1 run in 65,536)
    split = {k: v for k, v in observed["sessions_round_robin"].items() if k.startswith("task-")}
    assert len(split) == 8 and any(0 not in counts for counts in split.values()), split


def test_weights_from_every_transport_reach_the_engine_exactly(observed: dict[str, Any]) -> None:
    assert observed["initial_gap"] < MATCH
    assert observed["stale_gap"] > 1e-3  # an engine that kept its weights would fail
    assert all(reply["success"] for reply in observed["distributed_replies"])
    assert observed["distributed_gap"] < MATCH
    assert observed["versions"] == ["1", "1"]
    assert observed["tensor_gap"] < MATCH
    assert observed["disk_gap"] < MATCH
    assert observed["disk_version"] == "3"


def test_a_bad_update_is_refused_whole_and_changes_nothing(observed: dict[str, Any]) -> None:
    assert observed["bad_update"] is True
    assert observed["gap_after_bad_update"] < MATCH


def test_pause_release_external_check_and_shutdown_behave_as_slime_relies(
    observed: dict[str, Any],
) -> None:
    assert observed["paused_request"]["type"] == "abort"
    assert observed["generate_while_released"] == 503
    assert observed["update_while_released"] is True
    assert observed["generate_with_kv_cache_released"] == 503  # weights back, KV cache not
    assert observed["unknown_memory_tag"] == 400  # SGLang's tags: weights, kv_cache, cuda_graph
    assert observed["external_mismatch"] == "name='enable_memory_saver'"
    assert observed["workers_after_shutdown"] == []
