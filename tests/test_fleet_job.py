"""The sandbox fleet inside the job, on a real Ray cluster of three nodes on this host (a
head and two nodes offering the sandbox-host resource, as `opd launch` starts
cluster.sandbox_hosts): slime's generate_and_rm_group runs our generate hook for a batch of
mini-SWE samples in a process joined to the cluster (tests/fleet_job_driver.py), every
sandbox is placed on the two sandbox nodes, and one of them is killed mid-batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sandbox.docker import reap
from slime_ext.job.sandboxes import run_owner
from tests.docker_images import daemon_problem, swebench_style_test_image
from tests.ray_nodes import RayCluster, ray_cluster, ray_env
from tests.slime_driver import require_slime

require_slime()

SANDBOX_NODE = {"opd_sandbox_host": 1.0}
SAMPLES = 6
NODE_DEATH_S = 2.0
"""How long after the kill a start may still land on the dying node (its actor outlives
the raylet briefly)."""


@pytest.mark.timeout(600)
def test_swe_sandboxes_live_on_the_sandbox_nodes_and_survive_losing_one(tmp_path: Path) -> None:
    """Docker where a daemon answers (CI: containers of the nodes' daemon, one here, the
    lost node's reaped by the run's owner label after), else local sandboxes (each node's
    under its own uids); OPD_FLEET_JOB_BACKEND=local|docker picks one."""
    backend = os.environ.get("OPD_FLEET_JOB_BACKEND") or ("local" if daemon_problem() else "docker")
    image = None
    if backend == "docker":
        if problem := daemon_problem():
            pytest.skip(problem)
        image = swebench_style_test_image()  # git, for the mini-SWE repositories
    try:
        report, cluster = _run_batch(tmp_path, backend, image)
    finally:
        if backend == "docker":  # the lost node's containers: its host never shut down
            reap({"opd.owner": run_owner(tmp_path / "run")})
    doomed = cluster.nodes[1]
    assert report["killed"], "the batch ended before both sandbox nodes held a sandbox"
    trajectories = report["trajectories"]
    assert len(trajectories) == SAMPLES
    lost = f"{doomed.address}-{backend}"
    survivor = f"{cluster.nodes[2].address}-{backend}"
    assert report["fleet"]["unreaped_hosts"] == [lost]
    placements = [box for t in trajectories for box in t["sandboxes"]]
    # every sandbox on a sandbox node, none on the head (127.0.0.2)
    assert placements and {box["host"] for box in placements} == {lost, survivor}
    for trajectory in trajectories:  # every trajectory ends with a status and a reason
        assert trajectory["status"] in {"completed", "truncated", "aborted", "sandbox_error"}
        assert trajectory["reason"], trajectory
    # the trajectories the lost node was running end as sandbox errors saying why
    on_lost = [
        t
        for t in trajectories
        if any(b["host"] == lost for b in t["sandboxes"]) and not t["finished_before_kill"]
    ]
    assert on_lost and all(t["status"] == "sandbox_error" for t in on_lost), on_lost
    assert all("gone" in t["reason"] or "died" in t["reason"].lower() for t in on_lost), on_lost
    # the rest finished their script (3 commands, a submit): on the survivor, or before
    rest = [t for t in trajectories if t not in on_lost]
    assert rest and all(t["status"] == "completed" and t["num_turns"] == 4 for t in rest), rest
    # a start in flight may still land in the second the dying node's actor lives on (its
    # trajectory then fails above); later ones all go to the survivor
    late = [box for box in placements if box["started_s_after_kill"] > NODE_DEATH_S]
    assert late and all(box["host"] == survivor for box in late), trajectories
    assert report["fleet"]["hosts"][lost]["breaker"] == "open"


def _run_batch(tmp_path: Path, backend: str, image: str | None) -> tuple[dict, RayCluster]:
    """The driver's report on a 3-node cluster (killed when it returns), and the cluster."""
    with (
        tempfile.TemporaryDirectory(prefix="rn", dir="/tmp") as root,
        ray_cluster(Path(root), [SANDBOX_NODE, SANDBOX_NODE]) as cluster,
    ):
        doomed = cluster.nodes[1]
        spec = {
            "gcs_address": cluster.gcs_address,
            "work_dir": str(tmp_path),
            "samples": SAMPLES,
            "max_sandboxes": 2,
            "backend": backend,
            "image": image,
            "kill_pgid": doomed.process.pid,
            "kill_host": f"{doomed.address}-{backend}",
            "kill_temp_dir": str(doomed.temp_dir),
        }
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        done = subprocess.run(
            [sys.executable, "-m", "tests.fleet_job_driver", str(tmp_path / "spec.json")],
            capture_output=True,
            text=True,
            timeout=480,
            check=False,
            env=ray_env(),
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(lines[-1].removeprefix("RESULT ")), cluster
