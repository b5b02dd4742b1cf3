"""`opd launch` with the ssh executor over REAL ssh: four "nodes", each a loopback address
of this host behind one sshd (tests/ssh_nodes.py), run the plan as a user's cluster would.

Real: ssh (key auth, the teacher's key and Ray's token sent by name with SendEnv), the
`opd launch` command, Ray (`ray start --block` per node on its own address), `opd-teacher
serve` (a factory model on CPU, with an API key), `launch.wait_ray`, `ray job submit`
followed to its end, and in the run that completes slime's own train.py
(tests/launch_real_job.py: OPD on the TIR task for 2 rollouts, the tiny student on one
fake GPU with the SGLang stand-in engine colocated, under the CPU runtime the job's
environment carries). The first run, killed mid-training, has a stand-in train.py
(tests/launch_standins.py) that holds until it is killed.

Checked: killing the teacher while the job trains fails the launch within the watch
interval and its teardown leaves nothing (the head's Ray stops without draining); the
relaunch on the same nodes and ports, with no cleanup in between, runs slime's train.py
to its end and the launch returns 0: every rollout was scored by the teacher (with the
key Ray expanded from the node's environment: without it every score is refused and the
job stops) and trained on, the last rollout's checkpoint is saved, the teacher's URL is
its node's, the key's value is in no file the launch wrote, and nothing any session
started is left (Ray, its workers and actors, the engines, the router, the teacher).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from slime_ext.job.config import config_from_dict, config_to_yaml
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
from tests.ssh_nodes import SshNodes, require_ssh, ssh_nodes
from tests.test_slime_train import Student

ROOT = Path(__file__).resolve().parent.parent
RAY_TOKEN = Path.home() / ".ray/auth_token"
OCTET = "$(set -- $SSH_CONNECTION; echo ${3##*.})"
"""A node tells itself apart by its address: SSH_CONNECTION's third field."""


def _settings(directory: Path, factory_dir: Path, nodes: SshNodes, ray_temp: Path) -> Any:
    """The stand-in job's config on two training nodes."""
    head, worker, teacher, sandbox = nodes.addresses
    tasks = directory / "tasks.jsonl"
    standin_tasks(tasks)
    sent = [KEY_NAME] + (["RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"] if RAY_TOKEN.exists() else [])
    venv = Path(sys.executable).parent
    # a node's login shell knows nothing of this venv: the user's equivalent of activating
    # it in ~/.bashrc, without reading this machine's ~/.bashrc
    path = f"PATH={venv}:/usr/local/bin:/usr/bin:/bin"
    shell = ["env", path, f"PYTHONPATH={ROOT}", "bash", "--norc", "--noprofile", "-c"]
    return {
        "model": {"student": str(factory_dir)},
        "parallel": {"num_nodes": 2, "gpus_per_node": 4, "max_tokens_per_gpu": 8192},
        "teacher": {
            "kind": "remote",
            "backend": "hf",
            "model": str(factory_dir),
            "node": teacher,
            "port": free_port(),
            "api_key_env": KEY_NAME,
            "serve_args": ["--device", "cpu", "--dtype", "float32"],
        },
        "logging": {"run_dir": str(directory / "run"), "wandb_mode": "disabled"},
        "cluster": {
            "executor": "ssh",
            "head": head,
            "workers": [worker],
            "sandbox_hosts": [sandbox],
            # secrets by name: the nodes' sshd accepts OPD_* and RAY_* (AcceptEnv)
            "ssh_command": [*nodes.ssh_command, "-o", f"SendEnv={' '.join(sent)}"],
            # a node's login shell knows nothing of this venv: the user's equivalent of
            # activating it in ~/.bashrc, without reading this machine's ~/.bashrc
            "remote_shell": shell,
            "slime_dir": str(standin_slime(directory)),
            "megatron_dir": str(directory),
            "model_args_script": "scripts/models/tiny.sh",
            "megatron_checkpoint": str(directory / "ckpt"),
            "save_dir": str(directory / "save"),
            "tasks_file": str(tasks),
            "ray_port": free_port(),
            "dashboard_port": free_port(),
            "ray_start_args": ray_node_args(ray_temp, OCTET, OCTET),
            "ray_wait_s": 180,
        },
    }


