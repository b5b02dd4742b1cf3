"""The foundation demo (what `make demo` runs until the OPD trainer lands)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from launch.cli import app
from launch.demo import run_foundation_demo
from rollout.trajectory import read_jsonl


def test_demo_scores_each_span_given_its_context(tmp_path: Path) -> None:
    summary = run_foundation_demo(tmp_path, console=Console(quiet=True))
    [trajectory] = list(read_jsonl(tmp_path / "trajectories.jsonl"))
    assert trajectory.num_turns == 3 and summary["num_turns"] == 3
    assert not any(turn.drift for turn in trajectory.turns)
    teacher = AutoModelForCausalLM.from_pretrained(summary["teacher"]).eval()
    eos_id = AutoTokenizer.from_pretrained(summary["student"]).eos_token_id
    for k, turn in enumerate(trajectory.turns):
        # an independent check: the model's own cross-entropy over the span positions
        context, span = trajectory.context_ids(k), trajectory.span_ids(k)
        ids = torch.tensor([context + span])
        labels = torch.tensor([[-100] * len(context) + span])
        with torch.no_grad():
            mean_nll = teacher(input_ids=ids, labels=labels).loss.item()
        assert turn.teacher_logprobs is not None
        assert -sum(turn.teacher_logprobs) / len(span) == pytest.approx(mean_nll, rel=1e-5)
        assert turn.action_ids[-1] == eos_id and eos_id not in turn.think_ids
    # think dropped: turn 1's context holds turn 0's action but not its think
    context_1 = trajectory.context_ids(1)
    assert (
        trajectory.turns[0].action_ids[:-1]
        == context_1[
            trajectory.turns[0].context_len : trajectory.turns[0].context_len
            + len(trajectory.turns[0].action_ids)
            - 1
        ]
    )
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["per_turn_processed_tokens"] > on_disk["tree_packed_processed_tokens"]


def test_demo_command_runs(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["demo", "--out", str(tmp_path / "demo")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "demo" / "summary.json").is_file()
