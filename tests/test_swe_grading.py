"""SWE-bench grading through the swebench package, on test logs in the real format
(tests/data/swe): parser per repo, FAIL_TO_PASS / PASS_TO_PASS report, resolution."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollout.rewards.swe import (
    SWEGrade,
    UnknownRepoError,
    grade_log,
    parser_name_for_repo,
    swebench_test_spec,
)

DATA = Path(__file__).parent / "data" / "swe"


def _instance(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}_instance.json").read_text())


def _log(name: str) -> str:
    return (DATA / f"{name}.log").read_text()


def test_pytest_log_of_a_fixed_instance_is_resolved() -> None:
    instance = _instance("pytest")
    grade = grade_log(instance, _log("pytest_resolved"))
    assert grade.resolved and grade.reward == 1.0 and grade.reason == "resolved"
    assert grade.fail_to_pass.success == json.loads(instance["FAIL_TO_PASS"])
    assert grade.pass_to_pass.success == json.loads(instance["PASS_TO_PASS"])
    assert not grade.fail_to_pass.failure and not grade.pass_to_pass.failure
    # The summary's xfail is parsed as such; the SKIPPED [1] count line is no test.
    xfail = "testing/test_mark.py::TestKeywordSelection::test_keyword_extra_dash"
    assert grade.tests_status[xfail] == "XFAIL"
    assert not any(name.startswith("[") for name in grade.tests_status)


def test_pytest_log_with_a_failing_fail_to_pass_test_is_not_resolved() -> None:
    grade = grade_log(_instance("pytest"), _log("pytest_unresolved"))
    failing = "testing/test_mark.py::TestFunctional::test_reevaluate_dynamic_expr"
    assert not grade.resolved and grade.reward == 0.0
    assert grade.fail_to_pass.failure == [failing]
    assert len(grade.pass_to_pass.success) == 10 and not grade.pass_to_pass.failure
    assert grade.tests_status[failing] == "FAILED"
    assert failing in grade.reason


def test_django_log_of_a_fixed_instance_is_resolved() -> None:
    instance = _instance("django")
    grade = grade_log(instance, _log("django_resolved"))
    assert grade.resolved
    assert grade.pass_to_pass.success == instance["PASS_TO_PASS"]
    # Django names a test with a docstring by the docstring's first line.
    assert grade.tests_status["Truncation keeps closing HTML tags balanced."] == "PASSED"


def test_django_log_with_a_failing_test_is_not_resolved() -> None:
    grade = grade_log(_instance("django"), _log("django_unresolved"))
    assert not grade.resolved
    assert grade.fail_to_pass.failure == ["test_slugify (utils_tests.test_text.TestUtilsText)"]
    assert not grade.pass_to_pass.failure


def test_a_pass_to_pass_regression_is_not_resolved() -> None:
    log = _log("django_resolved").replace(
        "test_wrap (utils_tests.test_text.TestUtilsText) ... ok",
        "test_wrap (utils_tests.test_text.TestUtilsText) ... ERROR",
    )
    grade = grade_log(_instance("django"), log.replace("Exit Code: 0", "Exit Code: 1"))
    assert not grade.resolved
    assert grade.fail_to_pass.success and grade.pass_to_pass.failure == [
        "test_wrap (utils_tests.test_text.TestUtilsText)"
    ]


def test_log_without_the_test_output_markers_is_not_graded() -> None:
    log = _log("pytest_resolved").replace(">>>>> Start Test Output", "start")
    grade = grade_log(_instance("pytest"), log)
    assert not grade.resolved and "no test results" in grade.reason
    assert grade.tests_status == {}


def test_exit_status_that_contradicts_an_all_passing_log_is_not_graded() -> None:
    """swebench cross-checks the recorded exit status: a run that exited non-zero while
    its output shows no failure (e.g. printed by a patched conftest) is not trusted."""
    log = _log("pytest_resolved").replace("Test Exit Code: 0", "Test Exit Code: 1")
    grade = grade_log(_instance("pytest"), log)
    assert not grade.resolved and "no test results" in grade.reason


def test_parser_and_eval_type_come_from_the_repo_when_the_instance_lacks_them() -> None:
    assert parser_name_for_repo("pytest-dev/pytest") == "parse_log_pytest"
    assert parser_name_for_repo("django/django") == "parse_log_django"
    assert parser_name_for_repo("sympy/sympy") == "parse_log_sympy"
    spec = swebench_test_spec(_instance("pytest"))
    assert (spec.log_parser, spec.eval_type) == ("parse_log_pytest", "pass_and_fail")
    assert spec.image == "swebench/sweb.eval.x86_64.pytest-dev_1776_pytest-7373:latest"
    assert json.loads(_instance("pytest")["FAIL_TO_PASS"]) == spec.FAIL_TO_PASS


def test_eval_script_of_a_swebench5_instance_records_the_test_exit_code() -> None:
    script = swebench_test_spec(_instance("django")).eval_script
    start, end = script.index(">>>>> Start Test Output"), script.index(">>>>> End Test Output")
    assert start < script.index("SWEBENCH_TEST_EXIT_CODE=$?") < end
    assert script.index('echo ">>>>> Test Exit Code: $SWEBENCH_TEST_EXIT_CODE"') > end


def test_repo_without_a_registered_parser_is_refused() -> None:
    with pytest.raises(UnknownRepoError, match="no log parser for repo 'acme/widgets'"):
        parser_name_for_repo("acme/widgets")


def test_grade_reward_follows_resolution() -> None:
    assert SWEGrade(instance_id="x", resolved=True, reason="resolved").reward == 1.0
    assert SWEGrade(instance_id="x", resolved=False, reason="empty patch").reward == 0.0
