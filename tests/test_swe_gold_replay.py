"""`opd eval swe` without a model, to check a benchmark's images and tests end to end:
--policy gold resolves every instance (test logs and per-test statuses kept per
instance), --policy empty resolves none with the FAIL_TO_PASS tests run and failing,
--policy replay:FILE reproduces a scripted run token for token; a run where nothing
could be graded says n/a and exits 1. And the eval_script of rows that lack one:
swebench's own test-spec code where installed, refused with that instruction otherwise."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from launch.cli import app
from launch.evaluation import EvalSettings, RunOptions, check_gradable, run_evaluation
from rollout.chat import ChatRenderer
from rollout.evaluation.datasets import load_swe_dataset
from rollout.evaluation.records import ResultStore
from rollout.harness.swe import SWEHarness
from rollout.harness.swe_scripts import (
    CHUNK_BYTES,
    ReplayFileError,
    ScriptedSWEPolicy,
    gold_script,
    load_replay,
    submit,
)
from rollout.policy import PolicyError, SamplingParams
from rollout.tasks.mini_swe import file_diff, generate_tasks, spec_of
from rollout.tasks.swe_eval_scripts import (
    EvalScriptError,
    EvalScriptsUnavailableError,
    add_eval_scripts,
    main,
)
from rollout.trajectory import Trajectory
from tests.docker_images import daemon_problem
from tests.scripted_policy import Script, say, scripted_factory, tool
from tests.test_swe_spec_family import calc_image  # noqa: F401 (a fixture)

DATA = Path(__file__).parent / "data" / "swe"


def _swe_eval(out: Path, policy: str, datasets: list[str], **settings: Any) -> Any:
    return run_evaluation(
        EvalSettings(kind="swe", policy=policy, datasets=datasets, **settings),
        RunOptions(out_dir=out, concurrency=4, show_progress=False, wandb_mode="disabled"),
    )


def _grade_report(run: Path, benchmark: str, instance_id: str) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(
        (run / "instances" / benchmark / instance_id / "report.json").read_text()
    )
    return report


@pytest.mark.timeout(300)
def test_gold_resolves_every_mini_swe_instance_and_keeps_its_logs_and_test_statuses(
    tmp_path: Path,
) -> None:
    tasks = generate_tasks(3, seed=0)
    outcome = _swe_eval(tmp_path / "gold", "gold", ["mini_swe:3"], max_turns=4)
    [score] = outcome.scores
    assert (score.problems, score.solved, score.aborts) == (3, 3, 0)
    assert not outcome.ungraded
    for task in tasks:
        spec = spec_of(task)
        folder = tmp_path / "gold" / "instances" / "mini_swe" / task.task_id
        report = _grade_report(tmp_path / "gold", "mini_swe", task.task_id)
        assert report["resolved"] is True and report["reason"] == "resolved"
        assert report["fail_to_pass"] == {"success": spec.fail_to_pass, "failure": []}
        assert report["pass_to_pass"] == {"success": spec.pass_to_pass, "failure": []}
        tests = {*spec.fail_to_pass, *spec.pass_to_pass}
        assert report["tests_status"] == dict.fromkeys(tests, "PASSED")
        log = (folder / "test_output.txt").read_text()
        assert ">>>>> Start Test Output" in log and "passed" in log  # pytest's own summary
        header = spec.reference_patch.splitlines()[0]  # diff --git a/<module> b/<module>
        assert (folder / "patch.diff").read_text().splitlines()[0] == header
    records = ResultStore(tmp_path / "gold").read()
    assert all("files" not in r.details for r in records)  # the logs stay out of the JSONL
    assert {r.details["files_dir"] for r in records} == {
        f"instances/mini_swe/{task.task_id}" for task in tasks
    }
    report_md = (tmp_path / "gold" / "report.md").read_text()
    first = tasks[0].task_id
    assert f"[{first}](instances/mini_swe/{first}) | yes |" in report_md


@pytest.mark.timeout(300)
def test_empty_resolves_nothing_and_its_fail_to_pass_tests_ran_and_failed(
    tmp_path: Path,
) -> None:
    tasks = generate_tasks(3, seed=0)
    outcome = _swe_eval(tmp_path / "empty", "empty", ["mini_swe:3"], max_turns=4)
    [score] = outcome.scores
    assert (score.problems, score.solved, score.aborts) == (3, 0, 0)
    for task in tasks:
        spec = spec_of(task)
        report = _grade_report(tmp_path / "empty", "mini_swe", task.task_id)
        # The tests ran on the unchanged repository: the bug's tests fail, the rest pass.
        assert report["fail_to_pass"] == {"success": [], "failure": spec.fail_to_pass}
        assert report["pass_to_pass"] == {"success": spec.pass_to_pass, "failure": []}
        assert {report["tests_status"][t] for t in spec.fail_to_pass} == {"FAILED"}
        assert report["reason"].startswith(f"{len(spec.fail_to_pass)} FAIL_TO_PASS")


def _replay_actions(tasks: list[Any]) -> dict[str, list[dict[str, Any]]]:
    patch = spec_of(tasks[0]).reference_patch
    return {
        tasks[0].task_id: [  # fixed
            {"name": "bash", "arguments": {"command": f"git apply <<'PATCH'\n{patch}PATCH"}},
            {"name": "submit", "arguments": {}},
        ],
        tasks[1].task_id: [  # a turn without a call, a look around, an empty submission
            {"content": "Let me look at the repository first."},
            {"content": "Listing it.", "name": "bash", "arguments": {"command": "ls"}},
            {"name": "submit", "arguments": {}},
        ],
        tasks[2].task_id: [{"name": "bash", "arguments": {"command": "ls"}}] * 3,  # step limit
    }


@pytest.mark.timeout(300)
def test_replay_reproduces_a_scripted_run_turn_for_turn(
    tmp_path: Path, factory_tokenizer: Any
) -> None:
    tasks = generate_tasks(3, seed=0)
    actions = _replay_actions(tasks)
    replay = tmp_path / "actions.jsonl"
    replay.write_text(
        "".join(json.dumps({"instance_id": i, "actions": a}) + "\n" for i, a in actions.items())
    )
    scripts: dict[str, Script] = {
        instance_id: [
            tool(a["name"], **a["arguments"]) | {"content": a.get("content", "")}
            if "name" in a
            else say(a["content"])
            for a in steps
        ]
        for instance_id, steps in actions.items()
    }
    settings = EvalSettings(kind="swe", policy="scripted", datasets=["mini_swe:3"], max_turns=3)
    scripted = tmp_path / "scripted"
    run_evaluation(
        settings,
        RunOptions(out_dir=scripted, show_progress=False, wandb_mode="disabled"),
        scripted_factory(factory_tokenizer, lambda task_id, _sample: scripts[task_id]),
    )
    replayed = tmp_path / "replayed"
    outcome = _swe_eval(replayed, f"replay:{replay}", ["mini_swe:3"], max_turns=3)
    [score] = outcome.scores
    assert (score.solved, score.step_limited, score.reasons) == (
        1,
        1,
        {"empty patch": 1, "no submission": 1},
    )

    def outcomes(run: Path) -> dict[str, tuple[Any, ...]]:
        return {
            r.instance_id: (r.solved, r.reason, r.num_turns, r.tool_calls, r.answer)
            for r in ResultStore(run).read()
        }

    def spans(run: Path) -> dict[str, list[list[int]]]:
        lines = (run / "trajectories.jsonl").read_text().splitlines()
        trajectories = [Trajectory.model_validate_json(line) for line in lines]
        return {t.task.task_id: [turn.span_ids for turn in t.turns] for t in trajectories}

    assert outcomes(replayed) == outcomes(scripted)
    assert spans(replayed) == spans(scripted)  # the same tokens, turn for turn


def test_a_replay_file_is_refused_line_by_line(tmp_path: Path) -> None:
    replay = tmp_path / "actions.jsonl"
    line = json.dumps({"instance_id": "a", "actions": [{"name": "submit"}]})
    replay.write_text(line + "\n" + line + "\n")
    with pytest.raises(ReplayFileError, match=r"actions\.jsonl:2: 'a' appears twice"):
        load_replay(replay)
    replay.write_text(json.dumps({"instance_id": "a", "actions": [{"arguments": {"x": 1}}]}))
    with pytest.raises(ReplayFileError, match=r"actions\.jsonl:1: not a replay line"):
        load_replay(replay)


def test_a_scripted_policy_names_the_instance_it_has_no_action_for(
    factory_tokenizer: Any,
) -> None:
    renderer = ChatRenderer(factory_tokenizer)
    policy = ScriptedSWEPolicy("gold", renderer, {"a": [submit()]}, {"b": "no patch"})
    params = SamplingParams(max_new_tokens=8)

    async def generate(session: str) -> Any:
        return await policy.generate([], params, session)

    first = asyncio.run(generate("a#0"))
    assert factory_tokenizer.decode(first.output_ids).count('"name": "submit"') == 1
    with pytest.raises(PolicyError, match=r"the script's 1 actions ran out"):
        asyncio.run(generate("a#0"))
    with pytest.raises(PolicyError, match=r"^gold: b: no patch$"):
        asyncio.run(generate("b#0"))


def test_gold_writes_a_patch_past_one_command_in_pieces_and_applies_it(tmp_path: Path) -> None:
    """A patch larger than a shell argument may be goes in several bash actions; run as
    the sandbox would (one bash -c each, in the repository), they apply it exactly."""
    text = "".join(f"line {n} " + "x" * 70 + "\n" for n in range(2500))  # ~200 KB
    patch = file_diff("big.txt", "", text) + file_diff("small.txt", "", "é ünïcode\n")
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    script = gold_script(patch)
    commands = [m["tool_calls"][0]["arguments"]["command"] for m in script[:-1]]
    assert len(commands) >= 4 and all(len(c.encode()) < CHUNK_BYTES + 200 for c in commands)
    assert script[-1]["tool_calls"][0]["name"] == "submit"
    for command in commands:
        subprocess.run(["bash", "-c", command], cwd=repo, check=True, capture_output=True)
    assert (repo / "big.txt").read_text() == text
    assert (repo / "small.txt").read_text() == "é ünïcode\n"
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True)
    assert status.stdout.decode().split() == ["??", "big.txt", "??", "small.txt"]  # .git only


@pytest.mark.timeout(300)
def test_nothing_graded_reads_na_and_exits_1_with_the_reasons(tmp_path: Path) -> None:
    replay = tmp_path / "actions.jsonl"
    replay.write_text(json.dumps({"instance_id": "elsewhere", "actions": [{"name": "submit"}]}))
    out = tmp_path / "run"
    argv = ["eval", "swe", "--policy", f"replay:{replay}", "--dataset", "mini_swe:2"]
    argv += ["--out", str(out), "--max-turns", "2", "--wandb-mode", "disabled"]
    result = CliRunner().invoke(app, argv, env={"COLUMNS": "300"})
    assert result.exit_code == 1, result.output
    assert "nothing could be graded in mini_swe (n/a): 2 policy, e.g. policy: replay:" in (
        result.output
    )
    assert "has no line for this instance" in result.output
    assert "| mini_swe | 2 | 0 | n/a | n/a | n/a | n/a |" in (out / "report.md").read_text()
    assert "0.0%" not in (out / "report.md").read_text()


@pytest.mark.skipif(daemon_problem() is not None, reason=f"{daemon_problem()}")
@pytest.mark.timeout(600)
def test_gold_resolves_rows_in_their_local_image_and_empty_does_not(
    tmp_path: Path,
    calc_image: str,  # noqa: F811 (the fixture imported above)
) -> None:
    from tests.test_swe_spec_family import F2P, FIX_PATCH, P2P, PYTEST, TEST_PATCH, image_commits

    base, _ = image_commits(calc_image)
    rows = [
        {
            "instance_id": instance_id,
            "problem_statement": "add() subtracts its arguments.",
            "image": calc_image,
            "workdir": "/app",
            "base_commit": base,
            "test_command": PYTEST,
            "test_patch": TEST_PATCH,
            "patch": patch,
            "FAIL_TO_PASS": F2P,
            "PASS_TO_PASS": P2P,
        }
        for instance_id, patch in (("opd__calc-1", FIX_PATCH), ("opd__calc-nopatch", ""))
    ]
    dataset = tmp_path / "calc.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    limits = {"max_turns": 3, "trajectory_timeout_s": 240, "eval_timeout_s": 120}
    gold = _swe_eval(tmp_path / "gold", "gold", [str(dataset)], **limits)
    empty = _swe_eval(tmp_path / "empty", "empty", [str(dataset)], **limits)

    [gold_score], [empty_score] = gold.scores, empty.scores
    assert (gold_score.solved, gold_score.aborts, gold_score.net_pass_at_1) == (1, 1, 1.0)
    assert (empty_score.solved, empty_score.aborts) == (0, 0)
    gold_records = {r.instance_id: r for r in ResultStore(tmp_path / "gold").read()}
    assert gold_records["opd__calc-nopatch"].reason == (
        "policy: gold: opd__calc-nopatch: the row has no reference patch (its `patch` is empty)"
    )
    resolved = _grade_report(tmp_path / "gold", "calc", "opd__calc-1")
    assert resolved["tests_status"] == dict.fromkeys([*F2P, *P2P], "PASSED")
    for instance_id in ("opd__calc-1", "opd__calc-nopatch"):
        unresolved = _grade_report(tmp_path / "empty", "calc", instance_id)
        assert unresolved["fail_to_pass"] == {"success": [], "failure": F2P}
        assert unresolved["pass_to_pass"] == {"success": P2P, "failure": []}
        log = tmp_path / "empty" / "instances" / "calc" / instance_id / "test_output.txt"
        assert "FAILED tests/test_add.py::test_add" in log.read_text()


def _legacy_row(**fields: Any) -> dict[str, Any]:
    row = json.loads((DATA / "django_instance.json").read_text())
    row.pop("eval_script")
    return row | {"problem_statement": "Fix it.", "test_patch": "diff --git a/t b/t\n"} | fields


def test_rows_without_eval_script_are_refused_with_how_to_make_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The installed swebench (5) has no test-spec code: the helper and `opd eval swe` both
    say how to make the scripts; rows that carry theirs pass through untouched."""
    with pytest.raises(EvalScriptsUnavailableError, match=r"swebench \(5\.[^)]*\) has no test"):
        add_eval_scripts([_legacy_row()])
    kept = {"instance_id": "x", "eval_script": "#!/bin/bash\n"}
    assert add_eval_scripts([kept]) == ([kept], 0)

    dataset = tmp_path / "old.jsonl"
    dataset.write_text(json.dumps(_legacy_row()) + "\n")
    assert main([str(dataset), "--out", str(tmp_path / "new.jsonl")]) == 2
    assert "python -m rollout.tasks.swe_eval_scripts DATASET --out FILE" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"needs the row's eval_script.*swe_eval_scripts"):
        check_gradable(SWEHarness(), {"old": load_swe_dataset(str(dataset))})


