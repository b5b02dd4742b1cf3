"""`opd tasks write` / `check` and validate's reading of cluster.tasks_file: rows made
from what users have (SWE-bench and SWE-bench Pro rows, mini-SWE, math sets) that the
hooks rebuild their tasks from, and a wrong file refused naming the row and the field,
by `opd config validate`, `opd launch` and `--sbatch` alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from launch.cli import app
from launch.tasks_file import CHECKED_ROWS, task_row
from rollout.tasks import mini_swe
from rollout.trajectory import Task
from slime_ext.slime.generate import task_from_sample
from tests.test_swe_spec import PRO_ROW, VERIFIED_ROW

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "launch/configs/swe-opd-cluster.yaml"


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _write(argv: list[str]) -> Any:
    return CliRunner().invoke(app, ["tasks", "write", *argv])


def test_swebench_and_pro_rows_become_rows_the_hooks_rebuild_the_tasks_from(
    tmp_path: Path,
) -> None:
    verified = _jsonl(tmp_path / "verified.jsonl", [VERIFIED_ROW])
    pro = _jsonl(tmp_path / "pro.jsonl", [PRO_ROW])
    out = tmp_path / "tasks.jsonl"
    result = _write([f"verified={verified}", str(pro), "mini_swe:3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "wrote 5 tasks (mini_swe, swebench, swebench_pro)" in result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["metadata"]["task"]["task_id"] for row in rows[:2]] == [
        VERIFIED_ROW["instance_id"],
        PRO_ROW["instance_id"],
    ]
    sample = type("Sample", (), {})()
    for row in rows:  # what slime hands our generate hook
        sample.prompt, sample.label, sample.metadata, sample.index = (
            row["prompt"], row["label"], row["metadata"], 0,
        )  # fmt: skip
        task = task_from_sample(sample, "swe")
        assert task == Task.model_validate(row["metadata"]["task"])
    assert rows[2]["metadata"]["task"] == mini_swe.generate_tasks(1, seed=0)[0].model_dump()


def test_math_sets_and_arithmetic_carry_their_answers(tmp_path: Path) -> None:
    math = _jsonl(tmp_path / "aime.jsonl", [{"problem": "1+1?", "answer": 2}])
    out = tmp_path / "math.jsonl"
    result = _write(["--harness", "tir", str(math), "arithmetic:2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["label"] == "2" and rows[0]["prompt"] == "1+1?"
    assert all(row["label"] for row in rows) and len(rows) == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["mini_swe:zero"], "mini_swe:N with N a positive integer"),
        (["--harness", "tir", "arithmetic:x"], "arithmetic:N with N a positive integer"),
        (["mini_swe:2", "mini_swe:2"], "is in mini_swe:2 and in mini_swe:2"),
        (["nowhere.jsonl"], "nowhere.jsonl does not exist"),
    ],
)
def test_a_source_that_cannot_be_read_writes_nothing(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    out = tmp_path / "tasks.jsonl"
    result = _write([*argv, "--out", str(out)])
    assert result.exit_code == 2 and message in " ".join(result.output.split())
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_bad_swebench_row_is_named(tmp_path: Path) -> None:
    bad = _jsonl(
        tmp_path / "v.jsonl", [VERIFIED_ROW, {"instance_id": "a__b-1", "FAIL_TO_PASS": "[]"}]
    )
    result = _write([str(bad), "--out", str(tmp_path / "t.jsonl")])
    assert result.exit_code == 2 and "v.jsonl: row 2: a__b-1" in result.output


def _row(task: Task, **changes: Any) -> dict[str, Any]:
    row = task_row(task)
    row.update(changes)
    return row


SWE_TASK = mini_swe.generate_tasks(1, seed=0)[0]


@pytest.mark.parametrize(
    ("rows", "recipe", "refusal"),
    [
        ([task_row(SWE_TASK)] * 3, "opd", None),
        ([task_row(SWE_TASK), "not json"], "opd", "tasks.jsonl:2: not JSON"),
        ([task_row(SWE_TASK), [1, 2]], "opd", "tasks.jsonl:2: a row must be a JSON object"),
        ([_row(SWE_TASK, prompt="")], "opd", "tasks.jsonl:1: prompt: the task statement"),
        ([_row(SWE_TASK, metadata={})], "opd", "tasks.jsonl:1: metadata.task: a SWE row carries"),
        (
            [_row(SWE_TASK, metadata={"task": {**SWE_TASK.model_dump(), "task_id": ""}})],
            "opd",
            "tasks.jsonl:1: metadata.task.task_id: String should have at least 1 character",
        ),
        (
            [
                {
                    "prompt": "1+1?",
                    "label": "2",
                    "metadata": {
                        "task": {"task_id": "a", "kind": "tir", "prompt": "1+1?", "answer": "2"}
                    },
                }
            ],
            "opd",
            "metadata.task.kind 'tir' is not a task of the swe harness",
        ),
        ([], "opd", "holds no rows: write it with `opd tasks write`"),
        ([task_row(SWE_TASK)], "sft", "tasks.jsonl:1: trajectory_id: Field required"),
        (
            [
                {
                    "trajectory_id": "t",
                    "turn": 0,
                    "tokens": [1, 2, 3],
                    "response_length": 1,
                    "loss_mask": [1],
                }
            ],
            "sft",
            None,
        ),
    ],
)
def test_validate_launch_and_sbatch_read_a_readable_tasks_file_alike(
    tmp_path: Path, rows: list[Any], recipe: str, refusal: str | None
) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    sets = ["--set", f"cluster.tasks_file={path}", "--set", f"algorithm.recipe={recipe}"]
    if recipe == "sft":
        sets += ["--set", "rollout.samples_per_task=2"]
    validate = CliRunner().invoke(app, ["config", "validate", str(EXAMPLE), *sets])
    dry_run = CliRunner().invoke(app, ["launch", str(EXAMPLE), *sets, "--dry-run"])
    script = tmp_path / "job.sbatch"
    sbatch = CliRunner().invoke(app, ["launch", str(EXAMPLE), *sets, "--sbatch", str(script)])
    codes = (validate.exit_code, dry_run.exit_code, sbatch.exit_code)
    if refusal is None:
        assert codes == (0, 0, 0), validate.output + dry_run.output + sbatch.output
        assert f", {len(rows)} rows in {path}," in " ".join(validate.output.split())
        return
    assert codes == (2, 2, 2), validate.output
    for result in (validate, dry_run, sbatch):
        assert refusal in " ".join(result.output.split()), result.output


def test_only_the_first_rows_are_parsed_but_every_row_is_counted(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    good = json.dumps(task_row(SWE_TASK))
    path.write_text("\n".join([good] * CHECKED_ROWS + ["not json"] * 5) + "\n")
    result = CliRunner().invoke(app, ["tasks", "check", str(path)])
    assert result.exit_code == 0 and f"{CHECKED_ROWS + 5} rows" in result.output
