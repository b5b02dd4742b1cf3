"""SWE grading: did a patch resolve the task, decided by the swebench package.

One result type (`SWEGrade`) for two entry points that share the grading code:
- `grade_log(instance, log)`: a finished SWE-bench run's test log (the eval script's
  output, with swebench's `>>>>> Start/End Test Output` markers) graded with swebench's
  log parser for the repo and its FAIL_TO_PASS / PASS_TO_PASS report.
- `grade_patch(sandbox, patch, instance, ...)`: the run itself, in a sandbox that holds
  the repository at its base commit: apply the model's patch (`apply_patch`: swebench's
  chain of apply commands), refuse it if it touches protected paths (mini-SWE: the
  tests), run the instance's eval script (which applies the test patch and runs the
  tests), then `grade_log` on what it printed. An empty patch is not applied: the tests
  run on the base commit (the negative control of `opd eval swe --policy empty`; the
  harness does not grade empty submissions otherwise).

The graders of every grading kind (swebench, SWE-bench Pro, test scripts) are in
rollout.rewards.graders; they share `SWEGrade`.

`instance` is a SWE-bench instance dict (instance_id, repo, version, FAIL_TO_PASS,
PASS_TO_PASS as JSON lists or lists, eval_script; log_parser and eval_type as in swebench
5, looked up from the repo when absent). swebench is imported on first use: its harness
modules pull docker, modal and datasets (about a second).
"""

from __future__ import annotations

import asyncio
import fnmatch
import shlex
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sandbox.base import Sandbox

SCRATCH_DIR = ".opd_eval"
"""Where grading files go, relative to the sandbox's working directory (outside the repo)."""
APPLIED = ">>>>> Applied Patch"
APPLY_FAILED = ">>>>> Patch Apply Failed"
NOTHING_APPLIED = "(an empty patch: nothing applied, the tests run on the base commit)"


class UnknownRepoError(KeyError):
    """No swebench log parser is registered for the instance's repo."""

    def __str__(self) -> str:
        return str(self.args[0])


class GradedTests(BaseModel):
    model_config = ConfigDict(frozen=True)

    success: list[str] = Field(default_factory=list)
    failure: list[str] = Field(default_factory=list)


class SWEGrade(BaseModel):
    """How a submission fared; reward 1 iff resolved."""

    model_config = ConfigDict(frozen=True)

    instance_id: str
    resolved: bool
    reason: str
    """'resolved', or why not (no patch, did not apply, edits tests, tests failed, ...)."""
    patch_applied: bool = False
    fail_to_pass: GradedTests = Field(default_factory=GradedTests)
    pass_to_pass: GradedTests = Field(default_factory=GradedTests)
    tests_status: dict[str, str] = Field(default_factory=dict)
    """Every test the log parser found, with its swebench status (PASSED, FAILED, ...)."""
    log: str = ""
    """The eval script's output (or the apply command's, when the patch did not apply)."""

    @property
    def reward(self) -> float:
        return 1.0 if self.resolved else 0.0


def parser_name_for_repo(repo: str) -> str:
    """The swebench log parser registered for `repo` (e.g. 'django/django')."""
    from swebench.harness.log_parsers import (
        PARSER_REGISTRY,
        c,
        go,
        java,
        javascript,
        php,
        python,
        ruby,
        rust,
    )

    repo_maps = (
        python.MAP_REPO_TO_PARSER_PY,
        javascript.MAP_REPO_TO_PARSER_JS,
        c.MAP_REPO_TO_PARSER_C,
        go.MAP_REPO_TO_PARSER_GO,
        java.MAP_REPO_TO_PARSER_JAVA,
        php.MAP_REPO_TO_PARSER_PHP,
        ruby.MAP_REPO_TO_PARSER_RUBY,
        rust.MAP_REPO_TO_PARSER_RUST,
    )
    for repo_map in repo_maps:
        if repo in repo_map:
            return next(name for name, fn in PARSER_REGISTRY.items() if fn is repo_map[repo])
    raise UnknownRepoError(
        f"swebench has no log parser for repo {repo!r}: give the instance a 'log_parser' "
        "(a key of swebench.harness.log_parsers.PARSER_REGISTRY)"
    )


