"""Run a policy over benchmarks and keep one graded record per trajectory as it finishes.

`evaluate` skips what the run directory already holds (resume), runs the rest through the
runner (`concurrency` trajectories at once, a progress bar), appends each record to
`results.jsonl` the moment its trajectory is graded (and the trajectory itself to
`trajectories.jsonl`), so a run killed midway loses only the trajectories in flight.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from rollout.evaluation.records import EvalRecord, ResultStore, latest_records, record_of
from rollout.runner import Runner
from rollout.trajectory import Task, Trajectory, write_jsonl

TRAJECTORIES_FILE = "trajectories.jsonl"
PREDICTIONS_DIR = "predictions"


class EvalJob(NamedTuple):
    benchmark: str
    task: Task
    sample: int


def pending_jobs(
    benchmarks: Mapping[str, Sequence[Task]], samples: int, done: Sequence[EvalRecord]
) -> list[EvalJob]:
    """The (benchmark, task, sample) jobs without a record yet, benchmark by benchmark."""
    finished = {record.key for record in done}
    return [
        EvalJob(benchmark, task, sample)
        for benchmark, tasks in benchmarks.items()
        for task in tasks
        for sample in range(samples)
        if (benchmark, task.task_id, sample) not in finished
    ]


async def evaluate(
    runner: Runner,
    jobs: Sequence[EvalJob],
    store: ResultStore,
    *,
    keep_trajectories: bool = True,
    show_progress: bool = False,
) -> list[EvalRecord]:
    """Run `jobs`, recording each as it finishes; returns their records in job order."""
    temperature = runner.sampling.temperature
    trajectories_path = store.run_dir / TRAJECTORIES_FILE
    records: list[EvalRecord | None] = [None] * len(jobs)

    def save(position: int, trajectory: Trajectory) -> None:
        if keep_trajectories:
            write_jsonl(trajectories_path, [trajectory])
        record = record_of(jobs[position].benchmark, trajectory, temperature)
        store.append([record])
        records[position] = record

    await runner.run_jobs(
        [(job.task, job.sample) for job in jobs],
        save,
        show_progress=show_progress,
        description="evaluating",
    )
    return [record for record in records if record is not None]


def write_predictions(records: Sequence[EvalRecord], run_dir: Path, model_name: str) -> list[Path]:
    """SWE-bench predictions (instance_id, model_name_or_path, model_patch), one JSONL per
    benchmark, sample 0 of each instance; an instance without a submission gets an empty
    patch (swebench's harness counts it as unresolved)."""
    by_benchmark: dict[str, list[dict[str, Any]]] = {}
    for record in latest_records(records):
        if record.sample != 0:
            continue
        by_benchmark.setdefault(record.benchmark, []).append(
            {
                "instance_id": record.instance_id,
                "model_name_or_path": model_name,
                "model_patch": record.answer or "",
            }
        )
    folder = run_dir / PREDICTIONS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for benchmark, rows in by_benchmark.items():
        path = folder / f"{benchmark}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        paths.append(path)
    return paths
