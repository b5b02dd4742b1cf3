"""SWE-bench Pro grading: its own harness's procedure, not the swebench package.

SWE-bench Pro (scaleapi/SWE-bench_Pro-os, swe_bench_pro_eval.py) grades one instance with
an entry script run in the instance's image:

    cd /app
    git reset --hard <base_commit>; git checkout <base_commit>
    git apply -v /workspace/patch.diff            (binary hunks stripped first)
    <last line of before_repo_set_cmd>            (checks the tests out of the fix commit)
    bash /workspace/run_script.sh <selected test files, comma-joined>
        > /workspace/stdout.log 2> /workspace/stderr.log
    python /workspace/parser.py /workspace/stdout.log /workspace/stderr.log /workspace/output.json

run_script.sh and parser.py are per instance (run_scripts/<instance_id>/ in that
repository, not in the dataset row). parser.py writes `{"tests": [{"name", "status"}]}`
with statuses PASSED, FAILED, SKIPPED or ERROR, and the instance is resolved when every
fail_to_pass and pass_to_pass test is among the PASSED ones (an empty set of both is
resolved, as there). Where the harness would go on after a failed `git apply` and let
the tests fail, this one stops and says so; a missing output.json is "the parser
failed", not a wrong answer in disguise. The ENV lines of the instance's Dockerfiles,
which the harness re-exports, are already in the image's environment.

The spec's `test_command` and `eval_setup_commands` (rollout.tasks.swe_spec) hold the
run-script call and the before_repo_set_cmd line; `grade_pro_patch` runs the rest.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from rollout.rewards.swe import (
    NOTHING_APPLIED,
    SCRATCH_DIR,
    GradedTests,
    SWEGrade,
    apply_patch,
    failure_reason,
)
from rollout.tasks.swe_spec import SWETaskSpec
from sandbox.base import Sandbox, SandboxError, SandboxFileError

PRO_WORKSPACE = "/workspace"
"""Where SWE-bench Pro's harness puts run_script.sh, parser.py and the logs."""
PRO_APPLY_COMMANDS = ("git apply -v",)
"""The harness's only way of applying the patch."""
PASSED = "PASSED"
_DIFF_SECTION = re.compile(r"(?=^diff --git )", re.MULTILINE)
_BINARY = re.compile(r"^(Binary files .* differ|GIT binary patch)$", re.MULTILINE)


class MissingRunScriptsError(SandboxError):
    """The instance's run_script.sh or parser.py is not where the grader looks: the task
    cannot be graded (an infrastructure abort, as SWE-bench Pro's harness counts it)."""


class ProWorkspaceError(SandboxError):
    """The grading files could not be put into the sandbox's workspace directory."""


class ProRunScripts(BaseModel):
    """One instance's run_script.sh and parser.py, as text."""

    model_config = ConfigDict(frozen=True)

    run_script: str
    parser: str


def run_scripts_path(spec: SWETaskSpec, default_dir: Path | None = None) -> Path:
    """The folder holding the instance's scripts: `<run_scripts_dir>/<instance_id>`, the
    spec's directory first, then `default_dir`."""
    base = spec.run_scripts_dir or default_dir
    if base is None:
        raise MissingRunScriptsError(
            f"{spec.instance_id}: SWE-bench Pro grading needs the instance's run_script.sh "
            "and parser.py; give the row (or from_swebench_pro) a run_scripts_dir, or the "
            "grader one: a copy of run_scripts/ from scaleapi/SWE-bench_Pro-os"
        )
    return Path(base) / spec.instance_id


def load_run_scripts(spec: SWETaskSpec, default_dir: Path | None = None) -> ProRunScripts:
    """Read the instance's scripts; raises MissingRunScriptsError naming what is missing."""
    folder = run_scripts_path(spec, default_dir)
    missing = [name for name in ("run_script.sh", "parser.py") if not (folder / name).is_file()]
    if missing:
        raise MissingRunScriptsError(
            f"{spec.instance_id}: no {' or '.join(missing)} in {folder} (SWE-bench Pro keeps "
            "them in run_scripts/<instance_id>/ of scaleapi/SWE-bench_Pro-os)"
        )
    return ProRunScripts(
        run_script=(folder / "run_script.sh").read_text(encoding="utf-8"),
        parser=(folder / "parser.py").read_text(encoding="utf-8"),
    )


def strip_binary_hunks(patch: str) -> str:
    """`patch` without the files whose diff is binary (the harness drops them too)."""
    sections = _DIFF_SECTION.split(patch)
    return "".join(s for s in sections if s.strip() and _BINARY.search(s) is None)


def statuses_from_output(output: Mapping[str, Any]) -> dict[str, str]:
    """Test name -> status from parser.py's output.json; a later entry of the same name
    wins (the harness's parsers deduplicate that way). Raises ValueError when the
    document does not have the shape `{"tests": [{"name": str, "status": str}, ...]}`."""
    tests = output.get("tests")
    if not isinstance(tests, list):
        raise ValueError(f"'tests' must be a list, got {type(tests).__name__}")
    status: dict[str, str] = {}
    for entry in tests:
        if not (
            isinstance(entry, Mapping)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("status"), str)
        ):
            raise ValueError(f"each test needs a string name and status, got {entry!r:.200}")
        status[entry["name"]] = entry["status"]
    return status


