"""A W&B workspace and report for OPD runs: training dynamics, rollout health, cost.

The panels follow the training-dynamics table of the weekly SWE report (step, rollout and
train times, throughput, turns, tokens per turn, reverse KL) and DESIGN.md "Metrics".
`SECTIONS` is the one list of metric names: tests/test_dashboard.py checks that each one
is what the local loop and the slime hooks log.

Everything here builds offline: wandb-workspaces objects need only entity and project.
`to_json` gives the wire model `save` would send (a report's run sets name their project
but lack its internal id, which only the API knows). `publish` saves through the API and
needs WANDB_API_KEY.

wandb-workspaces (with wandb, about 1 s) is imported when something is built, so the CLI
(`opd dashboard`, launch/cli.py) can import this module's names at its top.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

if TYPE_CHECKING:
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    Dashboard: TypeAlias = ws.Workspace | wr.Report

DashboardKind: TypeAlias = Literal["workspace", "report", "both"]

DEFAULT_NAME = "OPD training"
DEFAULT_X_AXIS = "auto"
"""Each panel against the step its metric is logged with (`x_axis_of`); another name puts
every panel on that metric (e.g. `_step`, W&B's own counter)."""
STEP_METRICS = {"train/": "train/step", "eval/": "eval/step"}
"""slime's wandb.define_metric: train/* against train/step, eval/* against eval/step, every
other key (rollout/, perf/, multi_turn/, passrate/) against rollout/step. The local loop
logs the same step keys (slime_ext/local/wandb_log.py), so one dashboard reads both."""
ROLLOUT_STEP = "rollout/step"


def x_axis_of(key: str, x_axis: str = DEFAULT_X_AXIS) -> str:
    """The x metric of `key`'s panel: its step metric (auto), or the one asked for."""
    if x_axis != DEFAULT_X_AXIS:
        return x_axis
    steps = (step for prefix, step in STEP_METRICS.items() if key.startswith(prefix))
    return next(steps, ROLLOUT_STEP)


ABORT_COUNTS = "rollout/abort_count/"
"""A family: one key per abort reason (rollout/abort_count/<reason>), drawn in one panel."""

SANDBOX_HOST_LOAD = "rollout/sandbox_host_active/"
"""A family: the sandboxes in use on each sandbox host."""
SANDBOX_FAILURES = "rollout/sandbox_failures/"
"""A family: the fleet's infrastructure failures by kind (SandboxDiedError, ...)."""
FAMILY_TITLES = {
    ABORT_COUNTS: "rollout/abort_count by reason",
    SANDBOX_HOST_LOAD: "sandboxes in use by host",
    SANDBOX_FAILURES: "sandbox failures by kind",
}

SECTIONS: Mapping[str, tuple[str, ...]] = {
    "Training dynamics": (
        "perf/step_time",
        "perf/rollout_time",
        "perf/train_time",
        "perf/actor_train_time",
        "perf/effective_tokens_per_gpu_per_sec",
        "rollout/num_turns",
        "rollout/tokens_per_turn",
        "rollout/opd_reverse_kl",
        "rollout/student_gt_teacher_frac",
        "train/opd_reverse_kl",
        "train/loss",
    ),
    "Rollout health": (
        ABORT_COUNTS,
        "rollout/masked_turn_frac",
        "rollout/masked_turn_frac_tier1",
        "rollout/masked_turn_frac_tier2",
        "perf/sandbox_time_per_turn",
        "perf/teacher_time_per_turn",
        "perf/model_time_per_turn",
        "rollout/reward",
        "rollout/pass_rate",
    ),
    "Cost": ("perf/processed_tokens_per_loss_token",),
    "Sandboxes": (
        SANDBOX_HOST_LOAD,
        SANDBOX_FAILURES,
        "rollout/sandbox_warm_hit_rate",
        "rollout/sandbox_start_s_p50",
        "rollout/sandbox_start_s_p90",
        "rollout/sandbox_start_retries",
        "rollout/sandbox_breaker_opens",
    ),
}
"""Section title -> its metric keys, one line plot each; a key ending in "/" is a family."""

CLUSTER_ONLY = frozenset({"perf/actor_train_time"})
"""Keys slime logs itself (its actor's update time); the local loop has no such phase."""

SWE_ONLY = frozenset(SECTIONS["Sandboxes"])
"""The sandbox fleet's keys (slime_ext.job.sandboxes.fleet_metrics): SWE jobs only."""

API_KEY_ENV = "WANDB_API_KEY"


class MissingWandbKey(RuntimeError):
    """Saving to W&B was asked for without an API key."""


def family_regex(prefix: str) -> str:
    """The metric regex of a family's panel: every key under `prefix`."""
    return f"^{re.escape(prefix)}.+$"


def line_plot(key: str, x_axis: str = DEFAULT_X_AXIS) -> wr.LinePlot:
    """One metric against `x_axis`, or every metric of a family (key ending in "/")."""
    import wandb_workspaces.reports.v2 as wr

    x = x_axis_of(key, x_axis)
    if key.endswith("/"):
        return wr.LinePlot(title=FAMILY_TITLES[key], x=x, metric_regex=family_regex(key))
    return wr.LinePlot(title=key, x=x, y=[key])


def build_workspace(
    entity: str, project: str, name: str = DEFAULT_NAME, x_axis: str = DEFAULT_X_AXIS
) -> ws.Workspace:
    """A saved view of the project: one open section per entry of `SECTIONS`."""
    import wandb_workspaces.workspaces as ws

    sections = [
        ws.Section(name=title, panels=[line_plot(key, x_axis) for key in keys], is_open=True)
        for title, keys in SECTIONS.items()
    ]
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=sections,
        settings=ws.WorkspaceSettings(x_axis=x_axis_of("", x_axis)),
    )


