"""`opd compare` on two run directories, and `opd sweep temperature` / `opd eval math`
from the command line with a small factory model (random weights: the scores are near 0,
what is checked is that each temperature ran, resumed and was reported)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from launch.cli import app
from launch.evaluation import EvalSettings, RunOptions, run_evaluation
from tests.scripted_policy import Script, say, scripted_factory

PROBLEMS = {"p1": "4", "p2": "9", "p3": "3", "p4": "32"}


def _dataset(path: Path) -> Path:
    path.write_text(
        "".join(
            json.dumps({"id": task_id, "problem": f"Problem {task_id}", "answer": answer}) + "\n"
            for task_id, answer in PROBLEMS.items()
        )
    )
    return path


def _run(
    tmp_path: Path, name: str, solves: set[str], tokenizer: Any, limit: int | None = None
) -> Path:
    def script(task_id: str, _sample: int) -> Script:
        answer = PROBLEMS[task_id] if task_id in solves else "0"
        return [say(f"\\boxed{{{answer}}}")]

    dataset = _dataset(tmp_path / "toy.jsonl")
    settings = EvalSettings(kind="math", policy=name, datasets=[str(dataset)], tools=False)
    options = RunOptions(
        out_dir=tmp_path / name, limit=limit, show_progress=False, wandb_mode="disabled"
    )
    run_evaluation(settings, options, scripted_factory(tokenizer, script))
    return tmp_path / name


def test_compare_counts_paired_outcomes_and_writes_a_report(
    tmp_path: Path, factory_tokenizer: Any
) -> None:
    base = _run(tmp_path, "base", {"p1", "p2"}, factory_tokenizer)
    trained = _run(tmp_path, "trained", {"p2", "p3", "p4"}, factory_tokenizer)
    result = CliRunner().invoke(
        app,
        [
            "compare",
            str(trained),
            str(base),
            "--out",
            str(tmp_path / "cmp"),
            "--wandb-mode",
            "disabled",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "cmp" / "report.json").read_text())
    [toy] = report["benchmarks"]
    paired = toy["paired"]
    assert (paired["both"], paired["only_a"], paired["only_b"], paired["neither"]) == (1, 2, 1, 0)
    assert paired["net"] == 1 and paired["mcnemar_p"] == pytest.approx(1.0)
    assert report["reconciles"] is True
    assert (tmp_path / "cmp" / "report.md").read_text().count("| toy |") == 1


def test_compare_flags_runs_over_different_instances(
    tmp_path: Path, factory_tokenizer: Any
) -> None:
    base = _run(tmp_path, "base", {"p1", "p2"}, factory_tokenizer)
    partial = _run(tmp_path, "partial", {"p1", "p2", "p3"}, factory_tokenizer, limit=3)
    result = CliRunner().invoke(app, ["compare", str(partial), str(base)])
    assert result.exit_code == 1
    assert "p4" in result.output  # the instance only the base run evaluated


def test_compare_refuses_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["compare", str(tmp_path), str(tmp_path)])
    assert result.exit_code == 2
    assert "not an evaluation run" in result.output


@pytest.mark.timeout(600)
def test_temperature_sweep_runs_each_temperature_and_resumes(tmp_path: Path) -> None:
    dataset = _dataset(tmp_path / "toy.jsonl")
    args = [
        "sweep",
        "temperature",
        "--values",
        "0.7,1.2",
        "--task",
        "math",
        "--policy",
        "factory:qwen3-tiny",
        "--dataset",
        str(dataset),
        "--limit",
        "2",
        "--max-turns",
        "1",
        "--max-new-tokens",
        "6",
        "--top-k",
        "10",
        "--out",
        str(tmp_path / "sweep"),
        "--wandb-mode",
        "disabled",
    ]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    report = json.loads((tmp_path / "sweep" / "report.json").read_text())
    assert [row["Temperature"] for row in report["rows"]] == ["0.7", "1.2"]
    assert all(row["Instances"] == 2 for row in report["rows"])
    assert report["settings"]["top_k"] == 10
    for temperature in ("0.7", "1.2"):
        run = json.loads((tmp_path / "sweep" / f"T{temperature}" / "run.json").read_text())
        assert run["settings"]["temperature"] == float(temperature)
    assert (tmp_path / "sweep" / "report.png").is_file()
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert again.output.count("ran 0 trajectories (2 already done)") == 2


def test_eval_math_reports_a_bad_dataset_row_by_number(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"problem": "x", "answer": "1"}) + "\n" + json.dumps({"problem": "y"}) + "\n"
    )
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "math",
            "--policy",
            "factory:qwen3-tiny",
            "--dataset",
            str(bad),
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert result.exit_code == 2
    assert "row 2 has no reference answer" in result.output


def _swebench_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resolved: set[str], extra: list[str]
) -> Path:
    """A report written by swebench's own make_run_report (its schema, not ours) for
    predictions of p1..p4; `extra`: dataset instances with no prediction."""
    from swebench.harness.reporting import make_run_report

    tmp_path.mkdir(exist_ok=True)
    monkeypatch.chdir(tmp_path)
    predictions = {
        i: {"instance_id": i, "model_name_or_path": "m", "model_patch": "diff"} for i in PROBLEMS
    }
    for instance_id in PROBLEMS:
        folder = tmp_path / "logs" / "run_evaluation" / "r1" / "m" / instance_id
        folder.mkdir(parents=True)
        report = {instance_id: {"resolved": instance_id in resolved}}
        (folder / "report.json").write_text(json.dumps(report))
    dataset = [{"instance_id": i} for i in [*PROBLEMS, *extra]]
    return Path(make_run_report(predictions, dataset, "r1", report_dir=str(tmp_path)))


def test_compare_reads_a_swebench_harness_report(
    tmp_path: Path, factory_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = _run(tmp_path, "ours", {"p1", "p2"}, factory_tokenizer)
    official = _swebench_report(tmp_path, monkeypatch, {"p1", "p2", "p3"}, extra=[])
    agrees = CliRunner().invoke(app, ["compare", f"toy={official}", str(ours)])
    assert agrees.exit_code == 0, agrees.output  # +1 headline = only A 1 - only B 0
    assert "| toy | 4 | 2 | 1 | 0 | 1 |" in agrees.output
    padded = _swebench_report(tmp_path / "b", monkeypatch, {"p1"}, extra=["p5"])
    flagged = CliRunner().invoke(app, ["compare", f"toy={padded}", str(ours)])
    assert flagged.exit_code == 1
    assert "reports 5 instances but has records of 4" in flagged.output
