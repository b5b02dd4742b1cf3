"""`opd launch --sbatch` on a REAL Slurm: the generated batch script, submitted with sbatch
to a 7-node Slurm on this host (tests/slurm_cluster.py), under proctrack/cgroup and
proctrack/linuxproc.

Real: Slurm (sbatch, srun steps, a heterogeneous allocation with fake GPUs), Ray (one
`ray start --block` per node, on the node's Slurm address), `opd-teacher serve` (a factory
model on CPU, with an API key), `launch.wait_ray`, `ray job submit`, and in the first test
slime's own train.py (tests/launch_real_job.py: OPD on the TIR task for 2 rollouts, the
tiny student on one fake GPU with the SGLang stand-in engine colocated, under the CPU
runtime the job's environment carries). The other tests' job has a stand-in slime
checkout (`cluster.slime_dir`, tests/launch_standins.py: a `train.py` that probes the
cluster instead of training, holding until killed where a test kills the job, a no-op
`tools/convert_hf_to_torch_dist.py`, a MODEL_ARGS script). The stand-in reports what the
job's processes see: the nodes and their resources, a Ray task on a training node calling
the teacher with the key Ray expanded from its node's environment (and without it), a task
on the sandbox host.

Checked: the jobs complete (slime's train.py: every rollout scored and trained on, the
last checkpoint saved); Ray had every node (training nodes with GPUs, the sandbox host with
the sandbox resource and none); the teacher answered 200 with the key and 401 without; the
key's value appears in no file the plan wrote; afterwards no Ray, teacher, engine or
stand-in process is left and the queue is empty.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from launch.plan import RAY_JOIN_RESTARTS, render_sbatch, wandb_run_id
from slime_ext.job.config import config_from_dict
from tests.launch_real_job import RAY_CPUS, assert_trained, merged, real_train_settings
from tests.launch_standins import (
    KEY_NAME,
    KEY_VALUE,
    LEFTOVERS,
    ray_node_args,
    standin_slime,
    standin_tasks,
)
from tests.live_server import free_port
from tests.slurm_cluster import require_slurm, slurm_cluster
from tests.test_slime_train import Student


def _job(
    directory: Path,
    factory_dir: Path,
    ray_temp: Path,
    real: Student | None = None,
    changes: dict[str, Any] | None = None,
) -> Any:
    """The stand-in job on two training nodes; with `real`, slime's train.py training that
    student on one (tests/launch_real_job.py); `changes`: sections merged in."""
    slime = standin_slime(directory)
    run = directory / "run"
    tasks = directory / "tasks.jsonl"
    standin_tasks(tasks)
    settings = {
        "model": {"student": str(factory_dir)},
        "parallel": {"num_nodes": 2, "gpus_per_node": 4, "max_tokens_per_gpu": 8192},
        "teacher": {
            "kind": "remote",
            "backend": "hf",
            "model": str(factory_dir),
            "node": "slurm-allocated",
            "url": "http://slurm-allocated:1",  # the plan serves it: replaced
            "port": free_port(),
            "api_key_env": KEY_NAME,
            "serve_args": ["--device", "cpu", "--dtype", "float32"],
        },
        "logging": {"run_dir": str(run), "wandb_mode": "disabled"},
        "cluster": {
            "executor": "srun",
            "sandbox_hosts": ["slurm-allocated"],
            "remote_shell": ["bash", "-c"],
            "slime_dir": str(slime),
            "megatron_dir": str(directory),
            "model_args_script": "scripts/models/tiny.sh",
            "megatron_checkpoint": str(directory / "ckpt"),
            "save_dir": str(directory / "save"),
            "tasks_file": str(tasks),
            "ray_port": free_port(),
            "dashboard_port": free_port(),
            # node K of the Slurm cluster is named nodeK
            "ray_start_args": ray_node_args(
                ray_temp, "$SLURMD_NODENAME", "${SLURMD_NODENAME#node}"
            ),
            "ray_wait_s": 180,
            "sbatch_options": ["--time=15"],
        },
    }
    if real is not None:
        settings = merged(settings, real_train_settings(directory / "real", real))
        node = ("$SLURMD_NODENAME", "${SLURMD_NODENAME#node}")
        settings["cluster"]["ray_start_args"] = ray_node_args(ray_temp, *node, RAY_CPUS)
    return config_from_dict(merged(settings, changes or {}))


def _job_env() -> dict[str, str]:
    """What a user's shell exports before sbatch: the venv's programs, the teacher's key
    (by name), Ray's token auth when this machine has it turned on."""
    env = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        KEY_NAME: KEY_VALUE,
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    }
    token = Path.home() / ".ray/auth_token"
    if token.exists():
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    return env


