"""Reports of evaluations, comparisons and sweeps: markdown + JSON + a PNG plot in the run
directory, and the same tables in W&B when W&B is on.

A benchmark where nothing could be graded (every trajectory aborted) has no rate: its
cells say n/a, not 0.0%.

W&B: `wandb_mode` "disabled" (or WANDB_MODE=disabled) writes nothing; "offline" (the
default: no API key needed) keeps the run under <dir>/wandb for `wandb sync`; "online"
sends it. Each report is one W&B run (job_type "eval") whose tables are W&B Tables.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from rollout.evaluation.records import EvalRecord
from rollout.evaluation.scores import BenchmarkScore

WandbMode = Literal["offline", "online", "disabled"]
REPORT_STEM = "report"
NOT_GRADED = "n/a"

Table = tuple[list[str], list[list[Any]]]
"""(columns, rows)."""


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ci(interval: tuple[float, float]) -> str:
    return f"[{100 * interval[0]:.1f}, {100 * interval[1]:.1f}]"


def nothing_graded(score: BenchmarkScore) -> bool:
    """Every trajectory aborted: no rate can be given (n/a)."""
    return score.aborts == score.trajectories


def rate_cells(score: BenchmarkScore) -> tuple[str, str, str, str]:
    """(pass rate, its 95% CI, net pass rate, its CI) as shown; n/a when nothing was graded."""
    if nothing_graded(score):
        return (NOT_GRADED,) * 4
    return (
        _pct(score.pass_at_1),
        _ci(score.interval),
        _pct(score.net_pass_at_1),
        _ci(score.net_interval),
    )


def swe_table(scores: Sequence[BenchmarkScore]) -> Table:
    """The reference report's table: pass rate and net pass rate (infrastructure aborts
    excluded), with Wilson 95% intervals, average turns, aborts, timeouts."""
    columns = [
        "Benchmark",
        "Instances",
        "Resolved",
        "Pass rate",
        "95% CI",
        "Net pass rate",
        "Net 95% CI",
        "Avg. turns",
        "Aborts",
        "Timeouts",
        "Step limit",
    ]
    rows = [
        [
            s.benchmark,
            s.problems,
            s.solved,
            *rate_cells(s),
            f"{s.avg_turns:.1f}",
            s.aborts,
            s.timeouts,
            s.step_limited,
        ]
        for s in scores
    ]
    return columns, rows


def math_table(scores: Sequence[BenchmarkScore]) -> Table:
    """avg@k and pass@k per dataset and averaged, with how often the tool was called."""
    k = max((s.samples for s in scores), default=1)
    columns = [
        "Dataset",
        "Problems",
        f"avg@{k}",
        "95% CI",
        f"pass@{k}",
        "Tool use",
        "Pass w/ tool",
        "Pass w/o tool",
        "Avg. turns",
        "Aborts",
        "Timeouts",
    ]
    rows = [
        [
            s.benchmark,
            s.problems,
            *rate_cells(s)[:2],
            NOT_GRADED if nothing_graded(s) else _pct(s.pass_at_k),
            _pct(s.tool_use_frac),
            _pct(s.pass_with_tools),
            _pct(s.pass_without_tools),
            f"{s.avg_turns:.1f}",
            s.aborts,
            s.timeouts,
        ]
        for s in scores
    ]
    return columns, rows


def instances_summary(records: Sequence[EvalRecord]) -> list[dict[str, Any]]:
    """Each SWE record's outcome, its FAIL_TO_PASS / PASS_TO_PASS counts and where its
    grade's files are (report.json, test_output.txt, patch.diff), for report.json."""
    return [
        {
            "benchmark": r.benchmark,
            "instance_id": r.instance_id,
            "sample": r.sample,
            "resolved": r.solved,
            "outcome": r.outcome,
            "reason": r.reason,
            "tests": r.details.get("tests"),
            "files_dir": r.details.get("files_dir"),
        }
        for r in sorted(records, key=lambda r: r.key)
    ]


def instances_markdown(records: Sequence[EvalRecord]) -> str:
    """One line per SWE record: resolved, tests passed of FAIL_TO_PASS / PASS_TO_PASS,
    why, and a link to its grade's files."""
    columns = ["Benchmark", "Instance", "Resolved", "FAIL_TO_PASS", "PASS_TO_PASS", "Reason"]
    rows = []
    for r in sorted(records, key=lambda r: r.key):
        tests = r.details.get("tests") or {}
        counts = [_passed_of(tests.get(name)) for name in ("FAIL_TO_PASS", "PASS_TO_PASS")]
        files_dir = r.details.get("files_dir")
        name = r.instance_id if r.sample == 0 else f"{r.instance_id} #{r.sample}"
        instance = f"[{name}]({files_dir})" if files_dir else name
        reason = " ".join(r.reason.split()).replace("|", "\\|")
        reason = reason if len(reason) <= 160 else reason[:157] + "..."
        resolved = "yes" if r.solved else ("aborted" if r.outcome == "aborted" else "no")
        rows.append([r.benchmark, instance, resolved, *counts, reason])
    intro = (
        "Each instance's grade is in its folder (the link): report.json (FAIL_TO_PASS / "
        "PASS_TO_PASS tests that passed and failed, every test's status), test_output.txt "
        "(the grader's log), patch.diff (the submission). Tests: passed/total."
    )
    return intro + "\n\n" + markdown_table((columns, rows))


