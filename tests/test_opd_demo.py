"""`opd demo` at a tiny scale (the full demo, ~10 minutes, is not run by CI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from slime_ext.local.opd_demo import run_opd_demo
from slime_ext.models.refs import bundled_models

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_bundled_models_share_a_tokenizer() -> None:
    student, teacher = bundled_models()
    assert (student / "tokenizer.json").read_bytes() == (teacher / "tokenizer.json").read_bytes()


@pytest.mark.timeout(600)
def test_demo_writes_its_summary_plot_and_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "demo"
    summary = run_opd_demo(out, steps=2, n_heldout=12, console=Console(quiet=True))
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == summary
    for key in (
        "accuracy_before",
        "accuracy_after",
        "n_heldout",
        "diff_ci95",
        "opd_reverse_kl_first",
        "opd_reverse_kl_last",
        "wall_s",
        "plot",
    ):
        assert key in summary
    assert summary["n_heldout"] == 12 and summary["steps"] == 2
    low, high = summary["diff_ci95"]
    assert low <= summary["accuracy_after"] - summary["accuracy_before"] <= high
    assert Path(summary["plot"]).stat().st_size > 1000
    assert (out / "checkpoint" / "trainer.pt").is_file()
    assert len(list((out / "trajectories").glob("step_*.jsonl"))) == 2


def test_demo_seed_reaches_the_job_and_defaults_to_demo_yaml(tmp_path: Path) -> None:
    from launch.cli import app
    from slime_ext.local.opd_demo import demo_job

    assert demo_job(tmp_path, steps=3).model.seed == 0
    job = demo_job(tmp_path, steps=3, seed=2)
    assert job.model.seed == 2 and job.algorithm.steps == 3
    assert job.model.student == "bundled:student"  # the seed picks draws, not the models

    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["demo", "--seed", "x"])
    assert result.exit_code == 2 and "seed" in result.output
