"""`opd launch CONFIG --rehearse` (launch/rehearsal*.py).

The whole rehearsal of the reference SWE config runs here for real (its plan through the
local executor on loopback nodes: the teacher service, the plan's checkpoint conversion,
Ray with two sandbox-host nodes, slime's train.py with the SGLang stand-in engine, mini-SWE
through the fleet, 2 rollouts): it ends 0 with every component up, the stage times and a
projection, and leaves no process. With the teacher's port taken it ends 1 naming the
teacher before anything starts. The report's parts are checked on the job output that
run logged (tests/data/rehearsal/job-output.txt) and on outcomes with a failed step.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from launch.plan import build_plan, is_ray_start
from launch.rehearsal import (
    RAY_PORTS_ENV,
    Rehearsal,
    RehearsalError,
    place_here,
    port_problems,
    prepare,
)
from launch.rehearsal_report import (
    DOWN,
    SANDBOXES,
    SKIPPED,
    UP,
    components,
    project,
    render,
    stages,
)
from launch.rehearsal_run import JobOutput, Outcome
from slime_ext.cpu_runtime import runtime_env_vars
from slime_ext.job.config import config_to_yaml, load_config
from tests import slime_job
from tests.launch_real_job import RAY_CPUS
from tests.launch_standins import LEFTOVERS, ray_node_args
from tests.live_server import free_port
from tests.ports import ray_port_block
from tests.slurm_cluster import _processes
from tests.ssh_nodes import SshNodes, require_ssh, ssh_nodes

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "launch/configs/swe-opd-cluster.yaml"
OUTPUT = (ROOT / "tests/data/rehearsal/job-output.txt").read_text()
COMPONENTS = (
    "teacher service (teacher-node)",
    "checkpoint conversion",
    "Ray head (train-node-0)",
    "sandbox host cpu-node-0",
    "sandbox host cpu-node-1",
    "rollout engines (generation)",
    "teacher scoring",
    SANDBOXES,
    "training",
    "weight sync",
    "checkpoint",
)
"""The reference config's components a rehearsal reports."""
KEY = "OPD_TEACHER_API_KEY"  # the reference config's teacher.api_key_env
RAY_TOKEN = Path.home() / ".ray/auth_token"
OCTET = "$(set -- $SSH_CONNECTION; echo ${3##*.})"
"""A node tells itself apart by its address: SSH_CONNECTION's third field."""


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> Rehearsal:
    return prepare(load_config(CONFIG), tmp_path_factory.mktemp("rehearsal"))


def _outcome(rehearsal: Rehearsal, failed_at: str | None = None, output: str = "") -> Outcome:
    steps = place_here(build_plan(rehearsal.job, rehearsal.hosts, wait_for_job=True), rehearsal)
    names = [s.name for s in steps]
    reached = names.index(failed_at) + 1 if failed_at else len(steps)
    error = f"step {reached}/{len(steps)} '{failed_at}' failed: exit code 1" if failed_at else None
    seconds = {name: 1.0 for name in names[: reached - (1 if failed_at else 0)]}
    return Outcome(steps, reached, error, step_seconds=seconds, job_output=output)


def test_the_rehearsal_job_keeps_the_users_nodes_ports_and_layout_choice(
    rehearsal: Rehearsal,
) -> None:
    job, user = rehearsal.job, rehearsal.user
    assert rehearsal.names == {
        "127.0.0.40": "train-node-0",
        "127.0.0.41": "teacher-node",
        "127.0.0.42": "cpu-node-0",
        "127.0.0.43": "cpu-node-1",
    }
    assert job.teacher.port == user.teacher.port == 8000
    assert job.teacher.serve_args[-2:] == ["--host", "127.0.0.41"]  # loopback only
    assert job.algorithm.recipe == "opd" and job.rollout.harness == "swe"
    # Qwen3.5 is a Gated DeltaNet hybrid: packed, as the user's job would train it
    assert job.algorithm.sequence_layout == "packed"
    assert job.algorithm.steps == 2 and job.logging.wandb_mode == "disabled"
    assert job.logging.run_dir != user.logging.run_dir
    assert job.sandbox.hosts == "ray" and rehearsal.hosts.sandbox == ["127.0.0.42", "127.0.0.43"]
    notes = "\n".join(rehearsal.notes)
    for said in ("nearest architecture", "TP 2 x CP 2", "sglang", "local sandboxes", "synthetic"):
        assert said in notes, (said, notes)
    tasks = Path(str(job.cluster.tasks_file)).read_text().splitlines()
    assert len(tasks) == 4 and all('"task"' in row for row in tasks)


