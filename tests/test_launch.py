"""`opd launch`: the rendered plan (golden files), the checks a cluster job must pass,
and a launch against a local fake cluster (an ssh shim that runs every host's commands on
this machine, fake `ray` / `torchrun`, and the real `opd-teacher`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from launch.checks import check_tokenizers, local_tokenizer_identity
from launch.cli import app
from launch.config import ConfigError, config_from_dict, load_config
from launch.executor import Executor, LaunchError
from launch.plan import Hosts, build_plan, check_cluster, hosts_from_config, render_dry_run
from tests.live_server import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "launch/configs/swe-opd-cluster.yaml"
GOLDEN = ROOT / "tests/data/launch"
REGENERATE = (
    ".venv/bin/opd launch launch/configs/swe-opd-cluster.yaml --dry-run "
    "> tests/data/launch/swe-opd-cluster.dry-run.txt; and with --sbatch "
    "tests/data/launch/swe-opd-cluster.sbatch"
)


def test_dry_run_of_the_reference_config_is_the_golden_plan() -> None:
    result = CliRunner().invoke(app, ["launch", str(EXAMPLE), "--dry-run"])
    assert result.exit_code == 0, result.output
    golden = (GOLDEN / "swe-opd-cluster.dry-run.txt").read_text()
    assert result.output == golden, f"the plan changed; if intended, regenerate: {REGENERATE}"


def test_sbatch_of_the_reference_config_is_the_golden_script(tmp_path: Path) -> None:
    out = GOLDEN / "swe-opd-cluster.sbatch"
    script = tmp_path / "job.sbatch"
    result = CliRunner().invoke(app, ["launch", str(EXAMPLE), "--sbatch", str(script)])
    assert result.exit_code == 0, result.output
    # the golden file was written to /tmp/x.sbatch; only that comment line differs
    rendered = script.read_text().replace(str(script), "/tmp/x.sbatch")
    assert rendered == out.read_text(), f"the script changed; regenerate: {REGENERATE}"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0


def test_reference_plan_has_the_reference_layout() -> None:
    job = load_config(EXAMPLE)
    steps = build_plan(job, hosts_from_config(job))
    names = [s.name for s in steps]
    assert names.index("wait teacher") < names.index("ray head") < names.index("submit")
    submit = steps[-1].command
    for flag in (
        "--tensor-model-parallel-size 2",
        "--context-parallel-size 2",
        "--actor-num-nodes 4",
        "--actor-num-gpus-per-node 4",
        "--max-tokens-per-gpu 38912",
        "--rollout-max-response-len 12288",
        "--custom-generate-function-path slime_ext.slime.generate.generate",
        "--custom-loss-function-path slime_ext.slime.loss.loss",
        "--custom-reward-post-process-path slime_ext.slime.reward.post_process_rewards",
    ):
        assert flag in submit
    [write_job] = [s for s in steps if s.name == "write job config"]
    assert yaml.safe_load(write_job.content)["teacher"]["url"] == "http://teacher-node:8000"


def _cluster_job(**sections: Any) -> Any:
    base: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return config_from_dict(base)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"cluster": {"model_args_script": None}}, "cluster.model_args_script"),
        ({"cluster": {"megatron_checkpoint": None}}, "cluster.megatron_checkpoint"),
        ({"cluster": {"save_dir": None}}, "cluster.save_dir"),
        ({"cluster": {"tasks_file": None}}, "cluster.tasks_file"),
        ({"teacher": {"model": None}}, "teacher.model: the checkpoint"),
        ({"teacher": {"top_k": 8}, "algorithm": {"opd_loss": "topk_tail"}}, "use sampled"),
    ],
)
def test_cluster_checks_say_what_to_fix(sections: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_cluster(_cluster_job(**sections))


def test_missing_nodes_are_named() -> None:
    job = _cluster_job(cluster={"workers": ["a"]})
    with pytest.raises(ConfigError, match="3 more training node"):
        hosts_from_config(job)


def test_tokenizers_are_compared_by_content(factory_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(factory_dir, copy)
    same = local_tokenizer_identity(str(copy))
    original = local_tokenizer_identity(str(factory_dir))
    assert same is not None and original is not None and same != original  # names differ
    check_tokenizers(original, same)
    tokenizer_json = copy / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    token = next(iter(vocab))
    vocab[token + "x"] = vocab.pop(token)
    tokenizer_json.write_text(json.dumps(data))
    changed = local_tokenizer_identity(str(copy))
    with pytest.raises(ConfigError, match="differs from the student's"):
        check_tokenizers(original, changed)


def _fake_cluster(
    tmp_path: Path, factory_dir: Path, monkeypatch: pytest.MonkeyPatch, fail_on: str = ""
) -> tuple[Any, Path]:
    """Executables for the fake cluster, and a job that uses them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    trace = tmp_path / "trace.log"
    (bin_dir / "fake-ssh").write_text(
        '#!/bin/bash\nhost="$1"; shift\necho "HOST $host" >> "$TRACE"\nexec bash -c "$*"\n'
    )
    (bin_dir / "ray").write_text(
        '#!/bin/bash\necho "ray $*" >> "$TRACE"\n'
        'if [ -n "$FAIL_ON" ] && [[ "$*" == *"$FAIL_ON"* ]]; then\n'
        '  echo "ray: could not reach the head node" >&2; exit 3\nfi\n'
    )
    (bin_dir / "torchrun").write_text('#!/bin/bash\necho "torchrun $*" >> "$TRACE"\n')
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    slime = tmp_path / "slime/scripts/models"
    slime.mkdir(parents=True)
    (slime / "tiny.sh").write_text("MODEL_ARGS=(--num-layers 2 --hidden-size 64)\n")
    port = free_port()
    job = config_from_dict(
        {
            "model": {"student": str(factory_dir)},
            "parallel": {"num_nodes": 2, "gpus_per_node": 1, "max_tokens_per_gpu": 8192},
            "teacher": {
                "kind": "remote",
                "model": "factory:qwen3-tiny",
                "node": "127.0.0.1",
                "port": port,
                "url": f"http://127.0.0.1:{port}",
                "serve_args": ["--host", "127.0.0.1", "--device", "cpu", "--dtype", "float32"],
            },
            "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
            "cluster": {
                "executor": "ssh",
                "ssh_command": [str(bin_dir / "fake-ssh")],
                "remote_shell": ["bash", "-c"],
                "head": "node-0",
                "workers": ["node-1"],
                "sandbox_hosts": ["cpu-0"],
                "slime_dir": str(tmp_path / "slime"),
                "model_args_script": "scripts/models/tiny.sh",
                "megatron_checkpoint": str(tmp_path / "ckpt"),
                "save_dir": str(tmp_path / "save"),
                "tasks_file": str(tmp_path / "tasks.jsonl"),
            },
        }
    )
    os.environ["PATH"] = (
        f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}" + (os.environ["PATH"])
    )
    os.environ["TRACE"] = str(trace)
    os.environ["FAIL_ON"] = fail_on
    return job, trace


