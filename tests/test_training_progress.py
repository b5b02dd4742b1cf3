"""What a local training run prints when its output is a pipe or a log file (no terminal):
a line per step, per checkpoint and per periodic evaluation, and the evaluation's metrics
in metrics.jsonl at the step it followed."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from slime_ext.local.progress import step_fields

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TINY = {
    "model": {"student": "factory:qwen3-tiny", "seed": 0},
    "rollout": {
        "max_turns": 2,
        "max_new_tokens": 12,
        "tasks_per_step": 2,
        "samples_per_task": 2,
        "concurrency": 4,
    },
}
STEP_LINE = re.compile(
    r"step (\d+)/3  loss (\S+)  reverse_kl (\S+)  reward (\S+)  (?:lr \S+  )?tokens/s \d+  "
    r"elapsed \d+\S*  eta \d+\S*"
)
EVAL_LINE = re.compile(
    r"eval after step (\d+)/3: held-out accuracy ([\d.]+)% \[([\d.]+)%, ([\d.]+)%\] "
    r"\(n=(\d+), \d+ s\)"
)


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_opd_train_into_a_pipe_prints_steps_checkpoints_and_evaluations(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = {
        **TINY,
        "teacher": {"kind": "embedded", "model": "factory:qwen3-tiny"},
        "algorithm": {"recipe": "opd", "steps": 3, "lr": 1e-3},
        "logging": {
            "run_dir": str(run_dir),
            "wandb_mode": "disabled",
            "save_every_steps": 2,
            "eval_every_steps": 2,
            "eval_problems": 4,
        },
    }
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", str(config_path)],
        env={**os.environ, "WANDB_MODE": "disabled"},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert not re.search(r"\x1b|\r", done.stdout + done.stderr)  # plain lines, no live display
    steps = [(i, STEP_LINE.fullmatch(line)) for i, line in enumerate(lines)]
    steps = [(i, match) for i, match in steps if match]
    assert [int(match[1]) for _, match in steps] == [1, 2, 3]
    metrics = _metrics(run_dir)
    for (_, match), row in zip(steps, metrics, strict=True):
        assert float(match[2]) == pytest.approx(row["train/loss"], rel=1e-3, abs=1e-4)
        assert float(match[3]) == pytest.approx(row["rollout/opd_reverse_kl"], abs=1e-4)
        assert float(match[4]) == pytest.approx(row["rollout/reward"], abs=1e-3)
    checkpoints = run_dir / "checkpoints"
    assert [line for line in lines if line.startswith("checkpoint")] == [
        f"checkpoint written: {checkpoints / 'step_00002'} (step 2/3)",
        f"checkpoint written: {checkpoints / 'step_00003'} (step 3/3)",
    ]
    evals = [(i, EVAL_LINE.fullmatch(line)) for i, line in enumerate(lines)]
    [(at, match)] = [(i, match) for i, match in evals if match]
    assert steps[1][0] < at < steps[2][0]  # after step 2, before step 3
    assert match[1] == "2" and match[5] == "4"
    # logged with the step it followed (metrics.jsonl counts steps from 0), nowhere else
    assert [row["step"] for row in metrics if "eval/heldout_accuracy" in row] == [1]
    row = metrics[1]
    assert row["eval/heldout_problems"] == 4
    assert float(match[2]) == pytest.approx(100 * row["eval/heldout_accuracy"], abs=0.05)
    low, high = row["eval/heldout_accuracy_ci95_low"], row["eval/heldout_accuracy_ci95_high"]
    assert low <= row["eval/heldout_accuracy"] <= high and high > low
    assert (float(match[3]), float(match[4])) == pytest.approx((100 * low, 100 * high), abs=0.05)


@pytest.mark.timeout(300)
def test_eval_every_without_a_held_out_set_says_so_and_trains_on(
    tmp_path: Path, factory_dir: Path
) -> None:
    from rollout.tasks.arithmetic import make_tasks
    from slime_ext.job.config import config_from_dict
    from slime_ext.local.loop import LocalRun

    run_dir = tmp_path / "run"
    job = config_from_dict(
        {
            **TINY,
            "algorithm": {"recipe": "rl", "steps": 2, "lr": 1e-3},
            "logging": {"run_dir": str(run_dir), "wandb_mode": "disabled", "eval_every_steps": 1},
        }
    )
    output = StringIO()
    run = LocalRun(job, factory_dir, run_dir, Console(file=output, force_terminal=False))
    history = asyncio.run(run.train(make_tasks(40, "train"), None))
    lines = output.getvalue().splitlines()
    assert any("no held-out set was given, so no periodic evaluation" in line for line in lines)
    assert not any(line.startswith("eval after") for line in lines)
    assert not any("eval/heldout_accuracy" in row for row in _metrics(run_dir))
    step_lines = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == ["1/2", "2/2"]
    for line, metrics in zip(step_lines, history, strict=True):
        assert f"reward {metrics['rollout/reward']:.3f}" in line  # rl's signal
        assert "reverse_kl" not in line


@pytest.mark.parametrize(
    ("recipe", "signal"),
    [
        ("opd", "reverse_kl 0.2500"),
        ("opsd", "reverse_kl 0.2500"),
        ("oprd", "reverse_kl 0.2500"),
        ("rl", "reward 0.750"),
        ("sft", "loss 0.5"),
    ],
)
def test_each_recipe_shows_its_signal(recipe: str, signal: str) -> None:
    metrics = {
        "train/loss": 0.5,
        "train/trajectories_trained": 4.0,
        "train/loss_tokens": 300.0,
        "perf/step_time": 2.0,
        "rollout/opd_reverse_kl": 0.25,
        "rollout/reward": 0.75,
        "train/lr": 3e-4,
    }
    fields = step_fields(recipe, metrics)
    assert fields[0] == "loss 0.5" and signal in fields
    assert "tokens/s 150" in fields and "lr 3.00e-04" in fields
    assert ("reverse_kl 0.2500" in fields) == (recipe not in ("rl", "sft"))


def test_a_step_that_trained_nothing_says_so() -> None:
    fields = step_fields("sft", {"train/trajectories_trained": 0.0, "rollout/reward": 0.0})
    assert fields[0] == "loss - (nothing trained)"


@pytest.mark.timeout(300)
def test_a_run_whose_sandboxes_cannot_start_stops_at_its_first_step(
    tmp_path: Path, factory_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No python tool starts (the fault injected where the worker starts): every rollout
    ends in sandbox_error. Before, the run went on training nothing, saving checkpoints,
    and exited 0 (bench/baselines.py met it as a worker launched through `..`)."""
    from typer.testing import CliRunner

    from launch.cli import app
    from sandbox.base import SandboxStartError
    from sandbox.python_worker import PythonWorker

    async def cannot_start(self: PythonWorker) -> None:
        raise SandboxStartError("the python worker exited while starting (exit code 127)")

    monkeypatch.setattr(PythonWorker, "start", cannot_start)
    run_dir = tmp_path / "run"
    config = {
        **TINY,
        "model": {"student": str(factory_dir), "seed": 0},
        "algorithm": {"recipe": "rl", "steps": 3, "lr": 1e-3},
        "logging": {"run_dir": str(run_dir), "wandb_mode": "disabled", "save_every_steps": 1},
    }
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["train", str(config_path)])
    assert result.exit_code == 1, result.output
    output = " ".join(result.output.split())
    trajectories = run_dir / "trajectories" / "step_00000.jsonl"
    assert "step 1: all 4 rollouts failed (sandbox_error: " in output, output
    assert "exit code 127" in output and f"(trajectories: {trajectories})" in output
    rows = [json.loads(line) for line in trajectories.read_text().splitlines()]
    assert [row["status"] for row in rows] == ["sandbox_error"] * 4
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


