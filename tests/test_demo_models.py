"""`opd demo-models build`: the same recipe makes the same bytes, and a recipe that
chooses its student by a rule (scored snapshots) keeps the first snapshot at its target,
or fails with its reason and nothing lost. Tiny builds: the tiny factory preset, a few
traces, a few steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from launch.cli import app
from rollout.tasks import mini_swe
from slime_ext.local import demo_models
from slime_ext.local.demo_models import (
    DemoModelsError,
    DemoModelsRecipe,
    build_demo_models,
    selection_tasks,
)
from slime_ext.local.evaluate import heldout_tasks
from slime_ext.local.trainer import scheduled_lr

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TINY: dict[str, Any] = {"preset": "qwen3-tiny", "batch_size": 2, "lr": 1e-3}


def build_swe(out: Path, recipe_file: Path) -> Result:
    """`opd demo-models build --harness swe --out out --recipe recipe_file`."""
    args = ["--harness", "swe", "--out", str(out), "--recipe", str(recipe_file)]
    return CliRunner().invoke(app, ["demo-models", "build", *args])


def weights(out: Path, name: str) -> bytes:
    return (out / name / "model.safetensors").read_bytes()


CHANGED: dict[str, Any] = {
    **TINY,
    "train_tasks": 4,
    "student_step": 2,
    "teacher_step": 4,
    "lr_schedule": "cosine",
    "lr_warmup_steps": 1,
    "min_lr": 1e-4,
}


@pytest.mark.timeout(300)
def test_a_swe_build_twice_gives_the_same_bytes_and_its_cosine_schedule(tmp_path: Path) -> None:
    """Once by `opd demo-models build --recipe`, once by the function."""
    first, second = tmp_path / "a", tmp_path / "b"
    (tmp_path / "recipe.json").write_text(json.dumps(CHANGED))
    result = build_swe(first, tmp_path / "recipe.json")
    assert result.exit_code == 0, result.output
    recipe = DemoModelsRecipe.for_harness("swe", **CHANGED)
    second.mkdir()
    build_demo_models(second, recipe, log=lambda line: None)
    for name in ("student", "teacher"):
        assert weights(first, name) == weights(second, name)
    assert weights(first, "student") != weights(first, "teacher")
    kept = json.loads((first / "recipe.json").read_text())
    assert kept["recipe"] == recipe.model_dump()
    assert kept["history"] == json.loads((second / "recipe.json").read_text())["history"]
    config = demo_models.trainer_config(recipe)
    assert [scheduled_lr(step, config) for step in (0, 1, 4)] == [0.0, 1e-3, 1e-4]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"lr_schedule": "cosin"}', "lr_schedule"),
        ('{"select_evry": 5}', "select_evry"),
        ("[1]", "not a JSON object"),
        ("{", "Expecting property name"),
    ],
    ids=["bad-value", "unknown-field", "not-an-object", "not-json"],
)
def test_a_bad_recipe_file_is_refused_before_any_work(tmp_path: Path, text: str, says: str) -> None:
    (tmp_path / "recipe.json").write_text(text)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["demo-models", "build", "--out", str(out), "--recipe", str(tmp_path / "recipe.json")]
    )
    assert result.exit_code == 2 and "invalid recipe" in result.output and says in result.output
    assert not out.exists()


def test_selection_tasks_are_neither_test_nor_training_tasks() -> None:
    chosen = selection_tasks("swe", 40)
    assert len(chosen) == 40 == len({task.prompt for task in chosen})
    test = {task.prompt for task in heldout_tasks(100, "swe")}
    train = {task.prompt for task in mini_swe.generate_tasks(800, seed=1000)}
    assert not {task.prompt for task in chosen} & (test | train)
    assert [t.prompt for t in selection_tasks("swe", 40)] == [t.prompt for t in chosen]


def scripted_scores(monkeypatch: pytest.MonkeyPatch, solved: list[float]) -> list[Path]:
    """Each scoring of a snapshot returns the next share solved (the rule under test;
    the real scoring runs in the test below); returns the directories scored."""
    scored: list[Path] = []

    async def scores(model_dir: Path, tasks: list[Any], job: Any) -> list[float]:
        scored.append(model_dir)
        share = solved[len(scored) - 1]
        hits = round(share * len(tasks))
        return [1.0] * hits + [0.0] * (len(tasks) - hits)

    monkeypatch.setattr(demo_models, "heldout_scores", scores)
    return scored


RULE: dict[str, Any] = {
    **TINY,
    "harness": "tir",
    "train_tasks": 16,
    "teacher_step": 6,
    "select_every": 2,
    "select_tasks": 10,
    "student_solves": 0.3,
    "teacher_margin": 0.2,
}


def test_the_student_is_the_first_snapshot_at_its_target_and_scoring_stops_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scored = scripted_scores(monkeypatch, [0.1, 0.3, 0.8])  # steps 2, 4; then the teacher, 6
    twin = tmp_path / "twin"
    twin.mkdir()
    fixed = DemoModelsRecipe(**{**RULE, "select_every": 0, "student_step": 4})
    build_demo_models(twin, fixed, log=lambda line: None)
    summary = build_demo_models(tmp_path, DemoModelsRecipe(**RULE), log=lambda line: None)
    assert summary["selection"] == {
        "seed": demo_models.SELECTION_SEEDS["tir"],
        "tasks": 10,
        "solved": {"2": 0.1, "4": 0.3, "6": 0.8},
        "student_step": 4,
    }
    # steps 2 and 4 written to be scored, then the teacher only, scored where it was saved
    assert scored == [tmp_path / "snapshot"] * 2 + [tmp_path / "teacher"]
    assert weights(tmp_path, "student") == weights(twin, "student")  # the fixed step 4's
    assert weights(tmp_path, "teacher") == weights(twin, "teacher")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "recipe.json",
        "student",
        "teacher",
        "twin",
    ]


def test_a_step_already_saved_is_scored_where_it_is_and_copied_as_the_student(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scored = scripted_scores(monkeypatch, [0.1, 0.3, 0.8])
    build_demo_models(tmp_path, DemoModelsRecipe(**RULE, snapshot_every=2), log=lambda _: None)
    assert scored == [tmp_path / "step_2", tmp_path / "step_4", tmp_path / "teacher"]
    assert weights(tmp_path, "student") == weights(tmp_path, "step_4")
    assert (tmp_path / "step_2/model.safetensors").exists()
    assert not (tmp_path / "snapshot").exists()


@pytest.mark.parametrize(
    ("solved", "reason", "record", "student_step"),
    [
        (
            [0.1, 0.2, 0.6],
            "no snapshot solved 30% of the selection tasks by step 6",
            {"2": 0.1, "4": 0.2, "6": 0.6},
            None,
        ),
        (
            [0.3, 0.4],
            "the teacher solves 40.0%, not 20% more than the student's 30.0%",
            {"2": 0.3, "6": 0.4},
            2,
        ),
    ],
    ids=["no-student", "no-gap"],
)
def test_a_build_that_misses_its_pair_says_why_and_keeps_its_files(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    solved: list[float],
    reason: str,
    record: dict[str, float],
    student_step: int | None,
) -> None:
    scripted_scores(monkeypatch, solved)
    (tmp_path / "student").mkdir()  # an earlier build's: not to be left beside a new teacher
    with pytest.raises(DemoModelsError, match=reason) as raised:
        build_demo_models(tmp_path, DemoModelsRecipe(**RULE), log=lambda line: None)
    assert str(tmp_path) in str(raised.value)
    kept = json.loads((tmp_path / "recipe.json").read_text())
    assert kept["selection"]["solved"] == record
    assert (tmp_path / "teacher" / "model.safetensors").exists()
    assert kept["selection"]["student_step"] == student_step
    assert (tmp_path / "student" / "model.safetensors").exists() == (student_step is not None)


@pytest.mark.timeout(300)
def test_a_swe_build_scores_its_snapshots_for_real_in_sandboxes(tmp_path: Path) -> None:
    """A random-init tiny model solves no selection task: the command says so, exit 1."""
    changed = {**TINY, "train_tasks": 4, "teacher_step": 2, "select_every": 1, "select_tasks": 2}
    (tmp_path / "recipe.json").write_text(json.dumps(changed))
    out = tmp_path / "out"
    result = build_swe(out, tmp_path / "recipe.json")
    assert result.exit_code == 1, result.output
    assert "build failed" in result.output
    assert "no snapshot solved 20% of the selection tasks by step 2" in result.output
    assert json.loads((out / "recipe.json").read_text())["selection"] == {
        "seed": demo_models.SELECTION_SEEDS["swe"],
        "tasks": 2,
        "solved": {"1": 0.0, "2": 0.0},
        "student_step": None,
    }
    assert sorted(path.name for path in out.iterdir()) == ["recipe.json", "teacher"]