def _check_the_run(tmp_path: Path, cluster: Any, state: str) -> None:
    """What a completed run must show (the module docstring)."""
    output = "\n".join(
        f"--- {path.name}\n{path.read_text()[-3000:]}"
        for path in sorted((tmp_path / "run/logs").glob("*"))
    )
    assert state == "COMPLETED", output
    report = json.loads((tmp_path / "run/standin-train.json").read_text())
    gpu_ips = {n["ip"] for n in report["nodes"] if n["resources"].get("GPU", 0) == 4}
    sandbox = [n for n in report["nodes"] if "opd_sandbox_host" in n["resources"]]
    assert len(report["nodes"]) == 3 and len(gpu_ips) == 2, report["nodes"]
    assert len(sandbox) == 1 and sandbox[0]["resources"].get("GPU", 0) == 0
    # nor CPUs: the job's CPU actors (slime's RolloutManager) stay on training nodes
    assert sandbox[0]["resources"].get("CPU", 0) == 0, sandbox
    addresses = set(cluster.node_addresses.values())
    assert gpu_ips <= addresses and sandbox[0]["ip"] in addresses
    training = report["training"]
    assert training["key_set"] and not training["key_unexpanded"], training
    assert (training["with_key"], training["without_key"]) == (200, 401), training
    assert training["ip"] in gpu_ips and report["sandbox"]["gpus"] == []
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert KEY_VALUE not in path.read_text(errors="replace"), path
    assert cluster.wait_queue_empty(timeout_s=30) == []
    assert cluster.processes_left(LEFTOVERS) == []


@pytest.fixture(scope="module")
def student(unpadded_student: Student) -> Student:
    require_slurm("linuxproc")
    return unpadded_student


@pytest.mark.timeout(480)
def test_the_generated_sbatch_script_runs_slimes_train_py_and_leaves_nothing(
    tmp_path: Path, factory_dir: Path, student: Student, request: pytest.FixtureRequest
) -> None:
    """Under proctrack/linuxproc, slime's real train.py (tests/launch_real_job.py): every
    rollout scored by the teacher (with the key Ray expanded from the node's environment:
    without it every score is refused and the job stops) and trained on, the last
    rollout's checkpoint saved, the key's value in no file, no process or job left. Under
    cgroup the relaunch below checks, with the stand-in train.py, what the cluster's nodes
    and the teacher's key look like from inside a job."""
    require_slurm("linuxproc")
    script, _ = _submit_variant(tmp_path, factory_dir, request, lambda text: text, real=student)
    assert KEY_VALUE not in script.read_text()
    with slurm_cluster(tmp_path / "slurm", "linuxproc") as cluster:
        state = cluster.wait_job(cluster.sbatch(script, _job_env()), timeout_s=400)
        logs = sorted((tmp_path / "run/logs").glob("*"))
        output = "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}" for path in logs)
        assert state == "COMPLETED", output
        # the batch script's own output holds the job's (it submits and follows it)
        assert_trained(next((tmp_path / "run/logs").glob("slurm-*.out")), tmp_path / "real")
        for path in (tmp_path / "run").rglob("*"):
            if path.is_file():
                assert KEY_VALUE not in path.read_text(errors="replace"), path
        assert cluster.wait_queue_empty(timeout_s=30) == []
        assert cluster.processes_left(LEFTOVERS) == []


def _submit_variant(
    tmp_path: Path,
    factory_dir: Path,
    request: pytest.FixtureRequest,
    edit: Any,
    ray_wait_s: int = 180,
    real: Student | None = None,
    changes: dict[str, Any] | None = None,
) -> tuple[Path, Any]:
    """The generated script with `edit` applied to its text (a plan as it was before the
    fix the test is the control of), written next to the job."""
    ray_temp = Path(tempfile.mkdtemp(prefix="opd-ray-"))
    request.addfinalizer(lambda: shutil.rmtree(ray_temp, ignore_errors=True))
    job = _job(tmp_path, factory_dir, ray_temp, real, changes)
    job = job.model_copy(
        update={"cluster": job.cluster.model_copy(update={"ray_wait_s": ray_wait_s})}
    )
    script = tmp_path / "job.sbatch"
    script.write_text(edit(render_sbatch(job, script)))
    (tmp_path / "run/logs").mkdir(parents=True, exist_ok=True)
    return script, job


