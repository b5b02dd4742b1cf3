"""`opd eval` end to end with a scripted policy (a model's outputs cannot be chosen):
mini-SWE instances solved, failed, step-limited, aborted and timed out reproduce the
expected table, predictions and reports; math avg@k / pass@k equal the hand count; a run
killed midway resumes with only its unfinished instances; other settings are refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from launch.evaluation import EvalSettings, RunOptions, run_evaluation
from rollout.evaluation.records import EvalResultsError, ResultStore
from rollout.evaluation.scores import ALL_BENCHMARKS
from rollout.tasks.mini_swe import generate_tasks, spec_of
from tests.docker_images import daemon_problem
from tests.scripted_policy import FAIL, HANG, Script, ScriptedPolicy, say, scripted_factory, tool
from tests.test_swe_spec_family import calc_image  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parents[1]


def _swe_scripts() -> tuple[dict[str, Script], list[str]]:
    tasks = generate_tasks(6, seed=0)
    ids = [task.task_id for task in tasks]

    def fix(index: int) -> list[Any]:
        patch = spec_of(tasks[index]).reference_patch
        return [tool("bash", command=f"git apply <<'PATCH'\n{patch}PATCH"), tool("submit")]

    scripts: dict[str, Script] = {
        ids[0]: fix(0),
        ids[1]: fix(1),
        ids[2]: [tool("submit")],  # nothing changed: an empty patch
        ids[3]: [tool("bash", command="ls")],  # never submits: the step limit
        ids[4]: FAIL,
        ids[5]: HANG,
    }
    return scripts, ids


@pytest.mark.timeout(300)
def test_swe_eval_over_mini_swe_reproduces_the_expected_table(
    tmp_path: Path, factory_tokenizer: Any
) -> None:
    scripts, ids = _swe_scripts()
    settings = EvalSettings(
        kind="swe",
        policy="scripted",
        datasets=["mini_swe:6"],
        max_turns=3,
        trajectory_timeout_s=20,
        eval_timeout_s=60,
    )
    options = RunOptions(out_dir=tmp_path / "run", concurrency=6, show_progress=False)
    outcome = run_evaluation(
        settings, options, scripted_factory(factory_tokenizer, lambda t, _s: scripts[t])
    )
    [swe] = outcome.scores
    assert (swe.benchmark, swe.problems, swe.trajectories) == ("mini_swe", 6, 6)
    assert swe.solved == 2
    assert swe.pass_at_1 == pytest.approx(2 / 6)
    assert (swe.aborts, swe.timeouts, swe.step_limited) == (1, 1, 1)
    assert swe.net_pass_at_1 == pytest.approx(2 / 5)  # the infrastructure abort left out
    assert swe.avg_turns == pytest.approx((2 + 2 + 1 + 3 + 0 + 0) / 6)
    assert swe.reasons == {
        "empty patch": 1,
        "no submission": 1,
        "policy": 1,
        "trajectory deadline": 1,
    }
    # statsmodels' Wilson interval of 2/6 (tests/test_eval_stats.py checks the function)
    assert swe.interval == pytest.approx((0.0967714, 0.7000067), abs=1e-6)

    records = {r.instance_id: r for r in ResultStore(tmp_path / "run").read()}
    assert [records[i].outcome for i in ids] == [
        "graded",
        "graded",
        "graded",
        "graded",
        "aborted",
        "timeout",
    ]
    assert records[ids[0]].details["resolved"] is True
    assert records[ids[0]].tool_calls == 1

    predictions = [
        json.loads(line)
        for line in (tmp_path / "run" / "predictions" / "mini_swe.jsonl").read_text().splitlines()
    ]
    assert {p["instance_id"] for p in predictions} == set(ids)
    by_id = {p["instance_id"]: p for p in predictions}
    assert by_id[ids[0]]["model_patch"].startswith("diff --git")
    assert by_id[ids[2]]["model_patch"] == ""
    assert all(p["model_name_or_path"] == "scripted" for p in predictions)

    report = (tmp_path / "run" / "report.md").read_text()
    assert "| mini_swe | 6 | 2 | 33.3% | [9.7, 70.0] | 40.0% |" in report
    assert json.loads((tmp_path / "run" / "report.json").read_text())["scores"][0]["solved"] == 2
    assert (tmp_path / "run" / "report.png").stat().st_size > 1000
    if os.environ.get("WANDB_MODE") != "disabled":  # the table went to an offline W&B run
        assert list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))


def _math_dataset(path: Path) -> Path:
    rows = [
        {"id": "p1", "problem": "What is 2 + 2?", "answer": "4"},
        {"id": "p2", "problem": "What is 3 * 3?", "answer": "9"},
        {"id": "p3", "problem": "What is 10 - 7?", "answer": "3"},
        {"id": "p4", "problem": "What is 2 ** 5?", "answer": "32"},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _math_script(task_id: str, sample: int) -> Script:
    """p1: every sample right; p2: sample 0 right; p3: none; p4: sample 2 right after a
    python call (samples 0 and 1 call it too, then answer wrong); other tasks: 0."""
    right = {"p1": "4", "p2": "9", "p3": "3", "p4": "32"}.get(task_id, "no")
    correct = task_id == "p1" or (task_id, sample) in {("p2", 0), ("p4", 2)}
    answer = say(f"The answer is \\boxed{{{right if correct else 0}}}.")
    if task_id == "p4":
        return [tool("python", code="print(2 ** 5)"), answer]
    return [answer]


@pytest.mark.timeout(300)
def test_math_eval_gives_avg_and_pass_at_k_counted_by_hand(
    tmp_path: Path, factory_tokenizer: Any
) -> None:
    dataset = _math_dataset(tmp_path / "toy.jsonl")
    second = tmp_path / "other.jsonl"
    second.write_text(json.dumps({"problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    settings = EvalSettings(
        kind="math", policy="scripted", datasets=[str(dataset), f"again={second}"], samples=3
    )
    outcome = run_evaluation(
        settings,
        RunOptions(out_dir=tmp_path / "math", show_progress=False),
        scripted_factory(factory_tokenizer, _math_script),
    )
    toy, again, average = outcome.scores
    assert (toy.benchmark, toy.problems, toy.samples, toy.trajectories) == ("toy", 4, 3, 12)
    assert toy.pass_at_1 == pytest.approx((3 + 1 + 0 + 1) / 12)  # avg@3
    assert toy.pass_at_k == pytest.approx(3 / 4)  # pass@3: p1, p2, p4
    assert toy.tool_use_frac == pytest.approx(3 / 12)  # p4's three samples
    assert toy.pass_with_tools == pytest.approx(1 / 3)
    assert toy.pass_without_tools == pytest.approx(4 / 9)
    assert again.benchmark == "again" and again.pass_at_1 == 0.0  # answers 0, not 2
    assert average.benchmark == ALL_BENCHMARKS
    assert average.pass_at_1 == pytest.approx((5 / 12 + 0) / 2)
    report = (tmp_path / "math" / "report.md").read_text()
    assert "| toy | 4 | 41.7% |" in report and "avg@3" in report


RESUME_CHILD = """
import sys
from pathlib import Path
from launch.evaluation import EvalSettings, RunOptions, run_evaluation
from slime_ext.models.factory import build_tokenizer
from tests.scripted_policy import HANG, say, scripted_factory

