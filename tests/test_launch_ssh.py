"""`opd launch` with the ssh executor over REAL ssh: four "nodes", each a loopback address
of this host behind one sshd (tests/ssh_nodes.py), run the plan as a user's cluster would.

Real: ssh (key auth, the teacher's key and Ray's token sent by name with SendEnv), the
`opd launch` command, Ray (`ray start --block` per node on its own address), `opd-teacher
serve` (a factory model on CPU, with an API key), `launch.wait_ray`, `ray job submit`
followed to its end. Stand-ins, through the config: slime's checkout
(tests/launch_standins.py).

Checked: the launch follows the job and returns 0; Ray had the training nodes (with GPUs)
and the sandbox host (its resource, no GPUs); the teacher answered 200 with the key from a
Ray task on a training node and 401 without; the key's value is in no file the launch
wrote; nothing any session started is left. Killing the teacher while the job trains
fails the launch within the watch interval and its teardown leaves nothing; the relaunch
that follows, with no cleanup in between, runs the whole job.
"""

from __future__ import annotations

import json
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
from tests.launch_standins import KEY_NAME, KEY_VALUE, LEFTOVERS, ray_node_args, standin_slime
from tests.live_server import free_port
from tests.ssh_nodes import SshNodes, require_ssh, ssh_nodes

ROOT = Path(__file__).resolve().parent.parent
RAY_TOKEN = Path.home() / ".ray/auth_token"


def _job(directory: Path, factory_dir: Path, nodes: SshNodes, ray_temp: Path) -> Any:
    head, worker, teacher, sandbox = nodes.addresses
    tasks = directory / "tasks.jsonl"
    tasks.write_text("")
    sent = [KEY_NAME] + (["RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"] if RAY_TOKEN.exists() else [])
    venv = Path(sys.executable).parent
    octet = "$(set -- $SSH_CONNECTION; echo ${3##*.})"
    # a node's login shell knows nothing of this venv: the user's equivalent of activating
    # it in ~/.bashrc, without reading this machine's ~/.bashrc
    path = f"PATH={venv}:/usr/local/bin:/usr/bin:/bin"
    shell = ["env", path, f"PYTHONPATH={ROOT}", "bash", "--norc", "--noprofile", "-c"]
    return config_from_dict(
        {
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
                # a node tells itself apart by its address: SSH_CONNECTION's third field
                "ray_start_args": ray_node_args(ray_temp, octet, octet),
                "ray_wait_s": 180,
            },
        }
    )


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


@pytest.mark.timeout(600)
def test_the_ssh_launch_follows_the_job_survives_a_killed_teacher_and_leaves_nothing(
    tmp_path: Path, factory_dir: Path
) -> None:
    require_ssh()
    ray_temp = Path(tempfile.mkdtemp(prefix="opd-ray-"))
    try:
        with ssh_nodes(tmp_path / "ssh", count=4) as nodes:
            job = _job(tmp_path, factory_dir, nodes, ray_temp)
            config = tmp_path / "job.yaml"
            config.write_text(config_to_yaml(job))
            run = tmp_path / "run"
            run.mkdir()

            # 1. the teacher dies while the job trains: the launch fails and tears down
            (run / "hold").write_text("")
            launch = _launch(config)
            deadline = time.monotonic() + 240
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

            # 2. relaunched as is, no cleanup: the whole job, followed to its end
            (run / "hold").unlink()
            (run / "holding").unlink()
            launch = _launch(config)
            output, _ = launch.communicate(timeout=300)
            assert launch.returncode == 0, output[-6000:]
            assert "the job ended" in output, output[-4000:]
            _check_the_run(run, nodes)
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)


def _left(nodes: SshNodes) -> list[str]:
    """What the sessions left of Ray, the teacher and the stand-ins (Ray's processes take a
    moment to exit after `ray start --block` is stopped)."""
    deadline = time.monotonic() + 30
    while (left := nodes.leftovers(LEFTOVERS)) and time.monotonic() < deadline:
        time.sleep(1)
    return left


def _check_the_run(run: Path, nodes: SshNodes) -> None:
    report = json.loads((run / "standin-train.json").read_text())
    head, worker, _, sandbox = nodes.addresses
    by_ip = {n["ip"]: n["resources"] for n in report["nodes"]}
    assert set(by_ip) == {head, worker, sandbox}, report["nodes"]
    assert by_ip[head].get("GPU") == 4 and by_ip[worker].get("GPU") == 4
    assert "opd_sandbox_host" in by_ip[sandbox] and by_ip[sandbox].get("GPU", 0) == 0
    training = report["training"]
    assert training["key_set"] and not training["key_unexpanded"], training
    assert (training["with_key"], training["without_key"]) == (200, 401), training
    assert training["ip"] in (head, worker) and report["sandbox"]["ip"] == sandbox
    for path in run.rglob("*"):
        if path.is_file():
            assert KEY_VALUE not in path.read_text(errors="replace"), path
    assert yaml.safe_load((run / "job.yaml").read_text())["teacher"]["url"].startswith(
        f"http://{nodes.addresses[2]}:"
    )
    assert _left(nodes) == []
