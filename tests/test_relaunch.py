"""Long cluster runs: slime's checkpoints pruned to logging.keep_checkpoints (never the
newest complete one, never one being written, never one the snapshot sync still needs),
a relaunch that goes on with the same settings and W&B run or stops naming what changed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import prune_checkpoints, relaunch
from launch.plan import build_plan, hosts_from_config, wandb_run_id
from slime_ext.job.config import config_to_yaml, load_config
from slime_ext.local.checkpoints import RunDirError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "launch/configs/swe-opd-cluster.yaml"


def _save_dir(path: Path, iterations: list[int], tracker: str | None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for i in iterations:
        (path / f"iter_{i:07d}").mkdir()
        (path / f"iter_{i:07d}" / "common.pt").write_text("w")
    if tracker is not None:
        (path / prune_checkpoints.TRACKER).write_text(tracker)
    return path


def _left(save: Path) -> list[int]:
    return prune_checkpoints.iterations(save)


def test_the_newest_complete_checkpoints_are_kept_and_one_being_written_is_never_touched(
    tmp_path: Path,
) -> None:
    save = _save_dir(tmp_path / "save", [0, 1, 2, 3, 4, 5], tracker="4")  # 5: being written
    (save / ".pruning-iter_0000009").mkdir()  # what an interrupted pass left
    assert prune_checkpoints.prune(save, keep=2) == [0, 1, 2]
    assert _left(save) == [3, 4, 5] and not list(save.glob(".pruning-*"))
    assert prune_checkpoints.prune(save, keep=1) == [3]
    assert _left(save) == [4, 5]  # the tracker's, and the one being written


@pytest.mark.parametrize("tracker", [None, "release", "garbage"])
def test_without_a_complete_checkpoint_nothing_is_removed(
    tmp_path: Path, tracker: str | None
) -> None:
    save = _save_dir(tmp_path / "save", [0, 1, 2], tracker)
    assert prune_checkpoints.prune(save, keep=1) == [] and _left(save) == [0, 1, 2]


def test_a_checkpoint_the_snapshot_sync_needs_stays_until_it_is_applied(tmp_path: Path) -> None:
    save = _save_dir(tmp_path / "save", [0, 1, 2, 3], tracker="3")
    state = tmp_path / "state.json"
    assert prune_checkpoints.prune(save, 1, protect=[1], state=state) == [0, 2]  # no state yet
    state.write_text(json.dumps({"applied": [], "current": "x"}))
    assert prune_checkpoints.prune(save, 1, protect=[1], state=state) == []
    state.write_text(json.dumps({"applied": [2], "current": "y"}))  # step 2 = iteration 1
    assert prune_checkpoints.prune(save, 1, protect=[1], state=state) == [1]
    assert _left(save) == [3]


def test_the_pruner_makes_a_last_pass_when_the_job_ends(tmp_path: Path) -> None:
    save = _save_dir(tmp_path / "save", [0, 1], tracker="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "launch.prune_checkpoints", "--save-dir", str(save), "--keep", "1",
         "--interval-s", "3600"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        assert "keeping the newest 1 checkpoint(s)" in process.stdout.readline()
        deadline = time.monotonic() + 20
        while _left(save) != [1] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _left(save) == [1]
        _save_dir(save, [2], tracker="2")  # training saved again, then the job ends
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        assert _left(save) == [2]
    finally:
        process.kill()
        process.wait(timeout=10)


def _launch(run: Path, **changes: str) -> Path:
    """The plan's first step: the new config beside the run's (job.next.yaml)."""
    sets = [f"logging.run_dir={run}", f"cluster.save_dir={run / 'save'}"]
    sets += [f"{key}={value}" for key, value in changes.items()]
    run.mkdir(parents=True, exist_ok=True)
    (run / relaunch.NEXT).write_text(config_to_yaml(load_config(EXAMPLE, sets)))
    return run


def test_a_relaunch_goes_on_with_changes_to_where_it_runs_and_stops_on_others(
    tmp_path: Path,
) -> None:
    run = _launch(tmp_path / "run")
    notes = relaunch.check(run)
    assert notes[0] == f"a new run in {run}" and "training starts at step 0" in notes[-1]
    _save_dir(run / "save", [3, 7], tracker="7")  # two checkpoints: after steps 4 and 8
    _launch(run, **{"cluster.head": "other-node", "cluster.ray_port": "7000"})
    notes = relaunch.check(run)
    assert (
        "relaunching with a changed setting: cluster.head: 'train-node-0' -> 'other-node'"
        in (notes[0])
    )
    assert notes[-1].startswith("slime resumes from the checkpoint after step 8")
    _launch(run, **{"algorithm.lr": "3e-6", "rollout.max_turns": "80"})
    kept = (run / relaunch.JOB).read_text()
    with pytest.raises(RunDirError) as refused:
        relaunch.check(run)
    text = str(refused.value)
    assert "algorithm.lr: 1e-06 -> 3e-06" in text and "rollout.max_turns" in text
    assert "opd launch ... --allow-changed algorithm.lr --allow-changed rollout.max_turns" in text
    assert (run / relaunch.JOB).read_text() == kept  # the run's config, untouched
    notes = relaunch.check(run, ["algorithm.lr", "rollout.max_turns"])
    assert any("algorithm.lr" in n and "(--allow-changed)" in n for n in notes)
    with pytest.raises(RunDirError, match=r"did you mean algorithm\.lr"):
        _launch(run)
        relaunch.check(run, ["algorithm.lrr"])


def test_a_new_run_never_resumes_another_runs_checkpoints(tmp_path: Path) -> None:
    """A run directory with no recorded config, but a save_dir holding checkpoints (another
    run's, or this one's with its run directory lost): slime would resume from them."""
    run = _launch(tmp_path / "run")
    _save_dir(run / "save", [1], tracker="1")
    with pytest.raises(RunDirError, match=r"checkpoints \(the newest after step 2\) of a run"):
        relaunch.check(run)
    assert not (run / relaunch.JOB).exists()


def test_the_relaunch_step_exits_2_naming_the_change(tmp_path: Path) -> None:
    run = _launch(tmp_path / "run")
    assert relaunch.main(["--run-dir", str(run)]) == 0
    _launch(run, **{"algorithm.lr": "5e-6"})
    command = [sys.executable, "-m", "launch.relaunch", "--run-dir", str(run)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and "--allow-changed algorithm.lr" in done.stderr
    done = subprocess.run(
        [*command, "--allow-changed", "algorithm.lr"], capture_output=True, text=True, cwd=ROOT,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_every_launch_of_a_run_logs_to_one_wandb_run_and_the_plan_keeps_its_checkpoints() -> None:
    job = load_config(EXAMPLE)
    other = load_config(EXAMPLE, ["logging.run_dir=/shared/runs/another"])
    assert wandb_run_id(job) == wandb_run_id(load_config(EXAMPLE)) != wandb_run_id(other)
    steps = {s.name: s for s in build_plan(job, hosts_from_config(job))}
    submit = steps["submit"].command
    assert (
        f'"WANDB_RUN_ID": "{wandb_run_id(job)}"' in submit and '"WANDB_RESUME": "allow"' in submit
    )
    prune = steps["prune checkpoints"]
    assert prune.command == (
        "python3 -m launch.prune_checkpoints --save-dir /shared/runs/swe-opd/megatron --keep 3"
    )
    assert not prune.needed and prune.kind == "background"
    disabled = load_config(EXAMPLE, ["logging.wandb_mode=disabled"])
    plan = build_plan(disabled, hosts_from_config(disabled))
    assert "WANDB_RUN_ID" not in plan[-1].command