def script(task_id, sample):
    # p3 and p4 never answer: the run is killed while they are in flight
    return HANG if task_id in ("p3", "p4") else [say("\\\\boxed{0}")]

settings = EvalSettings.model_validate_json(Path(sys.argv[1]).read_text())
options = RunOptions(out_dir=Path(sys.argv[2]), concurrency=8, show_progress=False)
run_evaluation(settings, options, scripted_factory(build_tokenizer(), script))
"""


@pytest.mark.timeout(300)
def test_an_eval_killed_midway_resumes_with_only_the_unfinished_instances(
    tmp_path: Path, factory_tokenizer: Any
) -> None:
    dataset = _math_dataset(tmp_path / "toy.jsonl")
    settings = EvalSettings(
        kind="math", policy="scripted", datasets=[str(dataset)], samples=2, tools=False
    )
    settings_file = tmp_path / "settings.json"
    settings_file.write_text(settings.model_dump_json())
    run_dir = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, "-c", RESUME_CHILD, str(settings_file), str(run_dir)],
        cwd=REPO,
        env={**os.environ, "WANDB_MODE": "disabled"},
        start_new_session=True,
    )
    results = run_dir / "results.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if results.is_file() and len(results.read_text().splitlines()) >= 4:
            break
        assert child.poll() is None, "the evaluation ended before it was killed"
        time.sleep(0.2)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    done = ResultStore(run_dir).read()
    assert {(r.instance_id, r.sample) for r in done} == {
        ("p1", 0),
        ("p1", 1),
        ("p2", 0),
        ("p2", 1),
    }

    policies: list[ScriptedPolicy] = []
    outcome = run_evaluation(
        settings,
        RunOptions(out_dir=run_dir, show_progress=False),
        scripted_factory(factory_tokenizer, _math_script, policies),
    )
    [policy] = policies
    assert set(policy.turns) == {"p3#0", "p3#1", "p4#0", "p4#1"}
    assert (outcome.ran, outcome.resumed) == (4, 4)
    [toy] = outcome.scores
    assert toy.trajectories == 8
    # p1, p2 from the killed run (answers 0: wrong); p3 (wrong), p4 sample 0 (wrong; the
    # reasoning-only harness ends at the first reply: p4's python call holds no answer)
    assert toy.solved == 0


def test_a_run_directory_refuses_other_settings(tmp_path: Path, factory_tokenizer: Any) -> None:
    dataset = _math_dataset(tmp_path / "toy.jsonl")
    settings = EvalSettings(kind="math", policy="scripted", datasets=[str(dataset)], tools=False)
    options = RunOptions(out_dir=tmp_path / "run", show_progress=False, wandb_mode="disabled")
    run_evaluation(settings, options, scripted_factory(factory_tokenizer, _math_script))
    hotter = settings.model_copy(update={"temperature": 0.7})
    with pytest.raises(EvalResultsError, match=r"temperature: 1\.0 -> 0\.7"):
        run_evaluation(hotter, options, scripted_factory(factory_tokenizer, _math_script))
    dataset.write_text(dataset.read_text().replace("2 + 2", "2 + 3"))
    with pytest.raises(EvalResultsError, match="dataset_digests"):
        run_evaluation(settings, options, scripted_factory(factory_tokenizer, _math_script))


@pytest.mark.skipif(daemon_problem() is not None, reason=f"{daemon_problem()}")
@pytest.mark.timeout(600)
def test_swe_eval_runs_dataset_rows_in_their_images_on_docker(
    tmp_path: Path,
    factory_tokenizer: Any,
    calc_image: str,  # noqa: F811 (the fixture imported above)
) -> None:
    """Generic rows (parquet) and a SWE-bench Pro row (JSONL) in their own schemas, run in
    their image through the fleet's Docker host, graded their own way."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.test_swe_spec_family import (
        F2P,
        FIX_PATCH,
        P2P,
        PRO_SCRIPTS,
        PYTEST,
        TEST_PATCH,
        image_commits,
    )

    base, fix = image_commits(calc_image)
    generic = [
        {
            "instance_id": f"opd__calc-{n}",
            "problem_statement": "add() subtracts its arguments.",
            "image": calc_image,
            "workdir": "/app",
            "base_commit": base,
            "test_command": PYTEST,
            "test_patch": TEST_PATCH,
            "patch": FIX_PATCH,
            "FAIL_TO_PASS": json.dumps(F2P),
            "PASS_TO_PASS": json.dumps(P2P),
        }
        for n in (1, 2)
    ]
    pq.write_table(pa.Table.from_pylist(generic), tmp_path / "generic.parquet")
    pro_row = {
        "instance_id": PRO_SCRIPTS.name,
        "repo": "opd/calc",
        "base_commit": base,
        "patch": FIX_PATCH,
        "test_patch": TEST_PATCH,
        "problem_statement": "add() subtracts its arguments.",
        "fail_to_pass": str(F2P),
        "pass_to_pass": str(P2P),
        "before_repo_set_cmd": f"git checkout {fix} -- tests/test_add.py",
        "selected_test_files_to_run": str(["tests/test_add.py", "tests/test_sub.py"]),
        "dockerhub_tag": "unused",
        "image_name": calc_image,
        "run_scripts_dir": str(PRO_SCRIPTS.parent),
    }
    (tmp_path / "pro.jsonl").write_text(json.dumps(pro_row) + "\n")
    fixed = [tool("bash", command=f"git apply <<'PATCH'\n{FIX_PATCH}PATCH"), tool("submit")]
    scripts: dict[str, Script] = {
        "opd__calc-1": fixed,
        "opd__calc-2": [tool("bash", command="echo hi > notes.txt"), tool("submit")],
        PRO_SCRIPTS.name: fixed,
    }
    settings = EvalSettings(
        kind="swe",
        policy="scripted",
        datasets=[str(tmp_path / "generic.parquet"), str(tmp_path / "pro.jsonl")],
        max_turns=4,
        trajectory_timeout_s=240,
        eval_timeout_s=120,
    )
    outcome = run_evaluation(
        settings,
        RunOptions(out_dir=tmp_path / "run", concurrency=3, show_progress=False),
        scripted_factory(factory_tokenizer, lambda t, _s: scripts[t]),
    )
    generic_score, pro_score, _average = outcome.scores
    assert (generic_score.benchmark, generic_score.problems, generic_score.solved) == (
        "generic",
        2,
        1,
    )
    assert (pro_score.benchmark, pro_score.solved, pro_score.aborts) == ("pro", 1, 0)
    records = {r.instance_id: r for r in ResultStore(tmp_path / "run").read()}
    assert records["opd__calc-2"].reason.startswith("1 FAIL_TO_PASS")
    assert records[PRO_SCRIPTS.name].details["resolved"] is True
    pro_predictions = (tmp_path / "run" / "predictions" / "pro.jsonl").read_text()
    assert json.loads(pro_predictions)["model_patch"].startswith("diff --git")


def test_swe_eval_refuses_instances_it_cannot_grade_before_running(
    tmp_path: Path, factory_tokenizer: Any
) -> None:
    row = {
        "instance_id": "instance_org__repo-1",
        "repo": "org/repo",
        "base_commit": "abc",
        "patch": "",
        "test_patch": "",
        "problem_statement": "fix it",
        "fail_to_pass": "['t::a']",
        "pass_to_pass": "[]",
        "before_repo_set_cmd": "git checkout abc",
        "selected_test_files_to_run": "['t']",
        "dockerhub_tag": "org.repo-1",
    }
    (tmp_path / "pro.jsonl").write_text(json.dumps(row) + "\n")
    settings = EvalSettings(kind="swe", policy="scripted", datasets=[str(tmp_path / "pro.jsonl")])
    policies: list[ScriptedPolicy] = []
    with pytest.raises(ValueError, match=r"1 instances cannot be graded:\n  pro: .*run_script"):
        run_evaluation(
            settings,
            RunOptions(out_dir=tmp_path / "run", show_progress=False),
            scripted_factory(factory_tokenizer, lambda _t, _s: [tool("submit")], policies),
        )
    assert not policies  # nothing ran
