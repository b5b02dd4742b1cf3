"""Checkpoints and resume of `opd train`: a checkpoint per save step with the newest N kept,
resume from the newest or a named one (the same run as an uninterrupted one), the resolved
config in the run directory, refusal of changed settings naming them, --allow-changed,
--fresh, and run directories from before per-step checkpoints."""

from __future__ import annotations

import asyncio
import json
import shutil
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from rich.console import Console
from safetensors.torch import load_file
from typer.testing import CliRunner

from launch.cli import app
from rollout.tasks.arithmetic import make_tasks
from slime_ext.job.config import JobConfig, config_from_dict, load_config
from slime_ext.local.checkpoints import ResumeOptions, RunDirError, open_run
from slime_ext.local.loop import LocalRun
from slime_ext.local.run_config import TRAIN_TASKS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TIMING = ("time", "per_sec")
"""Substrings of the metrics that measure time: the only ones that differ between runs."""


def _job_data(student: Path, run_dir: Path, **algorithm: Any) -> dict[str, Any]:
    return {
        "model": {"student": str(student), "seed": 0},
        "rollout": {
            "max_turns": 2,
            "max_new_tokens": 12,
            "tasks_per_step": 2,
            "samples_per_task": 2,
            "concurrency": 4,
        },
        # OPRD's teacher is the initial student in the trainer's process: no service to start
        "teacher": {"kind": "self", "snapshot": "fixed"},
        "algorithm": {"recipe": "oprd", "steps": 3, "lr": 1e-3, **algorithm},
        "logging": {
            "run_dir": str(run_dir),
            "wandb_mode": "disabled",
            "save_every_steps": 1,
            "keep_checkpoints": 2,
        },
    }


def _job(student: Path, run_dir: Path, **algorithm: Any) -> JobConfig:
    return config_from_dict(_job_data(student, run_dir, **algorithm))


def _train(run: LocalRun) -> None:
    asyncio.run(run.train(make_tasks(TRAIN_TASKS, "train", seed=0), None))


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not any(t in k for t in TIMING)} for row in rows]


def _checkpoints(run_dir: Path) -> list[str]:
    return sorted(path.name for path in (run_dir / "checkpoints").iterdir())


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / "model.safetensors")


