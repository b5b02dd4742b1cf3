"""SWE-bench Pro grading on its own harness's formats (tests/data/swe/pro_*): the instance's
parser.py turns the run script's log into output.json, which is graded by Pro's rule
(every fail_to_pass and pass_to_pass test PASSED); a missing or malformed report is the
parser's failure; run scripts are found per instance or refused with an actionable error;
binary hunks are dropped and image tags derived as the harness does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout.rewards.graders import GradingSetupError, SWEBenchProGrader
from rollout.rewards.swe_pro import (
    MissingRunScriptsError,
    grade_pro_output,
    load_run_scripts,
    statuses_from_output,
    strip_binary_hunks,
)
from rollout.tasks.swe_spec import from_swebench_pro, swebench_pro_tag
from sandbox.base import SandboxError

DATA = Path(__file__).parent / "data" / "swe"
RUN_SCRIPTS = DATA / "pro_run_scripts"
PRO_ROW: dict[str, Any] = json.loads((DATA / "pro_instance.json").read_text())
SPEC = from_swebench_pro(PRO_ROW, run_scripts_dir=str(RUN_SCRIPTS))
PARSER = RUN_SCRIPTS / SPEC.instance_id / "parser.py"
VERSION_TESTS = "tests/unit/utils/test_version.py"


def run_parser(tmp_path: Path, stdout_log: str, parser: Path = PARSER) -> str | None:
    """What the instance's parser.py writes for a run-script log, as the harness calls it
    (None: it wrote no output.json)."""
    stdout = tmp_path / "stdout.log"
    stdout.write_text(stdout_log)
    output = tmp_path / "output.json"
    output.unlink(missing_ok=True)
    subprocess.run(
        [sys.executable, parser, stdout, DATA / "pro_stderr.log", output],
        capture_output=True,
        check=False,
    )
    return output.read_text() if output.exists() else None


def grade(output_json: str | None) -> Any:
    return grade_pro_output(SPEC.instance_id, SPEC.fail_to_pass, SPEC.pass_to_pass, output_json)


def test_parser_turns_the_run_script_log_into_the_harness_report(tmp_path: Path) -> None:
    output = run_parser(tmp_path, (DATA / "pro_resolved.log").read_text())
    assert output is not None
    assert json.loads(output) == json.loads((DATA / "pro_resolved_output.json").read_text())
    status = statuses_from_output(json.loads(output))
    assert status[f"{VERSION_TESTS}::TestOsInfo::test_mac_real"] == "SKIPPED"
    # An expected failure that failed is a pass in this parser's report.
    assert status[f"{VERSION_TESTS}::TestChromiumVersion::test_prefers_saved_user_agent"] == (
        "PASSED"
    )
    assert not any(name.startswith(("FAILED", "=")) for name in status)


def test_report_of_a_fixing_patch_is_resolved() -> None:
    result = grade((DATA / "pro_resolved_output.json").read_text())
    assert result.resolved and result.reward == 1.0 and result.reason == "resolved"
    assert result.fail_to_pass.success == SPEC.fail_to_pass and len(SPEC.fail_to_pass) == 3
    assert result.pass_to_pass.success == SPEC.pass_to_pass and len(SPEC.pass_to_pass) == 11
    assert len(result.tests_status) == 17 and result.patch_applied


def test_report_with_a_failing_fail_to_pass_test_is_not_resolved(tmp_path: Path) -> None:
    result = grade(run_parser(tmp_path, (DATA / "pro_unresolved.log").read_text()))
    failing = (
        f"{VERSION_TESTS}::TestModuleVersions::test_version_attribute[VERSION-expected_modules0]"
    )
    assert not result.resolved and result.reward == 0.0
    assert result.fail_to_pass.failure == [failing]
    assert result.fail_to_pass.success == SPEC.fail_to_pass[1:]
    assert not result.pass_to_pass.failure
    assert result.tests_status[failing] == "FAILED" and failing in result.reason


@pytest.mark.parametrize(
    ("line", "replacement"),
    [
        ("tests/unit/components/test_blockutils.py::test_blocklist_dl PASSED [100%]\n", ""),
        (
            "tests/unit/components/test_blockutils.py::test_blocklist_dl PASSED",
            "tests/unit/components/test_blockutils.py::test_blocklist_dl SKIPPED",
        ),
    ],
    ids=["missing", "skipped"],
)
def test_pass_to_pass_test_not_reported_passed_is_not_resolved(
    tmp_path: Path, line: str, replacement: str
) -> None:
    log = (DATA / "pro_resolved.log").read_text()
    assert line in log
    result = grade(run_parser(tmp_path, log.replace(line, replacement)))
    assert not result.resolved
    assert result.pass_to_pass.failure == [
        "tests/unit/components/test_blockutils.py::test_blocklist_dl"
    ]
    assert result.fail_to_pass.success == SPEC.fail_to_pass


def test_parser_that_crashes_writes_no_report_and_the_grade_says_so(tmp_path: Path) -> None:
    broken = tmp_path / "parser.py"
    broken.write_text(PARSER.read_text().replace("def parse(", "def parse(\n    1 / 0,"))
    assert run_parser(tmp_path, (DATA / "pro_resolved.log").read_text(), broken) is None
    result = grade(None)
    assert not result.resolved and result.reason == "parser.py wrote no output.json"
    assert result.tests_status == {}


@pytest.mark.parametrize(
    ("output_json", "detail"),
    [
        ("Traceback (most recent call last):", "not a test report"),
        ('{"results": []}', "'tests' must be a list"),
        ('{"tests": [{"name": "t", "status": 1}]}', "string name and status"),
    ],
)
def test_malformed_report_is_not_resolved(output_json: str, detail: str) -> None:
    result = grade(output_json)
    assert not result.resolved and detail in result.reason
    assert result.tests_status == {}


def test_later_report_of_the_same_test_wins_as_in_the_harness_parsers() -> None:
    tests = [{"name": "t", "status": "FAILED"}, {"name": "t", "status": "PASSED"}]
    assert statuses_from_output({"tests": tests}) == {"t": "PASSED"}


def test_instance_with_no_tests_to_pass_is_resolved_by_the_harness_rule() -> None:
    assert grade_pro_output("x", [], [], '{"tests": []}').resolved


def test_run_scripts_come_from_the_spec_folder_then_the_grader_folder(tmp_path: Path) -> None:
    scripts = load_run_scripts(SPEC)
    assert scripts.parser == PARSER.read_text() and "run_selected_tests" in scripts.run_script
    unpointed = from_swebench_pro(PRO_ROW)
    assert unpointed.run_scripts_dir is None
    assert load_run_scripts(unpointed, RUN_SCRIPTS) == scripts
    SWEBenchProGrader(run_scripts_dir=RUN_SCRIPTS).check(unpointed)
    with pytest.raises(MissingRunScriptsError, match=r"give the row .* a run_scripts_dir"):
        SWEBenchProGrader().check(unpointed)


def test_missing_run_script_files_are_named(tmp_path: Path) -> None:
    folder = tmp_path / SPEC.instance_id
    folder.mkdir()
    shutil.copy(PARSER, folder / "parser.py")
    spec = from_swebench_pro(PRO_ROW, run_scripts_dir=str(tmp_path))
    with pytest.raises(MissingRunScriptsError, match=r"no run_script\.sh in .*qutebrowser") as err:
        load_run_scripts(spec)
    # The runner counts it as an infrastructure abort, never a wrong answer.
    assert isinstance(err.value, SandboxError)


def test_pro_grader_needs_a_test_command() -> None:
    spec = SPEC.model_copy(update={"test_command": None})
    with pytest.raises(GradingSetupError, match="needs a test_command"):
        SWEBenchProGrader().check(spec)


def test_row_names_its_run_scripts_folder_over_the_adapter_default() -> None:
    row = {**PRO_ROW, "run_scripts_dir": "/data/pro/run_scripts"}
    spec = from_swebench_pro(row, run_scripts_dir="/elsewhere")
    assert spec.run_scripts_dir == "/data/pro/run_scripts"
    assert "run_scripts_dir" not in spec.extra


def test_binary_hunks_are_dropped_and_text_hunks_kept() -> None:
    text = "diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    literal = (
        "diff --git a/logo.png b/logo.png\nnew file mode 100644\nindex 0000000..1\n"
        "GIT binary patch\nliteral 4\nLcmZ?wbhEO7P\n\n"
    )
    summary = (
        "diff --git a/b.bin b/b.bin\nindex 1..2 100644\nBinary files a/b.bin and b/b.bin differ\n"
    )
    assert strip_binary_hunks(literal + text + summary) == text
    assert strip_binary_hunks(text) == text


@pytest.mark.parametrize(
    ("instance_id", "repo", "published"),
    [
        (
            "instance_NodeBB__NodeBB-00c70ce7b0541cfc94afe567921d7668cdc8f4ac-vnan",
            "NodeBB/NodeBB",
            "nodebb.nodebb-NodeBB__NodeBB-00c70ce7b0541cfc94afe567921d7668cdc8f4ac",
        ),
        (
            "instance_element-hq__element-web-33e8edb3d508d6eefb354819ca693b7accc695e7-vnan",
            "element-hq/element-web",
            "element-hq.element-element-hq__element-web-33e8edb3d508d6eefb354819ca693b7accc695e7",
        ),
        (
            "instance_element-hq__element-web-ec0f940ef0e8e3b61078f145f34dc40d1938e6c5-vnan",
            "element-hq/element-web",
            "element-hq.element-web-element-hq__element-web-ec0f940ef0e8e3b61078f145f34dc40d1938e6c5-vnan",
        ),
        (SPEC.instance_id, "qutebrowser/qutebrowser", PRO_ROW["dockerhub_tag"]),
    ],
    ids=["vnan", "element-web", "element-web-exception", "versioned"],
)
def test_derived_image_tag_follows_the_harness_naming(
    instance_id: str, repo: str, published: str
) -> None:
    assert swebench_pro_tag(instance_id, repo) == published