def build_report(
    entity: str,
    project: str,
    title: str = DEFAULT_NAME,
    description: str = "",
    x_axis: str = DEFAULT_X_AXIS,
) -> wr.Report:
    """A report over the project's runs: per section, a heading and a panel grid."""
    import wandb_workspaces.reports.v2 as wr

    blocks: list[Any] = []
    for section, keys in SECTIONS.items():
        blocks.append(wr.H2(section))
        blocks.append(
            wr.PanelGrid(
                runsets=[wr.Runset(entity=entity, project=project)],
                panels=[line_plot(key, x_axis) for key in keys],
            )
        )
    return wr.Report(
        entity=entity, project=project, title=title, description=description, blocks=blocks
    )


def to_json(obj: Dashboard) -> dict[str, Any]:
    """The wire model of a workspace or report, built without the network."""
    import wandb_workspaces.reports.v2 as wr

    model = _offline_report_model(obj) if isinstance(obj, wr.Report) else obj._to_model()
    return dict(json.loads(model.model_dump_json(by_alias=True, exclude_none=True)))


def _offline_report_model(report: wr.Report) -> Any:
    """`Report._to_model` looks up each run set's project id through the API; serialize
    the run sets without a project, then name the project (entity and name, no id)."""
    import wandb_workspaces.reports.v2 as wr
    from wandb_workspaces.reports.v2 import internal as report_internal

    projects: list[tuple[str, str]] = []
    unresolved = copy.deepcopy(report)
    for block in unresolved.blocks:
        if isinstance(block, wr.PanelGrid):
            for runset in block.runsets:
                projects.append((runset.entity, runset.project))
                runset.entity, runset.project = "", ""
    model = unresolved._to_model()
    runset_models = [
        runset
        for block in model.spec.blocks
        if isinstance(block, report_internal.PanelGrid)
        for runset in block.metadata.run_sets
    ]
    for runset_model, (entity, project) in zip(runset_models, projects, strict=True):
        if entity and project:
            runset_model.project = report_internal.Project(entity_name=entity, name=project)
    return model


def publish(obj: Dashboard) -> Dashboard:
    """Save a workspace or report to W&B (the library prints its URL)."""
    require_api_key()
    obj.save()
    return obj


def require_api_key() -> None:
    if not os.environ.get(API_KEY_ENV):
        raise MissingWandbKey(
            f"saving to W&B needs {API_KEY_ENV} (a key from https://wandb.ai/authorize); "
            "pass --dry-run to build offline without saving"
        )


def panel_lines(x_axis: str = DEFAULT_X_AXIS) -> list[str]:
    """Each section's panels: the metric (or family) and its x axis."""
    lines = []
    for section, keys in SECTIONS.items():
        lines.append(f"  {section}:")
        for key in keys:
            shown = f"{key}* ({FAMILY_TITLES[key]})" if key.endswith("/") else key
            lines.append(f"    {shown}  vs {x_axis_of(key, x_axis)}")
    return lines


def summary(obj: Dashboard) -> str:
    """Its sections and panel counts, one line each."""
    import wandb_workspaces.reports.v2 as wr

    if isinstance(obj, wr.Report):
        head = f"report {obj.title!r} in {obj.entity}/{obj.project}"
        counts = _report_counts(obj)
    else:
        head = f"workspace {obj.name!r} in {obj.entity}/{obj.project}"
        counts = [(section.name, len(section.panels)) for section in obj.sections]
    total = sum(count for _, count in counts)
    lines = [f"{head}: {len(counts)} sections, {total} panels"]
    lines += [f"  {name}: {count} panel{'s' * (count != 1)}" for name, count in counts]
    return "\n".join(lines)


def _report_counts(report: wr.Report) -> list[tuple[str, int]]:
    import wandb_workspaces.reports.v2 as wr

    counts: list[tuple[str, int]] = []
    heading = ""
    for block in report.blocks:
        if isinstance(block, wr.H2):
            heading = str(block.text)
        elif isinstance(block, wr.PanelGrid):
            counts.append((heading, len(block.panels)))
    return counts


def dashboard(
    entity: str,
    project: str,
    kind: DashboardKind = "both",
    name: str = DEFAULT_NAME,
    dry_run: bool = False,
    out: Path | None = None,
    x_axis: str = DEFAULT_X_AXIS,
) -> str:
    """Build the workspace and/or report (`name` is the workspace's name and the report's
    title); write their JSON to `out` ({"workspace": ..., "report": ...}) if given; save
    them unless `dry_run`. Returns what to show the user."""
    if not dry_run:
        require_api_key()  # before building or writing anything
    built: dict[str, Dashboard] = {}
    if kind in ("workspace", "both"):
        built["workspace"] = build_workspace(entity, project, name, x_axis)
    if kind in ("report", "both"):
        built["report"] = build_report(entity, project, name, x_axis=x_axis)
    lines = [summary(obj) for obj in built.values()]
    if dry_run:
        lines += ["panels (metric vs x axis):", *panel_lines(x_axis)]
    if out is not None:
        payload = {label: to_json(obj) for label, obj in built.items()}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2) + "\n")
        lines.append(f"wrote {out}")
    if dry_run:
        lines.append("dry run: nothing saved to W&B")
    else:
        for obj in built.values():
            publish(obj)
        lines.append(f"saved {' and '.join(built)} to W&B")
    return "\n".join(lines)
