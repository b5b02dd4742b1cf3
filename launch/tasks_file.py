"""A cluster job's tasks file (cluster.tasks_file): written from what users have, checked
before a launch.

slime reads it as --prompt-data with --input-key prompt, --label-key label and
--metadata-key metadata: one JSON object per line, `{"prompt": ..., "label": ...,
"metadata": {"task": {...}}}`. Our generate hook rebuilds the task from `metadata.task`
(slime_ext/slime/generate.py), so a row carries everything the harness needs: a SWE
row its repository, image, tests and grading; a math row its reference answer.

`opd tasks write` makes such a file from SWE-bench / SWE-bench Pro / generic SWE rows
(as `opd eval swe` reads them), `mini_swe:N`, a math dataset file (as `opd eval math`
reads it) or `arithmetic:N`. `check` reads the first rows of a file readable where the
launch runs (and counts them all) and names the row and the field of the first problem.
Recipes sft and ssd read pre-tokenized turn records instead (slime_ext.sft_data, from
`opd ssd export`), checked as such.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollout.trajectory import Task

CHECKED_ROWS = 100
"""Rows a check parses (every row is counted)."""
HARNESS_KINDS = {
    "swe": ("mini_swe", "swebench", "swebench_pro", "generic_swe"),
    "tir": ("tir", "math"),
}
"""The task kinds each harness runs."""
ARITHMETIC_PREFIX = "arithmetic:"


class TasksFileError(ValueError):
    """A tasks file or source that a job cannot train on; names the row and the field."""


def load_tasks(source: str, harness: str, seed: int = 0, kind: str = "auto") -> list[Task]:
    """The tasks of `source` for `harness`: swe: a SWE dataset file or mini_swe:N; tir: a
    math dataset file or arithmetic:N (training problems, drawn with `seed`)."""
    from rollout.evaluation.datasets import DatasetError, load_math_dataset, load_swe_dataset

    try:
        if harness == "swe":
            return load_swe_dataset(source, kind, seed)  # type: ignore[arg-type]
        if source.startswith(ARITHMETIC_PREFIX):
            count = source.removeprefix(ARITHMETIC_PREFIX)
            if not count.isdigit() or int(count) < 1:
                raise TasksFileError(f"{source!r}: write arithmetic:N with N a positive integer")
            from rollout.tasks.arithmetic import make_tasks

            return make_tasks(int(count), "train", seed=seed)
        return load_math_dataset(Path(source))
    except DatasetError as err:
        raise TasksFileError(str(err)) from None


def task_row(task: Task) -> dict[str, Any]:
    """One --prompt-data row: the prompt, the label (a math answer; None for SWE) and the
    whole task in metadata."""
    return {"prompt": task.prompt, "label": task.answer, "metadata": {"task": task.model_dump()}}


def write_tasks_file(tasks: Sequence[Task], out: Path) -> int:
    """Write the rows (JSONL) whole or not at all: a temporary file renamed into place."""
    if not tasks:
        raise TasksFileError("no tasks to write")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            for task in tasks:
                handle.write(json.dumps(task_row(task)) + "\n")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return len(tasks)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open(encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, line


def check(path: Path, harness: str, recipe: str) -> int:
    """The number of rows of a readable tasks file, its first CHECKED_ROWS parsed; raises
    TasksFileError naming the first bad row and field."""
    if recipe in ("sft", "ssd"):
        return _check_records(path)
    if path.suffix.lower() == ".parquet":
        raise TasksFileError(
            f"{path}: write the tasks as JSONL (`opd tasks write ... --out tasks.jsonl`); "
            "the rows carry nested task metadata"
        )
    count = 0
    for number, line in _lines(path):
        count += 1
        if count <= CHECKED_ROWS:
            _check_row(path, number, line, harness)
    if count == 0:
        raise TasksFileError(f"{path} holds no rows: write it with `opd tasks write`")
    return count


def _check_row(path: Path, number: int, line: str, harness: str) -> None:
    where = f"{path}:{number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise TasksFileError(f"{where}: not JSON ({err.msg})") from None
    if not isinstance(row, dict):
        raise TasksFileError(f"{where}: a row must be a JSON object with prompt and metadata")
    prompt = row.get("prompt")
    if not (isinstance(prompt, str) and prompt.strip()) and not isinstance(prompt, list):
        raise TasksFileError(f"{where}: prompt: the task statement (a non-empty string)")
    metadata = row.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise TasksFileError(f"{where}: metadata: an object (with the task under task)")
    task = (metadata or {}).get("task")
    if task is None:
        if harness == "swe":
            raise TasksFileError(
                f"{where}: metadata.task: a SWE row carries its task (repository, image, "
                "tests); write the file with `opd tasks write --harness swe`"
            )
        if not isinstance(row.get("label"), str) or not row["label"].strip():
            raise TasksFileError(f"{where}: label: a math row's reference answer (a string)")
        return
    try:
        parsed = Task.model_validate(task)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise TasksFileError(f"{where}: metadata.task.{field}: {first['msg']}") from None
    kinds = HARNESS_KINDS[harness]
    if parsed.kind not in kinds:
        raise TasksFileError(
            f"{where}: metadata.task.kind {parsed.kind!r} is not a task of the {harness} "
            f"harness ({', '.join(kinds)}): rollout.harness or the file is wrong"
        )
    if harness == "tir" and not parsed.answer:
        raise TasksFileError(f"{where}: metadata.task.answer: a math task's reference answer")


def _check_records(path: Path) -> int:
    """sft / ssd: pre-tokenized turn records (`opd ssd export`)."""
    from slime_ext.sft_data import TurnRecord

    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path)
        count = table.metadata.num_rows
        rows = table.read_row_group(0).to_pylist()[:CHECKED_ROWS] if count else []
        numbered = [(i + 1, row) for i, row in enumerate(rows)]
    else:
        count, numbered = 0, []
        for number, line in _lines(path):
            count += 1
            if count <= CHECKED_ROWS:
                try:
                    numbered.append((number, json.loads(line)))
                except json.JSONDecodeError as err:
                    raise TasksFileError(f"{path}:{number}: not JSON ({err.msg})") from None
    for number, row in numbered:
        try:
            TurnRecord.model_validate(row)
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(part) for part in first["loc"]) or "(the row)"
            raise TasksFileError(
                f"{path}:{number}: {field}: {first['msg']} (recipes sft and ssd train on "
                "`opd ssd export` records)"
            ) from None
    if count == 0:
        raise TasksFileError(f"{path} holds no records: make them with `opd ssd export`")
    return count