def _stop_teacher(port: int) -> None:
    found = subprocess.run(
        ["pgrep", "-f", f"opd-teacher serve .*--port {port}"], capture_output=True, text=True
    )
    for pid in found.stdout.split():
        os.kill(int(pid), signal.SIGTERM)


@pytest.mark.timeout(240)
def test_launch_runs_the_plan_in_order_on_a_fake_cluster(
    tmp_path: Path, factory_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, trace = _fake_cluster(tmp_path, factory_dir, monkeypatch)
    steps = build_plan(job, hosts_from_config(job))
    lines: list[str] = []
    try:
        Executor(job, report=lines.append, wait_timeout_s=180).run(steps)
    finally:
        _stop_teacher(job.teacher.port)
    log = trace.read_text().splitlines()
    hosts = [line.removeprefix("HOST ") for line in log if line.startswith("HOST ")]
    assert hosts == ["127.0.0.1", "node-0", "node-1", "cpu-0", "node-0", "node-0"]
    rays = [line for line in log if line.startswith("ray ")]
    assert rays[0].startswith("ray start --head --node-ip-address node-0")
    assert rays[1].startswith("ray start --address node-0:6379 --num-gpus 1")
    assert '"opd_sandbox_host": 1' in rays[2]
    assert rays[3].startswith("ray job submit --address http://127.0.0.1:8265 --no-wait")
    assert "train.py --num-layers 2 --hidden-size 64 --actor-num-nodes 2" in rays[3]
    assert any(line.startswith("torchrun --nproc-per-node 1") for line in log)  # converted
    assert (tmp_path / "run/job.yaml").is_file() and (tmp_path / "run/hooks.yaml").is_file()
    assert (tmp_path / "run/logs/teacher-service.log").is_file()
    assert any("check teacher tokenizer" in line for line in lines)


@pytest.mark.timeout(240)
def test_launch_stops_at_the_first_failing_step_and_says_so(
    tmp_path: Path, factory_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, trace = _fake_cluster(
        tmp_path, factory_dir, monkeypatch, fail_on="--address node-0:6379 --num-gpus 1"
    )
    job = job.model_copy(
        update={"teacher": job.teacher.model_copy(update={"node": None})}
    )  # a teacher started by someone else: here, none is running
    steps = build_plan(job, Hosts("node-0", ["node-1"], None, ["cpu-0"]))
    # no teacher answers: the wait fails first, and nothing after it runs
    with pytest.raises(LaunchError, match=r"step 3/\d+ 'wait teacher' on local failed"):
        Executor(job, report=lambda _: None, wait_timeout_s=2).run(steps)
    assert not trace.exists()
    # skip the teacher: the worker's ray start fails, the submit never runs
    steps = [s for s in steps if "teacher" not in s.name]
    with pytest.raises(LaunchError) as caught:
        Executor(job, report=lambda _: None).run(steps)
    message = str(caught.value)
    assert "'ray worker 1' on node-1 failed: exit code 3" in message
    assert "could not reach the head node" in message and "were not run" in message
    assert "job submit" not in trace.read_text()


def test_dry_run_names_every_host_and_command() -> None:
    job = load_config(EXAMPLE)
    text = render_dry_run(build_plan(job, hosts_from_config(job)), "/logs")
    assert text.count("# ") >= 15
    assert "@ teacher-node (background)" in text and "@ train-node-3 (run)" in text