@pytest.mark.timeout(300)
def test_without_overlap_a_step_waits_for_ever_and_scancel_leaves_nothing(
    tmp_path: Path, factory_dir: Path, request: pytest.FixtureRequest
) -> None:
    """Negative control: without --overlap (the plan before this fix) a step waits for ever
    for the resources of the job's steps before it ("Requested nodes are busy"): the job
    is still running, stuck before Ray's cluster forms, long after it would have
    finished. Cancelling it (scancel) mid-run leaves no Ray, teacher or step process and
    an empty queue."""
    require_slurm("linuxproc")
    script, _ = _submit_variant(
        tmp_path, factory_dir, request, lambda text: text.replace(" --overlap", "")
    )
    with slurm_cluster(tmp_path / "slurm", "linuxproc") as cluster:
        job_id = cluster.sbatch(script, _job_env())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert cluster.job_state(job_id) in ("PENDING", "RUNNING")
            time.sleep(2)
        assert not (tmp_path / "run/standin-train.json").exists()
        # stuck behind the steps before it (the shared-path checks, the teacher service):
        # the steps after never start, Ray's cluster never forms
        assert not (tmp_path / "run/logs/ray-worker-1.log").exists()
        cluster.scancel(job_id)
        assert cluster.wait_job(job_id, timeout_s=60) == "CANCELLED"
        assert cluster.wait_queue_empty(timeout_s=30) == []
        assert cluster.processes_left(LEFTOVERS) == []


def _refused_once(flag: Path) -> Any:
    """An edit of the script: ray-worker-1's first `ray start` fails at once, as a join
    that timed out at startup would (transient); later starts go on."""
    fail = f"test -e {flag} || {{ touch {flag}; echo join refused once; exit 1; }}; "

    def edit(text: str) -> str:
        lines = text.splitlines(keepends=True)
        [index] = [i for i, line in enumerate(lines) if line.startswith("daemon ray-worker-1 ")]
        head, quote, command = lines[index].partition("'")
        lines[index] = f"{head}{quote}{fail}{command}"
        return "".join(lines)

    return edit


@pytest.mark.timeout(300)
def test_killing_the_teacher_mid_run_stops_the_job_and_leaves_nothing(
    tmp_path: Path, factory_dir: Path, request: pytest.FixtureRequest
) -> None:
    """The teacher service dies while the job trains (the stand-in train.py holds): the
    plan's watch sees its step end, fails the job at once (not when training would time out
    on it) and the teardown leaves no Ray, teacher or training process. Before that, a
    training node's first `ray start` fails (a transient join failure): the script starts
    it again, saying why, and the cluster forms."""
    require_slurm("linuxproc")
    flag = tmp_path / "refused-once"
    script, job = _submit_variant(tmp_path, factory_dir, request, _refused_once(flag))
    (tmp_path / "run/hold").write_text("")
    with slurm_cluster(tmp_path / "slurm", "linuxproc") as cluster:
        job_id = cluster.sbatch(script, _job_env())
        deadline = time.monotonic() + 200
        while not (tmp_path / "run/holding").exists():
            assert time.monotonic() < deadline and cluster.job_state(job_id) in (
                "PENDING",
                "RUNNING",
            ), cluster.job_state(job_id)
            time.sleep(1)
        teacher = cluster.processes_left([f"--port {job.teacher.port}"])
        assert teacher, "the teacher service is not running"
        for line in teacher:
            os.kill(int(line.split()[0]), 9)
        killed = time.monotonic()
        assert cluster.wait_job(job_id, timeout_s=90) == "FAILED"
        assert time.monotonic() - killed < 60  # the stand-in would hold 120 s
        log = next((tmp_path / "run/logs").glob("slurm-*.out")).read_text()
        assert flag.exists()  # the first join did fail
        logs = tmp_path / "run/logs"
        # why it ended (its log's last lines: srun adds its own, before or after), then
        # the restart
        ended = "daemon ray-worker-1 ended before the job started ("
        again = f"starting it again (1 of {RAY_JOIN_RESTARTS}; its log: {logs}/ray-worker-1.log.1)"
        said = f"{re.escape(ended)}[^\n]*join refused once[^\n]*\\); {re.escape(again)}"
        assert re.search(said, log), log[-3000:]
        assert "join refused once" in (logs / "ray-worker-1.log.1").read_text().splitlines()
        assert "daemon teacher-service ended while the job ran" in log, log[-3000:]
        # the Ray job stopped by its id before Ray: its driver (holding, not in Ray) would
        # outlive the head where the job supervisor dies before Slurm's sweep (linuxproc)
        assert f"teardown: stopping the Ray job opd-{job_id}" in log, log[-3000:]
        assert not (tmp_path / "run/standin-train.json").exists()
        assert cluster.wait_queue_empty(timeout_s=30) == []
        assert cluster.processes_left(LEFTOVERS) == []


