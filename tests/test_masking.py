"""Tier classification on real shell and python error outputs (produced by running them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollout.masking import MaskStats, classify_turn, loss_mask_for
from rollout.toolcalls import NoToolCallError, UnknownToolError
from rollout.trajectory import MaskTier, Task, Trajectory, TrajectoryStatus, Turn


def _run(shell: list[str], command: str, cwd: Path) -> tuple[int, str]:
    done = subprocess.run(
        [*shell, command], capture_output=True, text=True, cwd=cwd, timeout=30, check=False
    )
    return done.returncode, done.stderr + done.stdout


@pytest.mark.parametrize(
    "shell", [["bash", "-lc"], ["bash", "-c"], ["sh", "-c"], ["/bin/bash", "-c"]]
)
@pytest.mark.parametrize(
    "command",
    [
        "definitely_not_a_command_xyz --help",
        "cd /tmp && definitely_not_a_command_xyz",
    ],
)
def test_command_not_found_is_tier2(tmp_path: Path, shell: list[str], command: str) -> None:
    exit_code, output = _run(shell, command, tmp_path)
    assert exit_code == 127
    assert classify_turn(None, exit_code, output) is MaskTier.SHELL_ERROR


@pytest.mark.parametrize(
    "command",
    [
        "echo )",
        "if true; then echo x",
        'echo "unterminated',
        "for i in 1 2; do echo $i",
    ],
)
def test_shell_syntax_error_is_tier2(tmp_path: Path, command: str) -> None:
    exit_code, output = _run(["bash", "-c"], command, tmp_path)
    assert exit_code == 2, output
    assert classify_turn(None, exit_code, output) is MaskTier.SHELL_ERROR


@pytest.mark.parametrize(
    "command",
    [
        "ls /definitely/not/here",  # exit 2, but the command ran and failed
        "grep -q needle /dev/null",  # exit 1
        f"{sys.executable} -c 'raise ValueError(\"boom\")'",  # a genuine traceback
        f"{sys.executable} -c 'syntax('",  # python's syntax error, not the shell's
        "cd /definitely/not/here",
        "false",
    ],
)
def test_legitimate_failures_are_trained_on(tmp_path: Path, command: str) -> None:
    exit_code, output = _run(["bash", "-c"], command, tmp_path)
    assert exit_code != 0
    assert classify_turn(None, exit_code, output) is MaskTier.VALID


def test_missing_command_inside_a_script_is_a_legitimate_failure(tmp_path: Path) -> None:
    script = tmp_path / "run_tests.sh"
    script.write_text("#!/bin/bash\necho running\ndefinitely_not_a_command_xyz\n")
    script.chmod(0o755)
    exit_code, output = _run(["bash", "-c"], "./run_tests.sh", tmp_path)
    assert exit_code == 127 and "command not found" in output
    assert classify_turn(None, exit_code, output) is MaskTier.VALID


def test_failing_pytest_run_is_trained_on(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text("def test_x():\n    assert 1 == 2\n")
    exit_code, output = _run(["bash", "-c"], f"{sys.executable} -m pytest -q test_x.py", tmp_path)
    assert exit_code == 1 and "assert 1 == 2" in output
    assert classify_turn(None, exit_code, output) is MaskTier.VALID


def test_parse_errors_are_tier1_whatever_ran() -> None:
    assert classify_turn(NoToolCallError("none")) is MaskTier.INVALID_ACTION
    assert classify_turn(UnknownToolError("x"), 0, "") is MaskTier.INVALID_ACTION


def test_python_tool_failures_are_never_tier2() -> None:
    output = "bash: line 1: foo: command not found"
    assert classify_turn(None, 127, output, shell=False) is MaskTier.VALID


def test_success_is_valid() -> None:
    assert classify_turn(None, 0, "bash: line 1: foo: command not found") is MaskTier.VALID


@pytest.mark.parametrize(
    ("tier", "loss", "train_kl", "expected"),
    [
        (MaskTier.VALID, "imitation", True, True),
        (MaskTier.INVALID_ACTION, "imitation", True, False),
        (MaskTier.SHELL_ERROR, "imitation", True, False),
        (MaskTier.INVALID_ACTION, "kl", True, True),
        (MaskTier.SHELL_ERROR, "kl", True, True),
        (MaskTier.SHELL_ERROR, "kl", False, False),
        (MaskTier.VALID, "kl", False, True),
    ],
)
def test_loss_mask_by_recipe(tier: MaskTier, loss: str, train_kl: bool, expected: bool) -> None:
    assert loss_mask_for(tier, loss, train_kl) is expected  # type: ignore[arg-type]


@pytest.mark.parametrize("tier", [MaskTier.INVALID_ACTION, MaskTier.SHELL_ERROR])
def test_imitation_keeps_invalid_turns_only_when_asked(tier: MaskTier) -> None:
    """The masking ablation: imitation trains on tier-1/2 turns with imitate_invalid, and
    that switch leaves KL losses to train_kl_on_invalid."""
    assert loss_mask_for(tier, "imitation", imitate_invalid=True) is True
    assert loss_mask_for(tier, "imitation", False, imitate_invalid=True) is True
    assert loss_mask_for(tier, "kl", False, imitate_invalid=True) is False
    assert loss_mask_for(tier, "kl", True, imitate_invalid=False) is True


def test_mask_stats_count_tiers() -> None:
    tiers = [MaskTier.VALID] * 37 + [MaskTier.INVALID_ACTION] * 2 + [MaskTier.SHELL_ERROR]
    turns = [
        Turn(context_len=k + 1, span_ids=[1], think_len=0, mask_tier=tier)
        for k, tier in enumerate(tiers)
    ]
    trajectory = Trajectory(
        trajectory_id="t",
        task=Task(task_id="x", kind="swe", prompt="p"),
        trunk_ids=list(range(50)),
        turns=turns,
        status=TrajectoryStatus.TRUNCATED,
        status_reason="max turns",
    )
    stats = MaskStats()
    stats.add(trajectory)
    stats.add(trajectory)
    metrics = stats.metrics()
    assert metrics["turns"] == 80
    assert metrics["masked_turn_frac"] == pytest.approx(3 / 40)
    assert metrics["masked_turn_frac_tier1"] == pytest.approx(2 / 40)
    assert metrics["masked_turn_frac_tier2"] == pytest.approx(1 / 40)