def _same_weights(a: Path, b: Path) -> bool:
    first, second = _weights(a), _weights(b)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, factory_dir: Path) -> tuple[Path, str]:
    """An uninterrupted 3-step OPRD run saving after every step, 2 checkpoints kept: its
    directory and what it printed."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    output = StringIO()
    _train(LocalRun(_job(factory_dir, run_dir), factory_dir, run_dir, Console(file=output)))
    return run_dir, output.getvalue()


def _copy(finished: tuple[Path, str], tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished[0], copy, symlinks=True)
    return copy


def _config_file(tmp_path: Path, student: Path, run_dir: Path) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job_data(student, run_dir)))
    return str(path)


def _previous(run_dir: Path) -> Path:
    [previous] = run_dir.glob("previous-*")
    return previous


def test_keeps_the_newest_checkpoints_and_the_resolved_config(
    finished: tuple[Path, str], factory_dir: Path
) -> None:
    run_dir, printed = finished
    assert _checkpoints(run_dir) == ["step_00002", "step_00003"]  # 3 saves, 2 kept
    latest = run_dir / "checkpoint"
    assert latest.is_symlink() and latest.resolve() == (run_dir / "checkpoints/step_00003")
    assert torch.load(latest / "trainer.pt", weights_only=False)["step"] == 3
    written = [line for line in printed.splitlines() if line.startswith("checkpoint written")]
    assert written == [
        f"checkpoint written: {run_dir / 'checkpoints' / f'step_0000{n}'} (step {n}/3)"
        for n in (1, 2, 3)
    ]
    assert load_config(run_dir / "config.yaml") == _job(factory_dir, run_dir)


def test_resuming_from_the_latest_checkpoint_repeats_the_uninterrupted_run(
    finished: tuple[Path, str], factory_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    job = _job(factory_dir, run_dir)
    asyncio.run(
        LocalRun(job, factory_dir, run_dir).train(
            make_tasks(TRAIN_TASKS, "train", seed=0), None, steps=1
        )
    )
    output = StringIO()
    resumed = LocalRun(job, factory_dir, run_dir, Console(file=output))
    assert resumed.step == 1
    _train(resumed)
    assert f"resuming oprd at step 1/3 from {run_dir / 'checkpoints/step_00001'}" in (
        output.getvalue().splitlines()
    )
    assert [row["step"] for row in _metrics(run_dir)] == [0, 1, 2]
    assert _metrics(run_dir) == _metrics(finished[0])
    assert _same_weights(run_dir / "checkpoint", finished[0] / "checkpoint")
    assert not _same_weights(run_dir / "checkpoint", factory_dir)  # it trained


def test_resuming_from_a_named_step_moves_the_later_run_aside(
    finished: tuple[Path, str], factory_dir: Path, tmp_path: Path
) -> None:
    run_dir = _copy(finished, tmp_path)
    job = _job(factory_dir, run_dir)
    with pytest.raises(
        RunDirError, match=r"from step 1: no checkpoint.*\n  kept checkpoints: 2, 3"
    ):
        LocalRun(job, factory_dir, run_dir, resume=ResumeOptions(from_step=1))
    run = LocalRun(job, factory_dir, run_dir, resume=ResumeOptions(from_step=2))
    assert run.step == 2
    assert _checkpoints(run_dir) == ["step_00002"]
    assert (run_dir / "checkpoint").resolve() == run_dir / "checkpoints/step_00002"
    previous = _previous(run_dir)
    assert _checkpoints(previous) == ["step_00003"]
    assert sorted(p.name for p in (previous / "trajectories").iterdir()) == ["step_00002.jsonl"]
    assert [row["step"] for row in _metrics(previous)] == [0, 1, 2]  # as it was
    assert [row["step"] for row in _metrics(run_dir)] == [0, 1]
    _train(run)
    assert _metrics(run_dir) == _metrics(finished[0])
    assert _same_weights(run_dir / "checkpoints/step_00003", previous / "checkpoints/step_00003")


def test_resuming_with_changed_settings_is_refused_naming_each(
    finished: tuple[Path, str], factory_dir: Path, tmp_path: Path
) -> None:
    run_dir = _copy(finished, tmp_path)
    before = (run_dir / "config.yaml").read_text(), _metrics(run_dir)
    config = _config_file(tmp_path, factory_dir, run_dir)
    args = ["train", config, "-s", "algorithm.lr=0.01", "-s", "algorithm.recipe=opsd"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = result.output.splitlines()
    assert lines[0] == f"cannot resume {run_dir}: it holds a run with other settings " + (
        f"({run_dir / 'config.yaml'})"
    )
    # logging.run_dir changed too (a copied run): safe, so not refused
    assert lines[1:3] == ["  algorithm.lr: 0.001 -> 0.01", "  algorithm.recipe: 'oprd' -> 'opsd'"]
    assert "--fresh" in lines[3]
    assert lines[3].endswith("--allow-changed algorithm.lr --allow-changed algorithm.recipe")
    assert "Traceback" not in result.output
    assert ((run_dir / "config.yaml").read_text(), _metrics(run_dir)) == before
    assert _checkpoints(run_dir) == ["step_00002", "step_00003"]


def test_a_safe_change_resumes_and_is_recorded(
    finished: tuple[Path, str], factory_dir: Path, tmp_path: Path
) -> None:
    run_dir = _copy(finished, tmp_path)
    config = _config_file(tmp_path, factory_dir, run_dir)
    extend = ["-s", "algorithm.steps=4", "-s", "rollout.concurrency=2"]
    result = CliRunner().invoke(app, ["train", config, *extend])
    assert result.exit_code == 0, result.output
    assert f"resuming oprd at step 3/4 from {run_dir / 'checkpoints/step_00003'}" in result.output
    assert "resuming with a changed setting: algorithm.steps: 3 -> 4 (safe: " in result.output
    assert [row["step"] for row in _metrics(run_dir)] == [0, 1, 2, 3]
    assert _checkpoints(run_dir) == ["step_00003", "step_00004"]
    recorded = (run_dir / "config.yaml").read_text()
    assert "# step 3: rollout.concurrency: 4 -> 2 (safe: " in recorded
    resolved = load_config(run_dir / "config.yaml")
    assert (resolved.algorithm.steps, resolved.rollout.concurrency) == (4, 2)


def test_a_decaying_schedule_makes_a_change_of_steps_unsafe(tmp_path: Path) -> None:
    """algorithm.steps is safe to change only where the steps left train the same."""
    job = JobConfig.model_validate(
        {"algorithm": {"lr_schedule": "cosine", "steps": 4}, "logging": {"run_dir": "r"}}
    )
    open_run(tmp_path, job, ResumeOptions())
    (tmp_path / "checkpoints/step_00002").mkdir(parents=True)
    (tmp_path / "checkpoints/step_00002/trainer.pt").touch()
    longer = job.model_copy(update={"algorithm": job.algorithm.model_copy(update={"steps": 8})})
    with pytest.raises(RunDirError, match=r"steps: 4 -> 8 \(the cosine LR schedule decays"):
        open_run(tmp_path, longer, ResumeOptions())
    start = open_run(tmp_path, longer, ResumeOptions(allow_changed=("algorithm.steps",)))
    assert start.notes == (
        "resuming with a changed setting: algorithm.steps: 4 -> 8 (--allow-changed)",
    )


def test_allow_changed_accepts_a_named_change_and_records_it(
    finished: tuple[Path, str], factory_dir: Path, tmp_path: Path
) -> None:
    run_dir = _copy(finished, tmp_path)
    config = _config_file(tmp_path, factory_dir, run_dir)
    args = ["train", config, "-s", "algorithm.lr=0.002", "--allow-changed", "algorithm.lr"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    note = "algorithm.lr: 0.001 -> 0.002 (--allow-changed)"
    assert f"resuming with a changed setting: {note}" in result.output
    assert f"# step 3: {note}" in (run_dir / "config.yaml").read_text().splitlines()
    assert load_config(run_dir / "config.yaml").algorithm.lr == 0.002


def test_fresh_moves_the_earlier_run_aside_and_starts_at_step_0(
    finished: tuple[Path, str], factory_dir: Path, tmp_path: Path
) -> None:
    run_dir = _copy(finished, tmp_path)
    config = _config_file(tmp_path, factory_dir, run_dir)
    args = ["train", config, "--fresh", "-s", "algorithm.steps=1", "-s", "algorithm.lr=0.5"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    previous = _previous(run_dir)
    assert f"--fresh: the earlier run in {run_dir} was moved to {previous}" in result.output
    assert _checkpoints(previous) == ["step_00002", "step_00003"]
    assert [row["step"] for row in _metrics(previous)] == [0, 1, 2]
    assert load_config(previous / "config.yaml").algorithm.lr == 0.001
    assert torch.load(previous / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 3
    assert [row["step"] for row in _metrics(run_dir)] == [0]
    assert _checkpoints(run_dir) == ["step_00001"]
    assert load_config(run_dir / "config.yaml").algorithm.lr == 0.5


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--resume-from", "1"], "kept checkpoints: 2, 3"),
        (["--fresh", "--resume-from", "2"], "--fresh and --resume-from together"),
        (["--allow-changed", "algorithm.lrr"], "did you mean algorithm.lr?"),
    ],
)
def test_mistakes_are_refused_in_a_line(
    finished: tuple[Path, str], factory_dir: Path, tmp_path: Path, args: list[str], says: str
) -> None:
    run_dir = _copy(finished, tmp_path)
    result = CliRunner().invoke(app, ["train", _config_file(tmp_path, factory_dir, run_dir), *args])
    assert result.exit_code == 2
    assert says in result.output and "Traceback" not in result.output
    assert _checkpoints(run_dir) == ["step_00002", "step_00003"]


def test_a_run_directory_with_the_single_checkpoint_of_before_resumes(
    finished: tuple[Path, str], factory_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(finished[0] / "checkpoints/step_00003", run_dir / "checkpoint")
    shutil.copy(finished[0] / "metrics.jsonl", run_dir / "metrics.jsonl")
    output = StringIO()
    run = LocalRun(_job(factory_dir, run_dir, steps=4), factory_dir, run_dir, Console(file=output))
    assert run.step == 3
    assert _checkpoints(run_dir) == ["step_00003"]
    assert (run_dir / "checkpoint").resolve() == run_dir / "checkpoints/step_00003"
    _train(run)
    printed = output.getvalue()
    assert f"resuming oprd at step 3/4 from {run_dir / 'checkpoints/step_00003'}" in printed
    assert "had recorded no settings" in printed
    assert [row["step"] for row in _metrics(run_dir)] == [0, 1, 2, 3]
    assert _checkpoints(run_dir) == ["step_00003", "step_00004"]
    assert load_config(run_dir / "config.yaml").algorithm.steps == 4