def test_a_rehearsal_directory_is_reused_cleared_and_a_foreign_one_refused(
    rehearsal: Rehearsal, tmp_path: Path
) -> None:
    save = Path(str(rehearsal.job.cluster.save_dir))
    save.mkdir(parents=True, exist_ok=True)
    (save / "latest_checkpointed_iteration.txt").write_text("1")  # would be resumed from
    again = prepare(rehearsal.user, rehearsal.directory)
    assert not save.exists() and Path(again.job.model.student, "config.json").is_file()
    foreign = tmp_path / "a-real-run"
    (foreign / "save").mkdir(parents=True)
    with pytest.raises(RehearsalError, match="not empty and no rehearsal's"):
        prepare(rehearsal.user, foreign)
    assert (foreign / "save").is_dir()


def test_flags_that_need_cuda_are_left_out_here_and_said(tmp_path: Path) -> None:
    user = load_config(ROOT / "launch/configs/swe-opsd-35b-a3b.yaml")
    job = prepare(user, tmp_path / "rehearsal").job
    args = job.cluster.extra_train_args
    assert "--recompute-granularity" in user.cluster.extra_train_args
    for gone in ("--recompute-granularity", "full", "--use-precision-aware-optimizer"):
        assert gone not in args, args
    assert "--use-distributed-optimizer" in args  # what runs here stays
    notes = "\n".join(prepare(user, tmp_path / "rehearsal").notes)
    assert "--recompute-num-layers 1: left out here" in notes, notes
    assert "num_experts 256" in notes


def test_each_ray_node_gets_its_own_temp_dir_and_ports_and_sandbox_hosts_no_cpu(
    rehearsal: Rehearsal,
) -> None:
    steps = _outcome(rehearsal).steps
    starts = [s for s in steps if is_ray_start(s.command)]
    assert [s.host for s in starts] == ["127.0.0.40", "127.0.0.42", "127.0.0.43"]
    temps = [re.search(r"--temp-dir=(\S+)", s.command).group(1) for s in starts]  # type: ignore[union-attr]
    ports = [re.search(r"--node-manager-port=(\d+)", s.command).group(1) for s in starts]  # type: ignore[union-attr]
    assert len(set(temps)) == len(set(ports)) == 3
    head, *sandbox = starts
    assert "--num-cpus=12" in head.command
    assert all(s.command.count("--num-cpus") == 1 and "--num-cpus 0" in s.command for s in sandbox)


def test_a_taken_teacher_port_is_found_before_anything_starts(rehearsal: Rehearsal) -> None:
    assert port_problems(rehearsal) == []
    with socket.socket() as holder:
        holder.bind(("127.0.0.41", 8000))
        holder.listen()
        (problem,) = port_problems(rehearsal)
    assert problem[0] == "teacher"
    assert "port 8000 on teacher-node (here 127.0.0.41) is taken" in problem[1]