def test_a_peer_that_dies_mid_run_stops_it_after_three_steps_of_failed_rollouts(
    tmp_path: Path, factory_dir: Path
) -> None:
    """After a step that trained, a step whose rollouts all failed on a peer is survived
    (a blip); the third such step in a row stops the run. A step that keeps one rollout
    resets the count."""
    from rollout.trajectory import Task, Trajectory, TrajectoryStatus
    from slime_ext.job.config import config_from_dict
    from slime_ext.local.loop import LocalRun, RolloutsFailedError

    job = config_from_dict(
        {**TINY, "logging": {"run_dir": str(tmp_path), "wandb_mode": "disabled"}}
    )
    run = LocalRun(job, factory_dir, tmp_path / "run", Console(file=StringIO()))
    task = Task(task_id="t", kind="tir", prompt="1+1", answer="2")

    def step(*statuses: TrajectoryStatus) -> None:
        trajectories = [
            Trajectory(
                trajectory_id=f"t{i}", task=task, trunk_ids=[1], status=s, status_reason="peer gone"
            )
            for i, s in enumerate(statuses)
        ]
        run._check_infrastructure(trajectories, tmp_path / "step.jsonl")

    ok, gone = TrajectoryStatus.COMPLETED, TrajectoryStatus.TEACHER_ERROR
    step(ok, gone)
    step(gone, gone)
    step(gone, TrajectoryStatus.SANDBOX_ERROR)
    step(ok, gone)  # one rollout got through: the count starts over
    step(gone, gone)
    step(gone, gone)
    with pytest.raises(
        RolloutsFailedError,
        match=r"all 2 rollouts failed \(teacher_error: peer gone\), and in the 2 steps before",
    ):
        step(gone, gone)
