"""A run (`opd eval`'s --out directory, or a swebench harness report) as the outcomes a
paired comparison reads.

Per benchmark, each instance's first sample (sample 0) decides solved, as pass@1 does.
The headline is the run's report.json (what its report told readers), when there is one;
the records are counted from results.jsonl as written, so an instance recorded twice (a
results file concatenated from two runs) shows up as a duplicate instead of vanishing.

A swebench harness report (the JSON `python -m swebench.harness.run_evaluation` writes:
resolved_ids, submitted_ids, total_instances, ...) is one benchmark: `name=report.json`
names it (default: the file's stem); its instances are the submitted ones, its headline
resolved_instances of total_instances, as swebench scores it. Comparing a run with the
swebench report of its own predictions checks our grading against the official harness.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

from rollout.evaluation.compare import ReportedScore, RunOutcomes
from rollout.evaluation.records import EvalResultsError, ResultStore
from rollout.evaluation.scores import ALL_BENCHMARKS

REPORT_FILE = "report.json"


def load_run(spec: str) -> RunOutcomes:
    """A run directory, a swebench report file, or `name=report.json`."""
    name, sep, source = spec.partition("=")
    if sep and name and "/" not in name:
        return swebench_report_outcomes(Path(source), name)
    path = Path(spec)
    if path.is_file():
        return swebench_report_outcomes(path, path.stem)
    return run_outcomes(path)


def swebench_report_outcomes(path: Path, benchmark: str) -> RunOutcomes:
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        resolved = set(report["resolved_ids"])
        submitted = list(report["submitted_ids"])
        total = int(report["total_instances"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise EvalResultsError(
            f"{path} is not a swebench harness report (resolved_ids, submitted_ids, "
            f"total_instances): {err}"
        ) from err
    duplicates = sorted(i for i, count in Counter(submitted).items() if count > 1)
    return RunOutcomes(
        name=f"{path.stem} (swebench)",
        solved={benchmark: {i: i in resolved for i in submitted}},
        reported={benchmark: ReportedScore(solved=len(resolved), total=total)},
        duplicates={benchmark: duplicates} if duplicates else {},
    )


def run_outcomes(run_dir: Path, name: str | None = None) -> RunOutcomes:
    store = ResultStore(run_dir)
    store.settings()  # refuses a directory that is not an evaluation run
    records = [r for r in store.read() if r.sample == 0]
    solved: dict[str, dict[str, bool]] = defaultdict(dict)
    seen: Counter[tuple[str, str]] = Counter()
    for record in records:
        seen[(record.benchmark, record.instance_id)] += 1
        solved[record.benchmark][record.instance_id] = record.solved
    duplicates: dict[str, list[str]] = defaultdict(list)
    for (benchmark, instance_id), count in seen.items():
        if count > 1:
            duplicates[benchmark].append(instance_id)
    return RunOutcomes(
        name=name or run_dir.name,
        solved=dict(solved),
        reported=_reported(run_dir / REPORT_FILE),
        duplicates=dict(duplicates),
    )


def _reported(path: Path) -> dict[str, ReportedScore]:
    """The report's headline per benchmark (single-sample reports only: with k samples the
    report's rate is avg@k, not a count of solved instances)."""
    if not path.is_file():
        return {}
    report = json.loads(path.read_text(encoding="utf-8"))
    return {
        row["benchmark"]: ReportedScore(solved=row["solved"], total=row["trajectories"])
        for row in report.get("scores", [])
        if row["benchmark"] != ALL_BENCHMARKS and row.get("samples", 1) == 1
    }