def test_the_job_output_gives_every_component_and_stage(rehearsal: Rehearsal) -> None:
    parsed = JobOutput.parse(OUTPUT)
    assert sorted(parsed.rollout) == sorted(parsed.perf) == sorted(parsed.train) == [0, 1]
    saved = Path(str(rehearsal.job.cluster.save_dir))
    saved.mkdir(parents=True, exist_ok=True)
    (saved / "latest_checkpointed_iteration.txt").write_text("1")
    try:
        listed = components(rehearsal, _outcome(rehearsal, output=OUTPUT))
    finally:
        (saved / "latest_checkpointed_iteration.txt").unlink()
    assert [c.state for c in listed] == [UP] * len(listed), listed
    names = [c.name for c in listed]
    assert names[:2] == ["run directory", "shared paths"]
    assert set(COMPONENTS) <= set(names), names
    measured = {s.name: s.seconds for s in stages(_outcome(rehearsal, output=OUTPUT))}
    assert measured["training"] == pytest.approx(parsed.perf[1]["perf/train_time"])
    assert measured["generation"] == pytest.approx(
        parsed.rollout[1]["perf/model_time_per_turn"] * parsed.rollout[1]["rollout/turns"]
    )


def test_no_checkpoint_saved_is_the_checkpoint_down(rehearsal: Rehearsal) -> None:
    listed = {c.name: c for c in components(rehearsal, _outcome(rehearsal, output=OUTPUT))}
    assert listed["checkpoint"].state == DOWN and listed["training"].state == UP


def test_failed_hints_are_their_component_down(rehearsal: Rehearsal) -> None:
    """OPSD's hint counts are the run's so far: 2 failed by the last rollout."""
    output = OUTPUT.replace(
        "'rollout/drift_turns'", "'rollout/hint_errors': 2.0, 'rollout/drift_turns'"
    )
    listed = {c.name: c for c in components(rehearsal, _outcome(rehearsal, output=output))}
    hints = listed["hints (teacher.hint reference)"]
    assert hints.state == DOWN and hints.why == "2 hint requests failed", hints
    assert listed["training"].state == UP


def test_a_node_started_again_before_the_job_is_up_and_one_lost_is_down(
    rehearsal: Rehearsal,
) -> None:
    """A sandbox host whose `ray start` timed out twice (a loaded node) and then joined is
    up, saying so; one that ended while the job ran is down."""
    outcome = _outcome(rehearsal, output=OUTPUT)
    timed_out = "Exception: The current node timed out during startup."
    outcome.restarted["sandbox host 1"] = [timed_out, timed_out]
    listed = {c.name: c for c in components(rehearsal, outcome)}
    host = listed["sandbox host cpu-node-1"]
    assert host.state == UP, host
    assert host.why.endswith(f"; started again 2 times (it had ended: {timed_out})"), host
    assert "started again" not in listed["sandbox host cpu-node-0"].why
    outcome.lost["sandbox host 1"] = "the daemon 'sandbox host 1' ended"
    listed = {c.name: c for c in components(rehearsal, outcome)}
    assert listed["sandbox host cpu-node-1"].state == DOWN


def test_a_failed_step_is_its_component_down_and_the_later_ones_not_reached(
    rehearsal: Rehearsal,
) -> None:
    listed = components(rehearsal, _outcome(rehearsal, failed_at="sandbox host 1"))
    states = {c.name: c.state for c in listed}
    assert states["sandbox host cpu-node-1"] == DOWN
    assert states["sandbox host cpu-node-0"] == UP
    assert states["Ray cluster (every node joined)"] == SKIPPED
    assert states["rollout engines (generation)"] == SKIPPED
    text, ok = render(rehearsal, _outcome(rehearsal, failed_at="sandbox host 1"))
    assert not ok and re.search(r"sandbox host cpu-node-1 +down: step", text), text


def test_the_projection_scales_each_measured_rate_by_the_full_step(rehearsal: Rehearsal) -> None:
    projection = project(rehearsal, _outcome(rehearsal, output=OUTPUT))
    text = "\n".join(projection.lines)
    assert "32 trajectories" in text and "9B parameters (9B, from its name)" in text
    parsed = JobOutput.parse(OUTPUT)
    weight_sync = re.search(r"weight sync: ([\d,]+) s", text)
    assert weight_sync is not None
    student = 9e9 / _params(rehearsal.job.model.student)
    expected = parsed.perf[1]["perf/update_weights_time"] * student
    assert float(weight_sync.group(1).replace(",", "")) == pytest.approx(expected, abs=1)
    assert projection.seconds is not None
    terms = re.findall(r"^\w[\w ]+: ([\d,]+) s", text, flags=re.M)
    assert projection.seconds == pytest.approx(sum(float(t.replace(",", "")) for t in terms), 1e-3)


