"""Run a policy over benchmarks and keep one graded record per trajectory as it finishes.

`evaluate` skips what the run directory already holds (resume), runs the rest through the
runner (`concurrency` trajectories at once, a progress bar), appends each record to
`results.jsonl` the moment its trajectory is graded (and the trajectory itself to
`trajectories.jsonl`), so a run killed midway loses only the trajectories in flight.
Files an episode reports (`details()["files"]`: name -> text, e.g. a SWE grade's test
log) go to `instances/<benchmark>/<instance_id>/` instead of the JSONL files; the
record keeps that folder as `details["files_dir"]`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from rollout.evaluation.records import EvalRecord, ResultStore, latest_records, record_of
from rollout.runner import Runner
from rollout.trajectory import Task, Trajectory, write_jsonl

TRAJECTORIES_FILE = "trajectories.jsonl"
PREDICTIONS_DIR = "predictions"
INSTANCES_DIR = "instances"
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._+=@-]")


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
        file_episode_files(store.run_dir, jobs[position], trajectory)
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


def instance_dir(benchmark: str, instance_id: str, sample: int) -> Path:
    """Where an instance's files go, relative to the run directory (sample k > 0:
    `<instance_id>.sample<k>`); names are kept to characters safe in a path."""
    name = instance_id if sample == 0 else f"{instance_id}.sample{sample}"
    parts = [_UNSAFE_NAME.sub("_", part).lstrip(".") or "_" for part in (benchmark, name)]
    return Path(INSTANCES_DIR, *parts)


def file_episode_files(run_dir: Path, job: EvalJob, trajectory: Trajectory) -> None:
    """Write the files in the trajectory's `metadata["episode"]["files"]` to the job's
    instance folder, leaving that folder (relative) as `files_dir` in their place."""
    episode = (trajectory.metadata or {}).get("episode")
    if not isinstance(episode, dict) or not isinstance(episode.get("files"), dict):
        return
    files: dict[str, str] = episode.pop("files")
    relative = instance_dir(job.benchmark, job.task.task_id, job.sample)
    folder = run_dir / relative
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.iterdir():  # a re-run instance: none of an earlier grade's files
        if stale.is_file():
            stale.unlink()
    for name, text in files.items():
        (folder / Path(name).name).write_text(text, encoding="utf-8", errors="replace")
    episode["files_dir"] = relative.as_posix()


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
