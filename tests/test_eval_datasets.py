"""Evaluation inputs and the results file: dataset rows in their own schemas, named
benchmarks, clear errors for bad rows; a results file torn by a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout.evaluation.datasets import (
    DatasetError,
    detect_swe_kind,
    load_math_dataset,
    load_swe_dataset,
    named,
)
from rollout.evaluation.records import EvalRecord, EvalResultsError, ResultStore
from rollout.trajectory import TrajectoryStatus


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_math_rows_take_their_answer_from_answer_or_a_boxed_solution(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "aime.jsonl",
        [
            {"problem": "1+1?", "answer": 2},
            {"question": "2+2?", "solution": "so \\boxed{4} it is", "unique_id": "q2"},
        ],
    )
    first, second = load_math_dataset(path)
    assert (first.task_id, first.answer, first.prompt) == ("aime-1", "2", "1+1?")
    assert (second.task_id, second.answer) == ("q2", "4")


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"answer": "1"}], "row 1 has no problem text"),
        (
            [{"problem": "x", "answer": "1", "id": 7}, {"problem": "y", "answer": "2", "id": 7}],
            "id '7' appears twice",
        ),
        ([], "holds no problems"),
    ],
)
def test_bad_math_rows_are_refused_by_row(
    tmp_path: Path, rows: list[dict[str, object]], message: str
) -> None:
    with pytest.raises(DatasetError, match=message):
        load_math_dataset(_jsonl(tmp_path / "bad.jsonl", rows))


def test_swe_rows_are_told_apart_by_their_fields() -> None:
    assert detect_swe_kind({"FAIL_TO_PASS": "[]", "repo": "a/b"}) == "swebench"
    assert detect_swe_kind({"fail_to_pass": "[]", "before_repo_set_cmd": "x"}) == "swebench_pro"
    assert detect_swe_kind({"FAIL_TO_PASS": "[]", "test_command": "pytest"}) == "generic"
    assert detect_swe_kind({"image": "x"}) == "generic"


def test_swe_dataset_errors_name_the_file_and_row(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "v.jsonl", [{"instance_id": "a__b-1", "FAIL_TO_PASS": "[]"}])
    with pytest.raises(DatasetError, match=r"v\.jsonl: row 1: a__b-1"):
        load_swe_dataset(str(path))
    with pytest.raises(DatasetError, match="mini_swe:N"):
        load_swe_dataset("mini_swe:zero")
    assert len(load_swe_dataset("mini_swe:3")) == 3


def test_benchmarks_are_named_by_stem_or_by_name() -> None:
    assert named("data/verified.parquet") == ("verified", "data/verified.parquet")
    assert named("pro=data/x.jsonl") == ("pro", "data/x.jsonl")
    assert named("mini_swe:4") == ("mini_swe", "mini_swe:4")


def _record(instance_id: str) -> EvalRecord:
    return EvalRecord(
        benchmark="b",
        instance_id=instance_id,
        solved=True,
        status=TrajectoryStatus.COMPLETED,
        status_reason="submitted",
        outcome="graded",
        num_turns=2,
    )


def test_a_torn_last_record_is_dropped_and_redone(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    store.open({"kind": "x"})
    store.append([_record("one"), _record("two")])
    with store.results_path.open("a") as handle:
        handle.write(_record("three").model_dump_json()[:40])  # killed mid-write
    assert [r.instance_id for r in store.read()] == ["one", "two"]
    store.append([_record("three")])
    assert [r.instance_id for r in store.read()] == ["one", "two", "three"]


def test_a_corrupt_record_in_the_middle_is_an_error(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    store.open({"kind": "x"})
    store.results_path.write_text("{not json}\n" + _record("one").model_dump_json() + "\n")
    with pytest.raises(EvalResultsError, match=r"results\.jsonl:1"):
        store.read()