def _params(path: str) -> float:
    from launch.rehearsal_report import parameters

    count = parameters(path)
    assert count
    return float(count)


def _rehearse(directory: Path, marker: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OPD_REHEARSAL_TEST": marker, "WANDB_MODE": "disabled"}
    env[RAY_PORTS_ENV] = str(ray_port_block())  # apart from other test processes' clusters
    env.pop("OPD_TEACHER_API_KEY", None)
    return subprocess.run(
        [str(Path(sys.executable).parent / "opd"), "launch", str(CONFIG), "--rehearse",
         "--rehearse-dir", str(directory)],
        capture_output=True, text=True, env=env, timeout=timeout_s, check=False,
    )  # fmt: skip


def _left(marker: str, within_s: float = 30) -> list[str]:
    """The rehearsal's processes still alive (Ray's take a moment after `ray start --block`
    is stopped)."""
    deadline = time.monotonic() + within_s
    while True:
        left = [
            f"{pid} {command}"
            for pid, command in _processes(f"OPD_REHEARSAL_TEST={marker}".encode())
            if any(pattern in command for pattern in LEFTOVERS)
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_reference_config_rehearses_whole_here_and_leaves_nothing(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    done = _rehearse(tmp_path / "rehearsal", marker, timeout_s=540)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "every component worked" in output
    report = output[output.index("components:") :]
    for component in COMPONENTS:
        assert re.search(rf"{re.escape(component)} +up", report), (component, report)
    for stage in ("generation", "teacher scoring", "sandbox commands", "training", "weight sync"):
        assert re.search(rf"^  {stage} +\d+\.\d+ s", report, flags=re.M), (stage, report)
    assert re.search(r"projected step time: [\d,]+ s", report), report
    assert _left(marker) == []


@pytest.mark.timeout(120)
def test_a_taken_teacher_port_ends_the_rehearsal_naming_the_teacher(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    with socket.socket() as holder:
        holder.bind(("127.0.0.41", 8000))
        holder.listen()
        done = _rehearse(tmp_path / "rehearsal", marker, timeout_s=110)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-4000:]
    assert re.search(r"teacher +down: port 8000 on teacher-node", output), output[-4000:]
    assert "rehearsal failed" in output
    assert not (tmp_path / "rehearsal/run/logs").exists()  # nothing was started
    assert _left(marker, within_s=0) == []


def _on_nodes(directory: Path, nodes: SshNodes, sandbox: list[str], ray_temp: Path) -> Path:
    """The reference config on ssh nodes of this host (tests/ssh_nodes.py): the head, the
    teacher's node and `sandbox`, the job's environment carrying the CPU runtime as a
    GPU-less user's would (tests/launch_real_job.py); its config file."""
    head, teacher = nodes.addresses[:2]
    slime = slime_job.slime_dir()
    megatron = Path(__import__("megatron.training").training.__file__).parents[2]
    overrides = [
        f"cluster.head={head}",
        "cluster.workers=[]",
        f"cluster.sandbox_hosts=[{','.join(sandbox)}]",
        f"teacher.node={teacher}",
        f"teacher.port={free_port()}",
        "teacher.backend=hf",
        "teacher.serve_args=[--device, cpu, --dtype, float32]",
        "parallel.num_nodes=1",
        "parallel.dp=1",
        f"logging.run_dir={directory / 'run'}",
        f"cluster.slime_dir={slime}",
        f"cluster.megatron_dir={megatron}",
        f"cluster.ray_port={free_port()}",
        f"cluster.dashboard_port={free_port()}",
        "cluster.ray_wait_s=180",
    ]
    job = load_config(CONFIG, overrides)
    sent = [KEY] + (["RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"] if RAY_TOKEN.exists() else [])
    venv = Path(sys.executable).parent
    env = runtime_env_vars(str(slime))
    env["PYTHONPATH"] += f":{megatron}"
    cluster = job.cluster.model_copy(
        update={
            "ssh_command": [*nodes.ssh_command, "-o", f"SendEnv={' '.join(sent)}"],
            # a node's login shell knows nothing of this venv (test_launch_ssh.py)
            "remote_shell": [
                "env",
                f"PATH={venv}:/usr/local/bin:/usr/bin:/bin",
                f"PYTHONPATH={ROOT}",
                "bash",
                "--norc",
                "--noprofile",
                "-c",
            ],
            "env": env | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
            "ray_start_args": ray_node_args(ray_temp, OCTET, OCTET, RAY_CPUS),
        }
    )
    path = directory / "job.yaml"
    path.write_text(config_to_yaml(job.model_copy(update={"cluster": cluster})))
    return path


def _rehearse_on_nodes(config: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, KEY: "k-" + uuid.uuid4().hex, "PYTHONPATH": str(ROOT)}
    if RAY_TOKEN.exists():
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(RAY_TOKEN)}
    return subprocess.run(
        [str(Path(sys.executable).parent / "opd"), "launch", str(config), "--rehearse",
         "--rehearse-on", "nodes"],
        capture_output=True, text=True, env=env, timeout=timeout_s, check=False,
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_on_the_nodes_an_unreachable_sandbox_host_is_named_before_anything_starts(
    tmp_path: Path,
) -> None:
    require_ssh()
    with ssh_nodes(tmp_path / "ssh", count=3) as nodes:
        head, teacher, first = nodes.addresses
        dead = f"{head.rsplit('.', 1)[0]}.250"  # this sshd does not answer there
        config = _on_nodes(tmp_path, nodes, [first, dead], tmp_path / "ray")
        done = _rehearse_on_nodes(config, timeout_s=110)
        output = done.stdout + done.stderr
        assert done.returncode == 1, output[-4000:]
        assert re.search(rf"sandbox host {re.escape(dead)} +down: unreachable", output), output
        for node in (f"training node {head} (the head)", f"teacher node {teacher}"):
            assert re.search(rf"{re.escape(node)} +up: reachable", output), output
        assert "everything else" in output and "not reached" in output
        assert not (tmp_path / "run/rehearsal/run/logs").exists()  # nothing was started
        assert _ssh_left(nodes) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not os.environ.get("OPD_HEAVY_TESTS"),
    reason="set OPD_HEAVY_TESTS=1: the whole rehearsal over ssh (about 110 s); CI runs the "
    "whole launch over ssh in tests/test_launch_ssh.py and the whole rehearsal here above",
)
def test_on_the_nodes_the_job_rehearses_whole_over_ssh(tmp_path: Path) -> None:
    require_ssh()
    ray_temp = Path(tempfile.mkdtemp(prefix="opd-ray-"))
    try:
        with ssh_nodes(tmp_path / "ssh", count=4) as nodes:
            _, teacher, first, second = nodes.addresses
            config = _on_nodes(tmp_path, nodes, [first, second], ray_temp)
            done = _rehearse_on_nodes(config, timeout_s=480)
            output = done.stdout + done.stderr
            assert done.returncode == 0, output[-6000:]
            report = output[output.index("components:") :]
            for component in (f"teacher service ({teacher})", f"sandbox host {second}",
                              "checkpoint conversion", "teacher scoring", SANDBOXES,
                              "training", "weight sync", "checkpoint"):  # fmt: skip
                assert re.search(rf"{re.escape(component)} +up", report), (component, report)
            assert _ssh_left(nodes) == []
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)


def _ssh_left(nodes: SshNodes) -> list[str]:
    deadline = time.monotonic() + 30
    while (left := nodes.leftovers(LEFTOVERS)) and time.monotonic() < deadline:
        time.sleep(1)
    return left
