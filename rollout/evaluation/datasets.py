"""Evaluation datasets from files: rows of JSONL, JSON or parquet, made into tasks.

- Math: one problem per row, its text under `problem` (or `question`, `prompt`), its
  reference under `answer` (or `final_answer`, `expected_answer`; else the last \\boxed{}
  of `solution`), its id under `id` (or `problem_id`, `unique_id`, `idx`; else the row's
  number).
- SWE: SWE-bench / Verified / Lite / SWE-Gym rows, SWE-bench Pro rows and generic rows
  (an image and a test command), each through its adapter in rollout.tasks.swe_spec;
  `kind="auto"` picks the adapter from the row's fields.
- `mini_swe:N`: N synthetic mini-SWE tasks (local sandboxes, graded by swebench), for
  trying the pipeline on one machine.

A benchmark is named after its file (the stem: `verified.jsonl` -> `verified`) unless
given a name (`name=path`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from rollout.rewards.math import last_boxed
from rollout.tasks import mini_swe
from rollout.tasks.swe_spec import (
    SWETaskSpec,
    SWETaskSpecError,
    from_generic,
    from_swebench,
    from_swebench_pro,
    to_task,
)
from rollout.trajectory import Task

SWEDatasetKind = Literal["auto", "swebench", "swebench_pro", "generic"]
MINI_SWE_PREFIX = "mini_swe:"
_PROBLEM_KEYS = ("problem", "question", "prompt")
_ANSWER_KEYS = ("answer", "final_answer", "expected_answer")
_ID_KEYS = ("id", "problem_id", "unique_id", "idx")


class DatasetError(ValueError):
    """A dataset file that cannot be read as the benchmark asked for; names the file, the
    row and the field."""


def named(spec: str) -> tuple[str, str]:
    """(benchmark name, source) of `name=source`, or of a bare source (name: its stem)."""
    name, sep, source = spec.partition("=")
    if sep and name and "/" not in name:
        return name, source
    if spec.startswith(MINI_SWE_PREFIX):
        return "mini_swe", spec
    return Path(spec).stem, spec


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a .jsonl, .json (a list of objects) or .parquet file."""
    if not path.is_file():
        raise DatasetError(f"{path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return [dict(row) for row in pq.read_table(path).to_pylist()]
    text = path.read_text(encoding="utf-8")
    if suffix == ".json":
        rows = json.loads(text)
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise DatasetError(f"{path}: a .json dataset must be a list of objects")
        return rows
    parsed: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}:{number}: not JSON: {err}") from err
        if not isinstance(row, dict):
            raise DatasetError(f"{path}:{number}: a row must be a JSON object")
        parsed.append(row)
    return parsed


def load_math_dataset(path: Path) -> list[Task]:
    """The problems of a math dataset file as TIR tasks (kind "math")."""
    tasks: list[Task] = []
    seen: set[str] = set()
    for number, row in enumerate(read_rows(path), start=1):
        problem = _first(row, _PROBLEM_KEYS)
        if not isinstance(problem, str) or not problem.strip():
            raise DatasetError(
                f"{path}: row {number} has no problem text ({', '.join(_PROBLEM_KEYS)})"
            )
        answer = _first(row, _ANSWER_KEYS)
        if answer is None and isinstance(row.get("solution"), str):
            answer = last_boxed(row["solution"])
        if answer is None or not str(answer).strip():
            raise DatasetError(
                f"{path}: row {number} has no reference answer ({', '.join(_ANSWER_KEYS)}, "
                "or a \\boxed{} in solution)"
            )
        raw_id = _first(row, _ID_KEYS)
        task_id = str(raw_id) if raw_id is not None else f"{path.stem}-{number}"
        if task_id in seen:
            raise DatasetError(f"{path}: row {number}: id {task_id!r} appears twice")
        seen.add(task_id)
        tasks.append(Task(task_id=task_id, kind="math", prompt=problem, answer=str(answer)))
    if not tasks:
        raise DatasetError(f"{path} holds no problems")
    return tasks


def load_swe_dataset(source: str, kind: SWEDatasetKind = "auto", seed: int = 0) -> list[Task]:
    """The instances of a SWE dataset file (or `mini_swe:N`) as SWE harness tasks."""
    if source.startswith(MINI_SWE_PREFIX):
        count = source.removeprefix(MINI_SWE_PREFIX)
        if not count.isdigit() or int(count) < 1:
            raise DatasetError(f"{source!r}: write mini_swe:N with N a positive integer")
        return mini_swe.generate_tasks(int(count), seed=seed)
    path = Path(source)
    tasks: list[Task] = []
    seen: set[str] = set()
    for number, row in enumerate(read_rows(path), start=1):
        try:
            spec = _swe_spec(row, kind)
        except SWETaskSpecError as err:
            raise DatasetError(f"{path}: row {number}: {err}") from err
        if spec.instance_id in seen:
            raise DatasetError(f"{path}: row {number}: instance {spec.instance_id!r} appears twice")
        seen.add(spec.instance_id)
        tasks.append(to_task(spec))
    if not tasks:
        raise DatasetError(f"{path} holds no instances")
    return tasks


def detect_swe_kind(row: Mapping[str, Any]) -> Literal["swebench", "swebench_pro", "generic"]:
    """SWE-bench Pro rows carry lower-case fail_to_pass and Pro's own fields; a row that
    names its own test command (SWE-Gym / SWE-smith style) is generic; other rows with
    upper-case FAIL_TO_PASS are SWE-bench's."""
    if "fail_to_pass" in row and ({"dockerhub_tag", "before_repo_set_cmd"} & set(row)):
        return "swebench_pro"
    if row.get("test_command"):
        return "generic"
    if "FAIL_TO_PASS" in row:
        return "swebench"
    return "generic"


def _swe_spec(row: Mapping[str, Any], kind: SWEDatasetKind) -> SWETaskSpec:
    chosen = detect_swe_kind(row) if kind == "auto" else kind
    if chosen == "swebench":
        return from_swebench(row)
    if chosen == "swebench_pro":
        return from_swebench_pro(row)
    return from_generic(row)


def _first(row: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if row.get(key) is not None:
            return row[key]
    return None