def swebench_test_spec(instance: Mapping[str, Any]) -> Any:
    """swebench's TestSpec for `instance`, filling what swebench 5 instances carry and
    older ones lack (log parser, eval type, image name) from the repo."""
    from swebench.harness.constants import FAIL_ONLY_REPOS, EvalType
    from swebench.harness.utils import make_test_spec

    from rollout.tasks.swe_spec import swebench_image

    repo = instance["repo"]
    instance_id = instance["instance_id"]
    fail_only = repo in FAIL_ONLY_REPOS
    return make_test_spec(
        {
            **instance,
            "image": instance.get("image") or swebench_image(instance_id),
            "eval_script": instance.get("eval_script") or "",
            "log_parser": instance.get("log_parser") or parser_name_for_repo(repo),
            "eval_type": instance.get("eval_type")
            or (EvalType.FAIL_ONLY if fail_only else EvalType.PASS_AND_FAIL).value,
        }
    )


def grade_log(instance: Mapping[str, Any], log: str) -> SWEGrade:
    """Grade a SWE-bench test log with swebench's parser and resolution rules."""
    return _grade_spec_log(swebench_test_spec(instance), log)


def _grade_spec_log(test_spec: Any, log: str) -> SWEGrade:
    from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS, EvalType, ResolvedStatus
    from swebench.harness.grading import (
        get_eval_tests_report,
        get_logs_eval,
        get_resolution_status,
    )

    with tempfile.TemporaryDirectory(prefix="opd-swe-grade-") as tmp:
        log_path = Path(tmp) / "test_output.txt"
        log_path.write_text(log, encoding="utf-8")
        status_map, found = get_logs_eval(test_spec, str(log_path))
    base = {"instance_id": test_spec.instance_id, "patch_applied": True, "log": log}
    if not found:
        return SWEGrade(
            **base,
            resolved=False,
            reason="no test results in the log (markers missing, tests errored, or the "
            "test command's exit status contradicts its output)",
        )
    gold = {FAIL_TO_PASS: test_spec.FAIL_TO_PASS, PASS_TO_PASS: test_spec.PASS_TO_PASS}
    report = get_eval_tests_report(status_map, gold, eval_type=EvalType(test_spec.eval_type))
    f2p, p2p = GradedTests(**report[FAIL_TO_PASS]), GradedTests(**report[PASS_TO_PASS])
    resolved = get_resolution_status(report) == ResolvedStatus.FULL.value
    reason = "resolved" if resolved else failure_reason(f2p, p2p)
    return SWEGrade(
        **base,
        resolved=resolved,
        reason=reason,
        fail_to_pass=f2p,
        pass_to_pass=p2p,
        tests_status=status_map,
    )


def failure_reason(f2p: GradedTests, p2p: GradedTests) -> str:
    """Which FAIL_TO_PASS / PASS_TO_PASS tests did not pass (the first three named)."""
    failed = [*f2p.failure, *p2p.failure]
    shown = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
    return (
        f"{len(f2p.failure)} FAIL_TO_PASS and {len(p2p.failure)} PASS_TO_PASS tests "
        f"did not pass: {shown}"
    )


class EvalRun(BaseModel):
    """What happened in the sandbox: the apply step, the protected-path check, the tests."""

    model_config = ConfigDict(frozen=True)

    applied: bool
    apply_output: str
    protected_touched: list[str] = Field(default_factory=list)
    """Changed paths (relative to the repo) that match a protected pattern."""
    log: str = ""
    """The eval script's combined stdout and stderr (empty when it did not run)."""
    timed_out: bool = False


async def apply_patch(
    sandbox: Sandbox,
    model_patch: str,
    repo_dir: str,
    timeout_s: float,
    commands: Sequence[str] | None = None,
    scratch_dir: str = SCRATCH_DIR,
) -> tuple[bool, str]:
    """Apply `model_patch` to the repository at `repo_dir` with the first of `commands`
    that succeeds (default: swebench's chain, GIT_APPLY_CMDS); a patch already in the
    tree counts as applied. Returns whether it applied and the commands' output."""
    if commands is None:
        from swebench.harness.run_evaluation import GIT_APPLY_CMDS

        commands = GIT_APPLY_CMDS
    await sandbox.write_file(f"{scratch_dir}/model.patch", model_patch.encode())
    repo = shlex.quote(repo_dir)
    # Each failed attempt (notably --reject) leaves partial state: reset before the next.
    attempts = " ".join(shlex.quote(cmd) for cmd in commands)
    apply = (
        f'patch_file="$PWD/{scratch_dir}/model.patch"; cd {repo} || exit 1\n'
        f"for apply in {attempts}; do\n"
        f'  $apply "$patch_file" && {{ echo "{APPLIED}"; exit 0; }}\n'
        "  git checkout -q -- . ; git clean -fdq\n"
        "done\n"
        f'git apply --check --reverse "$patch_file" && {{ echo "{APPLIED}"; exit 0; }}\n'
        f'echo "{APPLY_FAILED}"; exit 1\n'
    )
    applied = await sandbox.exec(f"exec 2>&1\n{apply}", timeout_s)
    return applied.ok, applied.stdout