def test_swebench_test_spec_code_makes_the_eval_script_where_installed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A stand-in of swebench 4's create_scripts module (same call, same result shape);
    the script it makes is one swebench 5's grading accepts."""
    import swebench.harness.constants as constants

    calls: list[tuple[Any, ...]] = []

    def make_eval_script_list(*args: Any) -> list[str]:
        calls.append(args)
        return ["cd /testbed", ": '>>>>> Start Test Output'", "pytest", ": '>>>>> End Test Output'"]

    legacy = types.ModuleType("swebench.harness.test_spec.create_scripts")
    legacy.make_eval_script_list = make_eval_script_list  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, legacy.__name__, legacy)
    specs = {"django/django": {"3.2": {"test_cmd": "./tests/runtests.py"}}}
    monkeypatch.setattr(constants, "MAP_REPO_VERSION_TO_SPECS", specs, raising=False)

    rows, made = add_eval_scripts([_legacy_row(), {"instance_id": "y", "eval_script": "kept"}])
    assert made == 1 and rows[1]["eval_script"] == "kept"
    assert rows[0]["eval_script"].startswith("#!/bin/bash\nset -uxo pipefail\ncd /testbed\n")
    row = rows[0]
    django = specs["django/django"]["3.2"]
    assert calls == [(row, django, "testbed", "/testbed", row["base_commit"], row["test_patch"])]
    dataset = tmp_path / "new.jsonl"
    dataset.write_text(json.dumps(row) + "\n")
    check_gradable(SWEHarness(), {"new": load_swe_dataset(str(dataset))})  # gradable now

    with pytest.raises(EvalScriptError, match=r"(?s)1 rows.*django__django-12983.*'9\.9'"):
        add_eval_scripts([_legacy_row(version="9.9")])
