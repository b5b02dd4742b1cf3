"""The W&B dashboard: built offline with the wandb-workspaces object model, and every
metric it plots is a key our code logs."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import wandb
import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws
from rich.console import Console

from launch.dashboard import (
    ABORT_COUNTS,
    API_KEY_ENV,
    CLUSTER_ONLY,
    FAMILY_TITLES,
    SECTIONS,
    SWE_ONLY,
    MissingWandbKey,
    build_report,
    build_workspace,
    dashboard,
    family_regex,
    publish,
    x_axis_of,
)
from rollout.chat import ChatRenderer
from rollout.harness.tir import TIRHarness
from rollout.infra_watch import InfrastructureWatch
from rollout.runner import Runner, RunnerConfig
from rollout.trajectory import Task, Trajectory, TrajectoryStatus
from slime_ext.job.config import JobConfig
from slime_ext.local.loop import LocalRun
from slime_ext.local.progress import TrainingReport
from slime_ext.local.trainer import LocalTrainer, TrainerConfig
from slime_ext.models.factory import build_model
from slime_ext.slime import loss as slime_loss
from slime_ext.slime.metrics import sample_metrics
from slime_ext.slime.samples import FLEET_STATS_KEY, to_samples
from tests.slime_driver import sample_class
from tests.test_runner import REPLIES, TASKS, ScriptedPolicy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ENTITY, PROJECT = "opd-team", "swe-opd"
KEYS = [key for keys in SECTIONS.values() for key in keys]
ABORT_REASON = "SandboxDiedError: x"


@pytest.fixture(autouse=True)
def no_wandb_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building and serializing must not reach W&B: any API client fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the W&B API was called")

    monkeypatch.setattr(wandb, "Api", refuse)


def _plotted(panel: Any, x_axis: str | None = None) -> str:
    """The metric key a line plot draws (a family's prefix for a regex), checked against
    `x_axis`, or by default against the step slime logs that metric with."""
    assert isinstance(panel, wr.LinePlot)
    if panel.metric_regex is not None:
        assert panel.y == []
        families = [key for key in FAMILY_TITLES if panel.metric_regex == family_regex(key)]
        key = families[0] if families else "?"
    else:
        [key] = panel.y
    slimes = "train/step" if str(key).startswith("train/") else "rollout/step"
    assert panel.x == (x_axis or slimes), (key, panel.x)
    return str(key)


def test_each_panel_is_drawn_against_the_step_slime_logs_its_metric_with() -> None:
    """slime defines train/* against train/step and rollout/, perf/ against rollout/step
    (its wandb_utils); W&B's _step counts every log call of any rank, so it is no axis for
    a cluster run. The local loop logs the same step keys."""
    import importlib.util

    spec = importlib.util.find_spec("slime")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("slime is not installed (make slime)")
    package = Path(next(iter(spec.submodule_search_locations)))
    source = (package / "observability/wandb_utils.py").read_text()
    for prefix, step in [
        ("train/*", "train/step"),
        ("rollout/*", "rollout/step"),
        ("perf/*", "rollout/step"),
    ]:
        assert f'wandb.define_metric("{prefix}", step_metric="{step}")' in source
    assert x_axis_of("train/loss") == "train/step" and x_axis_of("perf/step_time") == "rollout/step"
    assert x_axis_of("train/loss", "_step") == "_step"
    workspace = build_workspace(ENTITY, PROJECT)
    assert workspace.settings.x_axis == "rollout/step"
    panels = [panel for section in workspace.sections for panel in section.panels]
    assert {panel.x for panel in panels} == {"train/step", "rollout/step"}
    listed = dashboard(ENTITY, PROJECT, "workspace", dry_run=True)  # what --dry-run prints
    assert "    train/loss  vs train/step" in listed.splitlines()
    assert f"    {ABORT_COUNTS}* (rollout/abort_count by reason)  vs rollout/step" in listed


def test_workspace_has_every_section_and_panel_with_its_metric_key() -> None:
    workspace = build_workspace(ENTITY, PROJECT, "OPD vs OPSD", x_axis="rollout/step")
    assert (workspace.entity, workspace.project, workspace.name) == (
        ENTITY,
        PROJECT,
        "OPD vs OPSD",
    )
    assert [section.name for section in workspace.sections] == list(SECTIONS)
    for section in workspace.sections:
        keys = [_plotted(panel, "rollout/step") for panel in section.panels]
        assert keys == list(SECTIONS[section.name])
    assert workspace.settings.x_axis == "rollout/step"


def test_report_has_a_heading_and_panel_grid_per_section_over_the_projects_runs() -> None:
    report = build_report(ENTITY, PROJECT, "Week 12", description="OPD against OPSD")
    assert (report.entity, report.project, report.title) == (ENTITY, PROJECT, "Week 12")
    assert report.description == "OPD against OPSD"
    headings = [block for block in report.blocks[0::2] if isinstance(block, wr.H2)]
    grids = [block for block in report.blocks[1::2] if isinstance(block, wr.PanelGrid)]
    assert len(report.blocks) == len(headings) + len(grids)
    assert [heading.text for heading in headings] == list(SECTIONS)
    for grid, keys in zip(grids, SECTIONS.values(), strict=True):
        assert [(rs.entity, rs.project) for rs in grid.runsets] == [(ENTITY, PROJECT)]
        assert [_plotted(panel) for panel in grid.panels] == list(keys)


def test_panels_cover_the_weekly_reports_training_dynamics_table() -> None:
    table = [
        "perf/step_time",
        "perf/rollout_time",
        "perf/train_time",
        "perf/actor_train_time",
        "perf/effective_tokens_per_gpu_per_sec",
        "rollout/num_turns",
        "rollout/tokens_per_turn",
        "rollout/opd_reverse_kl",
        "rollout/student_gt_teacher_frac",
    ]
    assert list(SECTIONS["Training dynamics"][: len(table)]) == table
    assert len(KEYS) == len(set(KEYS))


def _workspace_panels(view: dict[str, Any]) -> dict[str, list[str]]:
    sections = view["spec"]["section"]["panelBankConfig"]["sections"]
    return {section["name"]: [_json_key(p) for p in section["panels"]] for section in sections}


def _report_panels(report: dict[str, Any]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    heading = ""
    for block in report["spec"]["blocks"]:
        if block["type"] == "heading":
            heading = block["children"][0]["text"]
        elif block["type"] == "panel-grid":
            for runset in block["metadata"]["runSets"]:
                assert runset["project"] == {"name": PROJECT, "entityName": ENTITY}
            panels = block["metadata"]["panelBankSectionConfig"]["panels"]
            found[heading] = [_json_key(p) for p in panels]
    return found


def _json_key(panel: dict[str, Any]) -> str:
    config = panel["config"]
    assert panel["viewType"] == "Run History Line Plot"
    assert config["xAxis"] == "rollout/step"
    if config.get("useMetricRegex"):
        [family] = [key for key in FAMILY_TITLES if config["metricRegex"] == family_regex(key)]
        return family
    [key] = config["metrics"]
    return str(key)


def test_dry_run_writes_the_serialized_workspace_and_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    out = tmp_path / "dash" / "opd.json"
    text = dashboard(ENTITY, PROJECT, "both", "OPD", True, out, x_axis="rollout/step")
    payload = json.loads(out.read_text())
    assert set(payload) == {"workspace", "report"}
    view, report = payload["workspace"], payload["report"]
    assert (view["entity"], view["project"], view["displayName"]) == (ENTITY, PROJECT, "OPD")
    assert report["project"] == {"name": PROJECT, "entityName": ENTITY}
    assert report["displayName"] == "OPD"
    expected = {title: list(keys) for title, keys in SECTIONS.items()}
    assert _workspace_panels(view) == expected
    assert _report_panels(report) == expected
    assert "nothing saved" in text and str(out) in text


@pytest.mark.parametrize("kind", ["workspace", "report"])
def test_dry_run_summary_counts_sections_and_panels_of_what_was_asked(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    text = dashboard(ENTITY, PROJECT, kind, "OPD", True, None)  # type: ignore[arg-type]
    other = "report" if kind == "workspace" else "workspace"
    assert text.startswith(
        f"{kind} 'OPD' in {ENTITY}/{PROJECT}: {len(SECTIONS)} sections, {len(KEYS)} panels"
    )
    assert other not in text
    for title, keys in SECTIONS.items():
        assert f"  {title}: {len(keys)} panel" in text
    assert list(tmp_path.iterdir()) == []


def test_saving_without_an_api_key_names_the_variable_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    out = tmp_path / "opd.json"
    with pytest.raises(MissingWandbKey, match=f"{API_KEY_ENV}.*--dry-run"):
        dashboard(ENTITY, PROJECT, "both", "OPD", False, out)
    assert not out.exists()
    with pytest.raises(MissingWandbKey):
        publish(build_workspace(ENTITY, PROJECT))


def test_saving_with_a_key_saves_each_built_object(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "k" * 40)
    saved: list[Any] = []
    monkeypatch.setattr(ws.Workspace, "save", lambda self: saved.append(self))
    monkeypatch.setattr(wr.Report, "save", lambda self, **_: saved.append(self))
    text = dashboard(ENTITY, PROJECT, "both", "OPD", False, None)
    assert [type(obj) for obj in saved] == [ws.Workspace, wr.Report]
    assert all((obj.entity, obj.project) == (ENTITY, PROJECT) for obj in saved)
    assert "saved workspace and report" in text


# Metric names: what the dashboard plots is what the code logs.


def _logs(key: str, logged: dict[str, float]) -> bool:
    if key.endswith("/"):
        return any(re.fullmatch(family_regex(key), name) for name in logged)
    return key in logged


class ReplayRunner:
    """Stands in for the runner in the local loop: returns given trajectories."""

    def __init__(self, trajectories: list[Trajectory]) -> None:
        self.trajectories = trajectories

    async def run(
        self, tasks: Sequence[Task], samples_per_task: int = 1, rollout_step: int | None = None
    ) -> list[Trajectory]:
        return [t.model_copy(deep=True) for t in self.trajectories]


@pytest.fixture(scope="module")
def rollouts(factory_tokenizer: Any) -> list[Trajectory]:
    """Real rollouts of scripted replies, teacher-scored, the last one aborted."""
    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    runner = Runner(harness, ScriptedPolicy(renderer, REPLIES), renderer, RunnerConfig())
    trajectories = asyncio.run(runner.run(TASKS))
    for trajectory in trajectories:  # as if a teacher had scored every span
        for turn in trajectory.turns:
            turn.teacher_logprobs = [-1.0 - 0.01 * i for i in range(len(turn.span_ids))]
    trajectories[-1] = trajectories[-1].model_copy(
        update={"status": TrajectoryStatus.SANDBOX_ERROR, "status_reason": ABORT_REASON}
    )
    return trajectories


def test_local_loop_logs_every_plotted_metric_but_slimes_own(
    rollouts: list[Trajectory], factory_tokenizer: Any, tmp_path: Path
) -> None:
    run = LocalRun.__new__(LocalRun)  # the loop's step, without checkpoints or a policy
    run.job = JobConfig()
    run.run_dir = tmp_path
    run.step = 0
    run.hints = None
    run.reminders = None
    run._sandboxes = None
    run._infra_watch = InfrastructureWatch()
    model = build_model("qwen3-tiny", factory_tokenizer, seed=2)
    run.trainer = LocalTrainer(model, TrainerConfig())
    (tmp_path / "trajectories").mkdir()
    report = TrainingReport(Console(file=io.StringIO()), "opd", 0, 1)
    step = run._one_step(ReplayRunner(rollouts), TASKS, "opd", report, None)  # type: ignore[arg-type]
    metrics = asyncio.run(step)
    assert set(KEYS) >= CLUSTER_ONLY
    local_tir = [key for key in KEYS if key not in CLUSTER_ONLY | SWE_ONLY]
    missing = [key for key in local_tir if not _logs(key, metrics)]
    assert missing == []
    assert metrics[f"{ABORT_COUNTS}{ABORT_REASON}"] == 1.0


@pytest.fixture(scope="module")
def fleet_stats() -> dict[str, float]:
    """What a SWE job's generate hook puts on its trajectories: fleet_metrics of a real
    fleet that ran a sandbox (a failure added: a healthy run has none to plot)."""
    from slime_ext.job.config import SandboxConfig
    from slime_ext.job.sandboxes import JobSandboxes, fleet_metrics

    async def go() -> dict[str, Any]:
        async with JobSandboxes(SandboxConfig(backend="local"), f"dash-{os.getpid()}") as boxes:
            async with boxes.sandbox(None) as sandbox:
                await sandbox.exec("true", 10)
            return boxes.metrics()

    fleet = asyncio.run(go())
    fleet["failures_by_kind"] = {"SandboxDiedError": 1}
    stats = fleet_metrics(fleet)
    assert stats["rollout/sandbox_host_active/here-local"] == 0.0
    assert stats["rollout/sandbox_acquired"] == 1.0
    return stats


def test_slime_hooks_log_every_plotted_rollout_metric(
    rollouts: list[Trajectory], fleet_stats: dict[str, float]
) -> None:
    swe = [t.model_copy(deep=True) for t in rollouts]
    earlier = {**fleet_stats, "rollout/sandbox_acquired": 0.0, "rollout/sandbox_start_retries": 9.0}
    swe[0].metadata[FLEET_STATS_KEY] = earlier
    swe[1].metadata[FLEET_STATS_KEY] = fleet_stats
    samples = [
        sample
        for index, trajectory in enumerate(swe)
        for sample in to_samples(trajectory, sample_class()(index=index, prompt="p"), "kl")
    ]
    metrics = sample_metrics(samples)
    assert metrics["rollout/sandbox_start_retries"] == fleet_stats["rollout/sandbox_start_retries"]
    from_hook = [k for k in KEYS if k.startswith("rollout/") or k.endswith("_per_turn")]
    assert [key for key in from_hook if not _logs(key, metrics)] == []
    # the custom loss's metrics, which slime logs under train/
    assert {key.removeprefix("train/") for key in KEYS if key.startswith("train/")} <= set(
        slime_loss.METRICS
    )


def test_abort_panel_regex_takes_every_reason_and_nothing_else() -> None:
    pattern = re.compile(family_regex(ABORT_COUNTS))
    assert pattern.fullmatch(f"{ABORT_COUNTS}{ABORT_REASON}")
    assert pattern.fullmatch(f"{ABORT_COUNTS}max turns")
    assert not pattern.fullmatch(ABORT_COUNTS)
    assert not pattern.fullmatch("rollout/abort_counts")
    assert not any(pattern.fullmatch(key) for key in KEYS)


def test_opd_dashboard_command_dry_run_writes_json(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from launch.cli import app

    out = tmp_path / "dash.json"
    result = CliRunner().invoke(
        app, ["dashboard", "--entity", "me", "--project", "p", "--dry-run", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert set(json.loads(out.read_text())) == {"workspace", "report"}
    refused = CliRunner(env={"WANDB_API_KEY": ""}).invoke(
        app, ["dashboard", "--entity", "me", "--project", "p"]
    )
    assert refused.exit_code == 2 and "WANDB_API_KEY" in refused.output
