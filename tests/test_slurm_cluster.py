"""The Slurm cluster fixture (tests/slurm_cluster.py) is a real cluster, under both
proctrack plugins: batch jobs spread steps over nodes with their addresses and GPUs,
steps contend for a node as on a real cluster, and nothing outlives the cluster."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests import slurm_cluster as fixture_module
from tests.slurm_cluster import (
    Proctrack,
    SlurmCluster,
    SlurmClusterError,
    require_slurm,
    slurm_cluster,
)

PROCTRACKS: list[Proctrack] = ["linuxproc", "cgroup"]
DAEMON_NAMES = ["munged", "slurmctld", "slurmd", "slurmstepd"]


def batch_script(directory: Path, body: str) -> Path:
    script = directory / "job.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=3 --gres=gpu:4 --output=job.out\nset -u\n" + body
    )
    return script


def wait_for_text(path: Path, text: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        output = path.read_text() if path.exists() else ""
        if text in output:
            return output
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path} after {timeout_s} s: {output!r}")


def assert_nothing_left(cluster: SlurmCluster, commands: list[str]) -> None:
    assert cluster.processes_left(commands) == []
    assert cluster.processes_left([str(cluster.directory)], host_wide=True) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("proctrack", PROCTRACKS)
def test_batch_job_runs_a_step_on_each_node_with_its_address_and_gpus(
    proctrack: Proctrack, tmp_path: Path
) -> None:
    require_slurm(proctrack)
    (tmp_path / "step.sh").write_text(
        "address=$(scontrol show node $SLURMD_NODENAME | grep -o 'NodeAddr=[^ ]*')\n"
        'echo "$SLURMD_NODENAME $address gpus=$CUDA_VISIBLE_DEVICES step_gpus=$SLURM_STEP_GPUS"\n'
    )
    script = batch_script(tmp_path, "srun --label bash step.sh\n")
    with slurm_cluster(tmp_path / "slurm", proctrack) as cluster:
        assert len(cluster.node_names) == 7
        assert len(set(map(cluster.node_address, cluster.node_names))) == 7
        job_id = cluster.sbatch(script)
        assert cluster.wait_job(job_id, timeout_s=30) == "COMPLETED"
        job = cluster.job(job_id)
        assert job is not None and job["TresPerNode"] == "gres:gpu:4"
        lines = sorted((tmp_path / "job.out").read_text().splitlines())
        nodes = sorted(line.split()[1] for line in lines)
        assert nodes == cluster.node_names[:3]
        assert lines == [
            f"{rank}: {node} NodeAddr={cluster.node_address(node)} gpus=0,1,2,3 step_gpus=0,1,2,3"
            for rank, node in enumerate(nodes)
        ]
    assert_nothing_left(cluster, DAEMON_NAMES)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("proctrack", PROCTRACKS)
def test_a_busy_node_runs_overlap_steps_and_holds_other_steps_until_cancel(
    proctrack: Proctrack, tmp_path: Path
) -> None:
    require_slurm(proctrack)
    script = batch_script(
        tmp_path,
        """node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tail -n 1)
srun --nodes=1 --ntasks=1 --nodelist="$node" --job-name=daemon bash daemon.sh &
until squeue --steps --noheader --jobs="$SLURM_JOB_ID" --format=%j | grep -qx daemon; do
    sleep 0.2
done
srun --nodes=1 --ntasks=1 --nodelist="$node" --overlap bash -c 'echo "overlap on $SLURMD_NODENAME"'
srun --nodes=1 --ntasks=1 --nodelist="$node" bash -c 'echo "exclusive on $SLURMD_NODENAME"'
wait
""",
    )
    (tmp_path / "daemon.sh").write_text("exec sleep 300\n")
    with slurm_cluster(tmp_path / "slurm", proctrack) as cluster:
        job_id = cluster.sbatch(script)
        output = tmp_path / "job.out"
        wait_for_text(output, "overlap on node2", timeout_s=30)
        time.sleep(3)  # the step without --overlap stays pending while the daemon runs
        assert "exclusive on" not in output.read_text()
        waiting = cluster.processes_left(["srun --nodes=1 --ntasks=1 --nodelist=node2 bash"])
        assert waiting != []  # its srun still waits for the node
        assert cluster.job_state(job_id) == "RUNNING"
        assert len(cluster.processes_left(["sleep 300"])) == 1
        cluster.scancel(job_id)
        assert cluster.wait_job(job_id, timeout_s=20) == "CANCELLED"
        assert cluster.processes_left(["sleep 300", "srun"]) == []
        after_cancel = output.read_text()
        assert "exclusive on" not in after_cancel
        assert "step creation temporarily disabled, retrying (Requested nodes are busy)" in (
            after_cancel
        )  # srun says why it waited only once it gives up
    assert_nothing_left(cluster, [*DAEMON_NAMES, "sleep 300"])
    assert cluster.killed_at_exit == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("proctrack", PROCTRACKS)
def test_a_detached_step_child_outlives_its_step_under_linuxproc_only(
    proctrack: Proctrack, tmp_path: Path
) -> None:
    require_slurm(proctrack)
    script = batch_script(
        tmp_path,
        "srun --nodes=1 --ntasks=1 bash -c 'setsid sleep 301 </dev/null >/dev/null 2>&1 &'\n",
    )
    with slurm_cluster(tmp_path / "slurm", proctrack) as cluster:
        job_id = cluster.sbatch(script)
        assert cluster.wait_job(job_id, timeout_s=30) == "COMPLETED"
        leaked = cluster.processes_left(["sleep 301"])
        assert len(leaked) == (1 if proctrack == "linuxproc" else 0)
    assert_nothing_left(cluster, [*DAEMON_NAMES, "sleep 301"])
    assert cluster.killed_at_exit == leaked  # the teardown swept what Slurm left


@pytest.mark.timeout(60)
def test_a_cluster_that_cannot_start_says_why_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_slurm("linuxproc")
    directory = tmp_path / "slurm"
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        free_ports = fixture_module.free_ports
        monkeypatch.setattr(  # slurmctld's port is in use
            fixture_module,
            "free_ports",
            lambda count: [taken.getsockname()[1], *free_ports(count - 1)],
        )
        with pytest.raises(SlurmClusterError) as failure, slurm_cluster(directory, "linuxproc"):
            pass
    message = str(failure.value)
    assert "slurmctld exited" in message
    assert f"--- {directory / 'log' / 'slurmctld.log'}" in message
    assert "Address already in use" in message
    left = subprocess.run(["pgrep", "--full", str(directory)], capture_output=True, text=True)
    assert left.stdout == ""