def _real(settings: dict[str, Any], directory: Path, student: Student, ray_temp: Path) -> Any:
    """The same job (its nodes, ports, teacher) with slime's real train.py training
    `student` on the head alone (tests/launch_real_job.py)."""
    real = merged(settings, real_train_settings(directory, student))
    real["cluster"]["workers"] = []
    real["cluster"]["ray_start_args"] = ray_node_args(ray_temp, OCTET, OCTET, RAY_CPUS)
    return config_from_dict(real)


def _launch(config: Path, **popen: Any) -> subprocess.Popen[str]:
    env = {**os.environ, KEY_NAME: KEY_VALUE, "PYTHONPATH": str(ROOT)}
    if RAY_TOKEN.exists():
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(RAY_TOKEN)}
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "opd"), "launch", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        **popen,
    )


@pytest.fixture(scope="module")
def student(unpadded_student: Student) -> Student:
    require_ssh()
    return unpadded_student


@pytest.mark.timeout(900)
def test_the_ssh_launch_follows_the_job_survives_a_killed_teacher_and_leaves_nothing(
    tmp_path: Path, factory_dir: Path, student: Student
) -> None:
    require_ssh()
    ray_temp = Path(tempfile.mkdtemp(prefix="opd-ray-"))
    try:
        with ssh_nodes(tmp_path / "ssh", count=4) as nodes:
            settings = _settings(tmp_path, factory_dir, nodes, ray_temp)
            job = config_from_dict(settings)
            config = tmp_path / "job.yaml"
            config.write_text(config_to_yaml(job))
            run = tmp_path / "run"
            run.mkdir()

            # 1. the teacher dies while the job trains: the launch fails and tears down
            (run / "hold").write_text("")
            launch = _launch(config)
            # on a loaded machine a node's Ray may take a minute and a restart to join
            deadline = time.monotonic() + 360
            while not (run / "holding").exists():
                assert launch.poll() is None, launch.communicate()[0][-4000:]
                assert time.monotonic() < deadline, "the stand-in never started training"
                time.sleep(1)
            teacher = nodes.leftovers([f"--port {job.teacher.port}"])
            assert teacher, "the teacher service is not running"
            for line in teacher:
                os.kill(int(line.split()[0]), 9)
            killed = time.monotonic()
            output, _ = launch.communicate(timeout=120)
            assert launch.returncode == 1, output[-4000:]
            assert time.monotonic() - killed < 90, output[-4000:]  # the stand-in holds 120 s
            assert "the daemon 'teacher service'" in output and "ended" in output, output
            assert "were stopped" in output, output[-4000:]
            assert not (run / "standin-train.json").exists()
            assert _left(nodes) == []
            # the head, its job still running, stopped at once (plan.RAY_START): no 30 s drain
            assert "Draining for up to" not in (run / "logs/ray-head.log").read_text()

            # 2. on the same nodes and ports, no cleanup, another run (its own run
            # directory: the same one would refuse its other settings) with slime's real
            # train.py: the whole job, followed to its end
            real = _real(settings, tmp_path / "real", student, ray_temp)
            real = real.model_copy(
                update={
                    "logging": real.logging.model_copy(update={"run_dir": tmp_path / "run-real"})
                }
            )
            config.write_text(config_to_yaml(real))
            launch = _launch(config)
            output, _ = launch.communicate(timeout=420)
            assert launch.returncode == 0, output[-6000:]
            assert "the job ended" in output, output[-4000:]
            run = tmp_path / "run-real"
            assert "a new run in" in (run / "logs/check-relaunch.log").read_text()
            assert_trained(run / "logs/submit.log", tmp_path / "real")
            teacher_url = yaml.safe_load((run / "job.yaml").read_text())["teacher"]["url"]
            assert teacher_url.startswith(f"http://{nodes.addresses[2]}:"), teacher_url
            for path in [*run.rglob("*"), *(tmp_path / "run").rglob("*")]:
                if path.is_file():
                    assert KEY_VALUE not in path.read_text(errors="replace"), path
            assert _left(nodes) == []
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)


def _left(nodes: SshNodes) -> list[str]:
    """What the sessions left of Ray, the teacher and the stand-ins (Ray's processes take a
    moment to exit after `ray start --block` is stopped)."""
    deadline = time.monotonic() + 30
    while (left := nodes.leftovers(LEFTOVERS)) and time.monotonic() < deadline:
        time.sleep(1)
    return left