def grade_pro_output(
    instance_id: str,
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    output_json: str | None,
    log: str = "",
) -> SWEGrade:
    """Grade parser.py's output.json text (None: the parser wrote none) by SWE-bench Pro's
    rule: resolved iff every fail_to_pass and pass_to_pass test PASSED."""
    base: dict[str, Any] = {"instance_id": instance_id, "patch_applied": True, "log": log}
    if output_json is None:
        return SWEGrade(**base, resolved=False, reason="parser.py wrote no output.json")
    try:
        status = statuses_from_output(json.loads(output_json))
    except (json.JSONDecodeError, ValueError) as exc:
        reason = f"parser.py's output.json is not a test report: {exc}"
        return SWEGrade(**base, resolved=False, reason=reason)

    def graded(names: Sequence[str]) -> GradedTests:
        return GradedTests(
            success=[n for n in names if status.get(n) == PASSED],
            failure=[n for n in names if status.get(n) != PASSED],
        )

    f2p, p2p = graded(fail_to_pass), graded(pass_to_pass)
    resolved = not f2p.failure and not p2p.failure
    return SWEGrade(
        **base,
        resolved=resolved,
        reason="resolved" if resolved else failure_reason(f2p, p2p),
        fail_to_pass=f2p,
        pass_to_pass=p2p,
        tests_status=status,
    )


async def grade_pro_patch(
    sandbox: Sandbox,
    model_patch: str,
    spec: SWETaskSpec,
    scripts: ProRunScripts,
    timeout_s: float,
    workspace_dir: str = PRO_WORKSPACE,
    scratch_dir: str = SCRATCH_DIR,
) -> SWEGrade:
    """Run SWE-bench Pro's evaluation of `model_patch` in `sandbox` (the repository at
    `spec.workdir`, at its base commit) and grade parser.py's report. `workspace_dir`
    must be the directory `spec.test_command` names (Pro's: /workspace). An empty patch is
    not applied: the tests run on the base commit."""
    instance_id = spec.instance_id
    workspace, repo = shlex.quote(workspace_dir), spec.workdir
    for name, text in (("run_script.sh", scripts.run_script), ("parser.py", scripts.parser)):
        await sandbox.write_file(f"{scratch_dir}/{name}", text.encode())
    placed = await sandbox.exec(
        f"mkdir -p {workspace} && cp {scratch_dir}/run_script.sh {scratch_dir}/parser.py "
        f"{workspace}/ && rm -f {workspace}/stdout.log {workspace}/stderr.log "
        f"{workspace}/output.json",
        timeout_s,
    )
    if not placed.ok:
        raise ProWorkspaceError(
            f"{instance_id}: cannot put run_script.sh and parser.py into {workspace_dir} in "
            f"the sandbox: {(placed.stderr or placed.stdout).strip()}"
        )
    if spec.base_commit:
        base = shlex.quote(spec.base_commit)
        await sandbox.exec(
            f"git reset -q --hard {base} && git checkout -q {base}", timeout_s, cwd=repo
        )
    applied, apply_output = True, NOTHING_APPLIED
    if model_patch.strip():
        applied, apply_output = await apply_patch(
            sandbox,
            strip_binary_hunks(model_patch),
            repo,
            timeout_s,
            PRO_APPLY_COMMANDS,
            scratch_dir,
        )
    if not applied:
        return SWEGrade(
            instance_id=instance_id,
            resolved=False,
            reason="the patch did not apply",
            log=apply_output,
        )
    # No `set -e`, as in the harness: a failing setup line shows in the tests' results.
    tests = "\n".join(
        [
            *spec.eval_setup_commands,
            f"{spec.test_command} > {workspace}/stdout.log 2> {workspace}/stderr.log",
        ]
    )
    ran = await sandbox.exec(tests, timeout_s, cwd=repo)
    if ran.timed_out:
        return SWEGrade(
            instance_id=instance_id,
            resolved=False,
            reason=f"the tests timed out after {timeout_s:g} s",
            patch_applied=True,
            log=await _fetch_logs(sandbox, workspace, scratch_dir, timeout_s),
        )
    parse = (
        f'py=$(command -v python || command -v python3) && "$py" {workspace}/parser.py '
        f"{workspace}/stdout.log {workspace}/stderr.log {workspace}/output.json"
    )
    parsed = await sandbox.exec(f"exec 2>&1; {parse}", timeout_s, cwd=repo)
    log = await _fetch_logs(sandbox, workspace, scratch_dir, timeout_s)
    output_json = await _read_optional(sandbox, f"{scratch_dir}/output.json")
    grade = grade_pro_output(instance_id, spec.fail_to_pass, spec.pass_to_pass, output_json, log)
    if output_json is None:  # the parser's own words say why
        detail = (
            f"{grade.reason} (parser.py exited {parsed.exit_code}: {parsed.stdout.strip()[-2000:]})"
        )
        return grade.model_copy(update={"reason": detail})
    return grade


async def _fetch_logs(sandbox: Sandbox, workspace: str, scratch_dir: str, timeout_s: float) -> str:
    """stdout.log and stderr.log (and output.json into the scratch folder), as one log."""
    copies = [
        f"rm -f {scratch_dir}/{name}; cp {workspace}/{name} {scratch_dir}/ 2>/dev/null"
        for name in ("stdout.log", "stderr.log", "output.json")
    ]
    await sandbox.exec("; ".join(copies) + "; true", timeout_s)
    stdout = await _read_optional(sandbox, f"{scratch_dir}/stdout.log") or ""
    stderr = await _read_optional(sandbox, f"{scratch_dir}/stderr.log") or ""
    return stdout + (f"\n>>>>> stderr\n{stderr}" if stderr else "")


async def _read_optional(sandbox: Sandbox, path: str) -> str | None:
    try:
        return (await sandbox.read_file(path)).decode(errors="replace")
    except SandboxFileError:
        return None