def _passed_of(counts: Any) -> str:
    if not isinstance(counts, dict):
        return "-"
    passed, failed = int(counts.get("passed", 0)), int(counts.get("failed", 0))
    return f"{passed}/{passed + failed}"


def markdown_table(table: Table) -> str:
    columns, rows = table
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def settings_markdown(settings: Mapping[str, Any]) -> str:
    return "\n".join(f"- {key}: `{json.dumps(value)}`" for key, value in settings.items())


def write_report(
    out_dir: Path,
    title: str,
    sections: Sequence[tuple[str, str]],
    data: BaseModel | Mapping[str, Any],
    plot: Any | None = None,
) -> list[Path]:
    """report.md (title, then each (heading, markdown body)), report.json (`data`) and,
    when given a matplotlib figure, report.png; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"{REPORT_STEM}.md"
    body = [f"# {title}", ""]
    for heading, text in sections:
        body += [f"## {heading}", "", text, ""]
    if plot is not None:
        body += [f"![plot]({REPORT_STEM}.png)", ""]
    md.write_text("\n".join(body), encoding="utf-8")
    payload = data.model_dump(mode="json") if isinstance(data, BaseModel) else dict(data)
    js = out_dir / f"{REPORT_STEM}.json"
    js.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    written = [md, js]
    if plot is not None:
        import matplotlib.pyplot as plt

        png = out_dir / f"{REPORT_STEM}.png"
        plot.savefig(png, dpi=120, bbox_inches="tight")
        plt.close(plot)
        written.append(png)
    return written


def scores_plot(scores: Sequence[BenchmarkScore], title: str, metric_name: str) -> Any:
    """Bars of pass@1 (and the net rate) per benchmark with their 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(max(4.0, 1.6 * len(scores) + 2), 3.6))
    positions = list(range(len(scores)))
    width = 0.38
    for offset, label, values, intervals in (
        (-width / 2, metric_name, [s.pass_at_1 for s in scores], [s.interval for s in scores]),
        (
            width / 2,
            "net (aborts excluded)",
            [s.net_pass_at_1 for s in scores],
            [s.net_interval for s in scores],
        ),
    ):
        errors = [
            [100 * (v - low) for v, (low, _) in zip(values, intervals, strict=True)],
            [100 * (high - v) for v, (_, high) in zip(values, intervals, strict=True)],
        ]
        axis.bar(
            [p + offset for p in positions],
            [100 * v for v in values],
            width,
            yerr=errors,
            capsize=3,
            label=label,
        )
    for position, s in zip(positions, scores, strict=True):
        if nothing_graded(s):
            axis.text(position, 2, NOT_GRADED, ha="center", va="bottom")
    axis.set_xticks(positions, [s.benchmark for s in scores])
    axis.set_ylabel("% solved (95% CI)")
    axis.set_ylim(0, 100)
    axis.set_title(title)
    axis.legend(fontsize=8)
    return figure


def log_to_wandb(
    mode: WandbMode,
    project: str,
    name: str,
    out_dir: Path,
    tables: Mapping[str, Table],
    config: Mapping[str, Any],
    image: Path | None = None,
    entity: str | None = None,
) -> str | None:
    """One W&B run holding `tables` (and the plot); returns its id, or None when off."""
    if mode == "disabled" or os.environ.get("WANDB_MODE") == "disabled":
        return None
    import wandb

    run = wandb.init(
        project=project,
        entity=entity,
        name=name,
        job_type="eval",
        mode=mode,
        dir=str(out_dir),
        config=dict(config),
        reinit="create_new",
    )
    try:
        logged: dict[str, Any] = {
            key: wandb.Table(
                columns=list[str | int](columns), data=[[str(c) for c in row] for row in rows]
            )
            for key, (columns, rows) in tables.items()
        }
        if image is not None and image.is_file():
            logged["eval/plot"] = wandb.Image(str(image))
        run.log(logged)
        run_id: str = run.id
    finally:
        run.finish()
    return run_id
