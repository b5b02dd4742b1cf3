"""The SWE demo's pieces: mini-SWE's worked scripts (the SWE models' training traces) run
for real through the swe harness, the agent metrics of a step, the bundled SWE models, and
`opd demo swe` at a tiny scale, in local sandboxes and (where a daemon answers) Docker
ones, and what `opd demo --sandbox` refuses before any model loads (the full demo, ~12
minutes, is not run by CI)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner, Result

from launch.cli import app
from rollout.chat import ChatRenderer
from rollout.harness.swe import SWEHarness, SWEHarnessConfig
from rollout.runner import summary_metrics
from rollout.tasks import mini_swe
from rollout.trajectory import MaskTier, TrajectoryStatus
from sandbox.docker import OWNER_LABEL, docker_client
from slime_ext.job.sandboxes import run_owner
from slime_ext.local import opd_demo
from slime_ext.local.demo_models import DemoModelsRecipe, worked_trajectories
from slime_ext.local.progress import agent_fields
from slime_ext.models.refs import ModelRefError, bundled_models, resolve_model
from tests.docker_images import daemon_problem, swe_base_test_image

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MODULE = '''def mean(values):
    """Mean, or 0.0 when empty."""
    return sum(values) / len(values)


def head(values, count):
    return sum(values[:count - 1])
'''


def _sed(tmp_path: Path, command: str, text: str) -> str:
    (tmp_path / "m.py").write_text(text)
    subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True)
    return (tmp_path / "m.py").read_text()


@pytest.mark.parametrize(
    "new",
    [
        MODULE.replace("values[:count - 1]", "values[:count]"),  # a line replaced
        MODULE.replace(
            "    return sum(values) /",
            "    if not values:\n        return 0.0\n    return sum(values) /",
        ),  # lines inserted
        MODULE.replace("values[:count - 1]", r"values[:count] & 1 | 2 \ 3"),  # sed's specials
    ],
    ids=["replace", "insert", "specials"],
)
def test_line_edit_command_turns_the_old_text_into_the_new_with_real_sed(
    tmp_path: Path, new: str
) -> None:
    command = mini_swe.line_edit_command("m.py", MODULE, new)
    assert _sed(tmp_path, command, MODULE) == new


def test_line_edit_command_refuses_what_one_line_edit_cannot_write() -> None:
    two_places = MODULE.replace("sum(values)", "total(values)").replace("count - 1", "count")
    with pytest.raises(ValueError, match="2 changed places"):
        mini_swe.line_edit_command("m.py", MODULE, two_places)
    with pytest.raises(ValueError, match="single quote"):
        mini_swe.line_edit_command("m.py", MODULE, MODULE.replace("count - 1", "'x'"))
    with pytest.raises(ValueError, match="not a line edit"):
        mini_swe.line_edit_command("m.py", MODULE, MODULE.replace("def head(values, count):\n", ""))


def test_every_task_carries_its_example_module_and_fix() -> None:
    for task in mini_swe.generate_tasks(10, seed=3):
        spec = mini_swe.spec_of(task)
        assert spec.example is not None and f"`{spec.example}`" in task.prompt
        assert spec.module_path in spec.files and spec.fix_command is not None
        assert spec.module_path in spec.reference_patch.splitlines()[0]


@pytest.mark.timeout(120)
def test_worked_scripts_resolve_every_family_in_real_sandboxes(factory_tokenizer: Any) -> None:
    harness = SWEHarness(SWEHarnessConfig(step_limit=10, command_timeout_s=30))
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    families = mini_swe.family_names()
    trajectories = worked_trajectories(renderer, harness, len(families), seed=5, concurrency=2)
    assert [mini_swe.spec_of(t.task).family for t in trajectories] == families
    for trajectory in trajectories:
        assert trajectory.reward == 1.0 and trajectory.status is TrajectoryStatus.COMPLETED
        assert [t.mask_tier for t in trajectory.turns] == [MaskTier.VALID] * 8
        text = factory_tokenizer.decode(trajectory.trunk_ids)
        example = mini_swe.spec_of(trajectory.task).example
        assert text.count(f"print({example})") == 2  # reproduced before and after the edit
        # the observations name no sandbox slot and no timing: a function of the task alone
        assert "/sandbox/repo" in text or "Traceback" not in text
        assert "passed in" not in text and "opd-sandbox" not in text


def test_worked_trajectories_refuse_a_script_that_does_not_resolve(
    factory_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = SWEHarness(SWEHarnessConfig(step_limit=10, command_timeout_s=30))
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    unfixed = mini_swe.worked_script

    def without_the_edit(task: Any) -> Any:
        script = unfixed(task)
        return [*script[:4], *script[5:]]

    monkeypatch.setattr(mini_swe, "worked_script", without_the_edit)
    with pytest.raises(RuntimeError, match="1 of 1 worked scripts did not resolve"):
        worked_trajectories(renderer, harness, 1, seed=5)


def _summary(reason: str, tiers: list[int], status: str = "completed") -> dict[str, Any]:
    return {
        "status": status,
        "status_reason": reason,
        "reward": 1.0 if reason == "submitted" else 0.0,
        "num_turns": len(tiers),
        "span_tokens": [10] * len(tiers),
        "mask_tiers": tiers,
        "model_s": [0.0] * len(tiers),
        "sandbox_s": [0.0] * len(tiers),
        "teacher_s": [0.0] * len(tiers),
    }


def test_agent_metrics_count_valid_calls_submissions_and_aborts() -> None:
    metrics = summary_metrics(
        [
            _summary("submitted", [0, 0, 1, 0]),
            _summary("step limit: 4 steps without submit", [1, 1, 2, 0], status="truncated"),
            _summary("sandbox_error: gone", [0], status="sandbox_error"),
        ]
    )
    assert metrics["rollout/valid_action_frac"] == pytest.approx(6 / 9)  # tier 2 parsed
    assert metrics["rollout/submitted_frac"] == pytest.approx(1 / 3)
    assert metrics["rollout/num_turns"] == pytest.approx(3)
    fields = agent_fields("opd", {**metrics, "rollout/student_gt_teacher_frac": 0.25})
    assert fields == [
        "turns 3.0",
        "tok/turn 10",
        "valid 67%",
        "submitted 33%",
        "aborts 1",
        "s>t 0.25",
    ]


def test_bundled_swe_models_resolve_and_share_a_tokenizer(tmp_path: Path) -> None:
    student, teacher = bundled_models("swe")
    assert resolve_model("bundled:swe-student", tmp_path, 0) == student
    assert resolve_model("bundled:swe-teacher", tmp_path, 0) == teacher
    assert resolve_model("bundled:student", tmp_path, 0) == bundled_models()[0]
    assert (student / "tokenizer.json").read_bytes() == (teacher / "tokenizer.json").read_bytes()
    with pytest.raises(ModelRefError, match="bundled:swe-student"):
        resolve_model("bundled:swe-nope", tmp_path, 0)
    recipe = json.loads((student.parent / "recipe.json").read_text())["recipe"]
    assert DemoModelsRecipe.model_validate(recipe) == DemoModelsRecipe.for_harness("swe")


@pytest.mark.timeout(600)
def test_swe_demo_writes_its_summary_agent_metrics_and_trajectories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slime_ext.local.opd_demo import run_opd_demo

    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "demo-swe"
    summary = run_opd_demo(out, steps=1, n_heldout=3, console=Console(quiet=True), harness="swe")
    assert json.loads((out / "summary.json").read_text()) == summary
    assert summary["harness"] == "swe" and summary["n_heldout"] == 3 and summary["steps"] == 1
    assert summary["sandbox"] == {"backend": "local", "image": None}
    for which in ("eval_before", "eval_after"):
        agent = summary[which]
        assert set(agent) == {
            "num_turns",
            "tokens_per_turn",
            "valid_action_frac",
            "submitted_frac",
            "masked_turn_frac",
            "aborts",
        }
        assert 1 <= agent["num_turns"] <= 10 and agent["aborts"] == 0
        kept = (out / "eval" / f"student_{which.removeprefix('eval_')}.jsonl").read_text()
        assert len(kept.splitlines()) == 3
    first = summary["training"]["first_step"]
    assert {"opd_reverse_kl", "student_gt_teacher_frac", "valid_action_frac"} <= set(first)
    assert len((out / "trajectories" / "step_00000.jsonl").read_text().splitlines()) == 8


def test_demo_takes_the_harness_as_its_argument(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from launch.cli import app
    from slime_ext.local.opd_demo import demo_job

    job = demo_job(tmp_path, steps=3, harness="swe")
    assert (job.rollout.harness, job.model.student, job.teacher.model) == (
        "swe",
        "bundled:swe-student",
        "bundled:swe-teacher",
    )
    assert job.sandbox.backend == "local" and job.algorithm.steps == 3
    refused = CliRunner().invoke(app, ["demo", "chess"])
    assert refused.exit_code == 2 and "tir" in refused.output and "swe" in refused.output


def _demo_cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> Result:
    """`opd demo ARGS` where loading the demo's models fails the test: what is refused must
    be refused before."""

    def loaded(harness: str) -> Any:
        raise AssertionError(f"the {harness} demo's models were loaded")

    monkeypatch.setattr(opd_demo, "bundled_models", loaded)
    return CliRunner().invoke(app, ["demo", *args])


def test_demo_swe_with_docker_sandboxes_builds_the_demo_job_on_docker_and_its_image(
    tmp_path: Path,
) -> None:
    local = opd_demo.demo_job(tmp_path, steps=1, harness="swe")
    default = opd_demo.demo_job(tmp_path, steps=1, harness="swe", sandbox="docker")
    named = opd_demo.demo_job(
        tmp_path, steps=1, harness="swe", sandbox="docker", image="registry.internal:5000/swe:1"
    )
    assert (local.sandbox.backend, local.sandbox.image) == ("local", None)
    assert (default.sandbox.backend, default.sandbox.image) == (
        "docker",
        "opd-sandbox-swe-base:latest",
    )
    assert (named.sandbox.backend, named.sandbox.image) == (
        "docker",
        "registry.internal:5000/swe:1",
    )
    # only where commands run changes: the rest is the demo's job
    assert default.model_dump(exclude={"sandbox"}) == local.model_dump(exclude={"sandbox"})
    assert default.sandbox.model_dump(exclude={"backend", "image"}) == local.sandbox.model_dump(
        exclude={"backend", "image"}
    )


def test_demo_refuses_docker_sandboxes_for_tir_and_an_image_without_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tir = _demo_cli(monkeypatch, "--sandbox", "docker", "--out", str(tmp_path / "tir"))
    assert tir.exit_code == 2, tir.output
    assert "the tir demo's python tool always runs in a local sandbox" in tir.output
    image = _demo_cli(monkeypatch, "swe", "--image", "x:1", "--out", str(tmp_path / "swe"))
    assert image.exit_code == 2 and "add --sandbox docker" in image.output, image.output


def test_demo_swe_on_docker_stops_before_any_model_loads_when_no_daemon_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = tmp_path / "docker.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(dead))
    listener.close()  # the socket file stays; nothing answers on it
    monkeypatch.setenv("DOCKER_HOST", f"unix://{dead}")
    out = tmp_path / "run"
    out.mkdir()
    (out / "kept").write_text("an earlier run")
    result = _demo_cli(monkeypatch, "swe", "--sandbox", "docker", "--out", str(out))
    assert result.exit_code == 1, result.output
    assert f"no Docker daemon answers at unix://{dead}" in result.output
    assert "--sandbox local" in result.output
    assert (out / "kept").is_file()  # the run directory is replaced only by a demo that runs


@pytest.mark.skipif(daemon_problem() is not None, reason=f"{daemon_problem()}")
def test_demo_swe_on_docker_stops_before_any_model_loads_when_the_image_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = f"opd-no-such-image:missing-{os.getpid()}"
    result = _demo_cli(
        monkeypatch, "swe", "--sandbox", "docker", "--image", missing, "--out", str(tmp_path)
    )
    assert result.exit_code == 1, result.output
    assert f"the image {missing} is not present here: pull or build it" in result.output
    # the default image's refusal gives the build command docker/README.md shows
    monkeypatch.setattr(opd_demo, "has_image", lambda client, image: False)
    job = opd_demo.demo_job(tmp_path, steps=1, harness="swe", sandbox="docker")
    problem = opd_demo.docker_sandbox_problem(job) or ""
    assert f"`{opd_demo.SWE_DOCKER_IMAGE_BUILD}`" in problem
    readme = (Path(__file__).resolve().parents[1] / "docker" / "README.md").read_text()
    assert opd_demo.SWE_DOCKER_IMAGE_BUILD in readme


@pytest.mark.skipif(daemon_problem() is not None, reason=f"{daemon_problem()}")
@pytest.mark.skipif(
    not os.environ.get("OPD_HEAVY_TESTS"),
    reason="set OPD_HEAVY_TESTS=1: the SWE demo in Docker sandboxes (about 55 s; CI runs the "
    "demo in local sandboxes above, and the job's SWE agents in Docker in tests/test_fleet_job.py)",
)
@pytest.mark.timeout(600)
def test_swe_demo_runs_its_agent_in_docker_sandboxes_and_records_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = swe_base_test_image()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "demo-swe-docker"
    args = ["swe", "--sandbox", "docker", "--image", image, "--steps", "1", "--n-heldout", "2"]
    result = CliRunner().invoke(app, ["demo", *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sandbox"] == {"backend": "docker", "image": image}
    assert summary["eval_before"]["aborts"] == 0 and summary["eval_after"]["aborts"] == 0
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert step["rollout/sandbox_acquired"] >= 8  # the step's 8 agents, each graded in another
    assert "rollout/sandbox_host_active/here-docker" in step  # the fleet's one host: Docker
    client = docker_client()
    try:
        owned = f"{OWNER_LABEL}={run_owner(out)}"
        assert client.containers.list(all=True, filters={"label": owned}) == []
    finally:
        client.close()