@pytest.mark.timeout(600)
def test_no_cleanup_after_failed_jobs_and_a_relaunch_goes_on_from_the_newest_checkpoint(
    tmp_path: Path, factory_dir: Path, request: pytest.FixtureRequest
) -> None:
    """Under proctrack/cgroup, on one cluster with no cleanup in between:
    1. negative control: `ray start` without --block (the plan before that fix) returns at
       once, its step ends (the plan's watch stops the job there), Slurm kills what it
       started: nothing is submitted, nothing is left;
    2. the plan as written: a job that dies after its second checkpoint (the stand-in
       train.py saving as slime's loop does, tests/launch_standins.py);
    3. launched again with the same config: the batch script's relaunch step accepts it,
       training goes on after the newest checkpoint, both launches log to one W&B run, no
       more than logging.keep_checkpoints checkpoints are left (the pruner beside training,
       its last pass at each job's end), and the job's view of the cluster is right (the
       nodes and their resources, the teacher's key: `_check_the_run`);
    4. a launch with a changed setting stops at the relaunch step, naming it, before any
       daemon starts."""
    require_slurm("cgroup")
    changes = {
        "algorithm": {"steps": 8},
        "logging": {"wandb_mode": "offline", "save_every_steps": 2, "keep_checkpoints": 2},
    }
    unblocked, job = _submit_variant(
        tmp_path, factory_dir, request,
        lambda text: text.replace("ray start --block", "ray start"), changes=changes,
    )  # fmt: skip
    run, save = tmp_path / "run", tmp_path / "save"
    with slurm_cluster(tmp_path / "slurm", "cgroup") as cluster:
        state = cluster.wait_job(cluster.sbatch(unblocked, _job_env()), timeout_s=240)
        assert state == "FAILED"
        log = next(run.glob("logs/slurm-*.out"))
        # the plan's watch saw the head's step end (before: a wait for a cluster that never
        # forms, up to ray_wait_s)
        assert "daemon ray-head ended while the job ran" in log.read_text(), log.read_text()
        assert "a new run in" in log.read_text()
        assert not (run / "standin-train.json").exists()
        assert not (run / "standin-steps.jsonl").exists()
        assert cluster.wait_queue_empty(timeout_s=30) == []
        assert cluster.processes_left(LEFTOVERS) == []
        log.rename(log.with_suffix(".unblocked"))
        script = tmp_path / "job-fixed.sbatch"
        script.write_text(render_sbatch(job, script))
        (run / "checkpointing").write_text("")
        (run / "stop-after").write_text("2")
        assert cluster.wait_job(cluster.sbatch(script, _job_env()), timeout_s=300) == "FAILED"
        first = next(run.glob("logs/slurm-*.out")).read_text()
        # the failed launch recorded the run: this one goes on with it, from no checkpoint
        assert "a new run in" not in first and "training starts at step 0" in first, first
        assert "dying after checkpoint 3" in first, first[-3000:]
        (run / "stop-after").unlink()
        for log in run.glob("logs/slurm-*.out"):
            log.rename(log.with_suffix(".first"))
        again = tmp_path / "again.sbatch"
        again.write_text(render_sbatch(job, again))
        state = cluster.wait_job(cluster.sbatch(again, _job_env()), timeout_s=300)
        second = next(run.glob("logs/slurm-*.out")).read_text()
        assert state == "COMPLETED", second[-3000:]
        assert "slime resumes from the checkpoint after step 4" in second
        _check_the_run(tmp_path, cluster, state)
        steps = [
            json.loads(line) for line in (run / "standin-steps.jsonl").read_text().splitlines()
        ]
        assert [s["step"] for s in steps] == list(range(8))  # 0-3, then 4-7: none redone
        assert {(s["wandb_run_id"], s["wandb_resume"]) for s in steps} == {
            (wandb_run_id(job), "allow")
        }
        assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000005", "iter_0000007"]
        assert cluster.wait_queue_empty(timeout_s=30) == []
        assert cluster.processes_left(LEFTOVERS) == []
        for log in run.glob("logs/slurm-*.out"):
            log.rename(log.with_suffix(".second"))
        changed = job.model_copy(
            update={"algorithm": job.algorithm.model_copy(update={"lr": 5e-6})}
        )
        third = tmp_path / "changed.sbatch"
        third.write_text(render_sbatch(changed, third))
        assert cluster.wait_job(cluster.sbatch(third, _job_env()), timeout_s=120) == "FAILED"
        refused = next(run.glob("logs/slurm-*.out")).read_text()
        assert f"algorithm.lr: {job.algorithm.lr!r} -> 5e-06" in refused, refused[-3000:]
        assert "--allow-changed algorithm.lr" in refused
        assert len(steps) == len((run / "standin-steps.jsonl").read_text().splitlines())
        assert cluster.wait_queue_empty(timeout_s=30) == []
        assert cluster.processes_left(LEFTOVERS) == []