async def run_eval(
    sandbox: Sandbox,
    model_patch: str,
    eval_script: str,
    repo_dir: str,
    timeout_s: float,
    protected_paths: Sequence[str] = (),
    scratch_dir: str = SCRATCH_DIR,
) -> EvalRun:
    """Apply `model_patch` to the repository at `repo_dir` and run `eval_script`, as
    swebench's run_instance does in a container; `sandbox` must hold the repository at
    its base commit and nothing else of the episode. An empty `model_patch` is not
    applied: the tests run on the base commit."""
    applied, apply_output = True, NOTHING_APPLIED
    if model_patch.strip():
        applied, apply_output = await apply_patch(
            sandbox, model_patch, repo_dir, timeout_s, scratch_dir=scratch_dir
        )
    if not applied:
        return EvalRun(applied=False, apply_output=apply_output)
    touched = await _protected_changes(sandbox, repo_dir, protected_paths, timeout_s)
    if touched:
        return EvalRun(applied=True, apply_output=apply_output, protected_touched=touched)
    await sandbox.write_file(f"{scratch_dir}/eval.sh", eval_script.encode())
    # One file for both streams keeps the order the markers and the test output came in.
    ran = await sandbox.exec(
        f"bash {scratch_dir}/eval.sh > {scratch_dir}/test_output.txt 2>&1", timeout_s
    )
    log = (await sandbox.read_file(f"{scratch_dir}/test_output.txt")).decode(errors="replace")
    return EvalRun(applied=True, apply_output=apply_output, log=log, timed_out=ran.timed_out)


async def _protected_changes(
    sandbox: Sandbox, repo_dir: str, patterns: Sequence[str], timeout_s: float
) -> list[str]:
    """Paths the applied patch changed that match `patterns`, as git sees them (ignored
    files included, so a patch cannot hide a file behind its own .gitignore)."""
    if not patterns:
        return []
    status = await sandbox.exec(
        "git status --porcelain -z --ignored=matching --untracked-files=all --no-renames",
        timeout_s,
        cwd=repo_dir,
    )
    if not status.ok:
        # The patch may have broken the repository itself; judge by the patch alone then.
        return [f"(git status failed: {status.stderr.strip()})"]
    paths = [entry[3:] for entry in status.stdout.split("\0") if len(entry) > 3]
    return [p for p in paths if any(fnmatch.fnmatchcase(p, pat) for pat in patterns)]


async def grade_patch(
    sandbox: Sandbox,
    model_patch: str,
    instance: Mapping[str, Any],
    repo_dir: str,
    timeout_s: float,
    protected_paths: Sequence[str] = (),
) -> SWEGrade:
    """Run the evaluation of `model_patch` in `sandbox` and grade it (an empty patch:
    the tests on the base commit)."""
    test_spec = await asyncio.to_thread(swebench_test_spec, instance)
    instance_id = test_spec.instance_id
    run = await run_eval(
        sandbox, model_patch, test_spec.eval_script, repo_dir, timeout_s, protected_paths
    )
    if not run.applied:
        return SWEGrade(
            instance_id=instance_id,
            resolved=False,
            reason="the patch did not apply",
            log=run.apply_output,
        )
    if run.protected_touched:
        return SWEGrade(
            instance_id=instance_id,
            resolved=False,
            reason=f"the patch edits test files: {', '.join(run.protected_touched)}",
            patch_applied=True,
            log=run.apply_output,
        )
    if run.timed_out:
        return SWEGrade(
            instance_id=instance_id,
            resolved=False,
            reason=f"the tests timed out after {timeout_s:g} s",
            patch_applied=True,
            log=run.log,
        )
    return await asyncio.to_thread(_grade_spec_log, test_spec, run.log)
