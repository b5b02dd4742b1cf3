"""Graders: how a SWE task's submission is judged, one per grading kind of a SWETaskSpec.

A `Grader` gets a started sandbox that holds the task's repository at its base commit
(prepared by the task family, nothing of the agent's episode in it) and the submitted
patch, and returns one `SWEGrade`. `check(spec)` says up front, before the task's setup
or any agent turn, whether the task can be graded at all (an eval script, run scripts, a
log parser); what it raises is a SandboxError, so the runner counts the trajectory as an
infrastructure abort, never as a wrong answer.

- `SWEBenchGrader` ("swebench"): the swebench package (rollout.rewards.swe.grade_patch):
  swebench's apply chain, the row's eval script, the repo's log parser.
- `SWEBenchProGrader` ("swebench_pro"): SWE-bench Pro's harness (rollout.rewards.swe_pro)
  with the instance's run_script.sh and parser.py.
- `ScriptGrader` ("script", SWE-Gym / SWE-smith rows): an eval script in swebench's shape
  made from the spec (the test patch's files reset to the base commit, the test patch
  applied, `eval_setup_commands`, then `test_command` between swebench's markers), graded
  by the swebench package with `log_parser` (pytest's by default).

No grader refuses a patch for touching test files: as in SWE-bench's and Pro's harnesses,
the files the grading tests live in are overwritten at grading (the test patch, the fix
commit's tests), so an edit there is discarded, not scored. Refusing it instead would
score differently from the official harnesses (agents often add tests to those files).
"""

from __future__ import annotations

import asyncio
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from rollout.rewards.swe import SWEGrade, UnknownRepoError, grade_patch, parser_name_for_repo
from rollout.rewards.swe_pro import PRO_WORKSPACE, grade_pro_patch, load_run_scripts
from rollout.tasks.swe_eval_scripts import MAKE_THEM
from rollout.tasks.swe_spec import SWETaskSpec
from sandbox.base import Sandbox, SandboxError

DEFAULT_SCRIPT_PARSER = "parse_log_pytest"
"""The swebench log parser of "script" grading when the spec names none."""
_DIFF_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
_SCRIPT_TEMPLATE = """#!/bin/bash
set -xo pipefail
cd {workdir}
git status
git -c core.fileMode=false diff {base}
{reset_tests}
{apply_tests}
{eval_setup}
: '>>>>> Start Test Output'
{test_command}
: '>>>>> End Test Output'
"""


class GradingSetupError(SandboxError):
    """The task cannot be graded as configured (no eval script, no test command, no log
    parser, an unknown grading kind); the message says what to give it."""


class Grader(Protocol):
    """Judges submissions to SWE tasks of one grading kind."""

    def check(self, spec: SWETaskSpec) -> None:
        """Raise GradingSetupError (or another SandboxError) when `spec` cannot be
        graded; cheap (no sandbox), run when a sandbox of the task is prepared."""
        ...

    async def grade(
        self, spec: SWETaskSpec, sandbox: Sandbox, model_patch: str, timeout_s: float
    ) -> SWEGrade:
        """Apply `model_patch` in `sandbox` (the repository at `spec.workdir`, at its
        base commit), run the task's tests with `timeout_s` per step, and judge them."""
        ...


def swebench_instance(spec: SWETaskSpec, eval_script: str | None = None) -> dict[str, Any]:
    """The task as a SWE-bench instance dict (what rollout.rewards.swe reads, and the
    fields of a swebench prediction's instance)."""
    instance: dict[str, Any] = {
        "instance_id": spec.instance_id,
        "repo": spec.repo,
        "version": spec.version or "",
        "base_commit": spec.base_commit or "",
        "problem_statement": spec.problem_statement,
        "patch": spec.gold_patch,
        "test_patch": spec.test_patch,
        "FAIL_TO_PASS": spec.fail_to_pass,
        "PASS_TO_PASS": spec.pass_to_pass,
        "eval_script": eval_script if eval_script is not None else spec.eval_script or "",
        "log_parser": spec.log_parser,
        "image": spec.image,
    }
    if "eval_type" in spec.extra:  # swebench 5 rows carry it; else derived from the repo
        instance["eval_type"] = spec.extra["eval_type"]
    return instance


def _check_log_parser(spec: SWETaskSpec, log_parser: str | None) -> None:
    """`log_parser` (None: the one swebench registers for the spec's repo) exists."""
    if log_parser is None:
        try:
            parser_name_for_repo(spec.repo)
        except UnknownRepoError as exc:
            raise GradingSetupError(f"{spec.instance_id}: {exc}") from exc
        return
    from swebench.harness.log_parsers import PARSER_REGISTRY

    if log_parser not in PARSER_REGISTRY:
        raise GradingSetupError(
            f"{spec.instance_id}: log_parser {log_parser!r} is not a key of "
            "swebench.harness.log_parsers.PARSER_REGISTRY"
        )


class SWEBenchGrader:
    """SWE-bench's grading through the swebench package ("swebench")."""

    def check(self, spec: SWETaskSpec) -> None:
        if not (spec.eval_script or "").strip():
            raise GradingSetupError(
                f"{spec.instance_id}: swebench grading needs the row's eval_script (swebench 5 "
                f"datasets carry one): {MAKE_THEM}; or give the row a test_command and "
                "grading 'script'"
            )
        _check_log_parser(spec, spec.log_parser)

    async def grade(
        self, spec: SWETaskSpec, sandbox: Sandbox, model_patch: str, timeout_s: float
    ) -> SWEGrade:
        return await grade_patch(
            sandbox, model_patch, swebench_instance(spec), spec.workdir, timeout_s
        )


class SWEBenchProGrader:
    """SWE-bench Pro's harness ("swebench_pro"); see rollout.rewards.swe_pro.

    `run_scripts_dir`: a copy of run_scripts/ from scaleapi/SWE-bench_Pro-os, used for
    specs that name none; `workspace_dir`: where the scripts and logs go in the sandbox,
    the directory the specs' test_command names."""

    def __init__(
        self, run_scripts_dir: Path | None = None, workspace_dir: str = PRO_WORKSPACE
    ) -> None:
        self.run_scripts_dir = run_scripts_dir
        self.workspace_dir = workspace_dir

    def check(self, spec: SWETaskSpec) -> None:
        if not (spec.test_command or "").strip():
            raise GradingSetupError(
                f"{spec.instance_id}: SWE-bench Pro grading needs a test_command (the "
                "run_script.sh call from_swebench_pro makes)"
            )
        load_run_scripts(spec, self.run_scripts_dir)

    async def grade(
        self, spec: SWETaskSpec, sandbox: Sandbox, model_patch: str, timeout_s: float
    ) -> SWEGrade:
        scripts = await asyncio.to_thread(load_run_scripts, spec, self.run_scripts_dir)
        return await grade_pro_patch(
            sandbox, model_patch, spec, scripts, timeout_s, self.workspace_dir
        )


def patch_paths(test_patch: str) -> list[str]:
    """The repository paths a git diff touches (both sides of renames), in order."""
    pairs = _DIFF_HEADER.findall(test_patch)
    return list(dict.fromkeys(path for pair in pairs for path in pair))


def script_eval_script(spec: SWETaskSpec) -> str:
    """The eval script of "script" grading, in the shape of swebench's (set -x trace,
    `: '>>>>> ...'` markers, which swebench's TestSpec adds the exit-code record to)."""
    from swebench.utils import generate_heredoc_delimiter

    base = shlex.quote(spec.base_commit or "HEAD")
    reset_tests = ""
    if paths := patch_paths(spec.test_patch):
        # Back to the base version (or gone, when the test patch adds the file).
        quoted = " ".join(shlex.quote(path) for path in paths)
        reset_tests = (
            f'for f in {quoted}; do if git cat-file -e {base}:"$f" 2>/dev/null; '
            f'then git checkout -q {base} -- "$f"; else rm -f -- "$f"; fi; done'
        )
    apply_tests = ""
    if spec.test_patch.strip():
        delimiter = generate_heredoc_delimiter(spec.test_patch)
        patch = spec.test_patch if spec.test_patch.endswith("\n") else spec.test_patch + "\n"
        apply_tests = f"git apply -v - <<'{delimiter}'\n{patch}{delimiter}"
    return _SCRIPT_TEMPLATE.format(
        workdir=shlex.quote(spec.workdir),
        base=base,
        reset_tests=reset_tests,
        apply_tests=apply_tests,
        eval_setup="\n".join(spec.eval_setup_commands),
        test_command=spec.test_command,
    )


class ScriptGrader:
    """`test_command` graded by a swebench log parser ("script")."""

    def check(self, spec: SWETaskSpec) -> None:
        if not (spec.test_command or "").strip():
            raise GradingSetupError(f"{spec.instance_id}: script grading needs a test_command")
        _check_log_parser(spec, spec.log_parser or DEFAULT_SCRIPT_PARSER)

    async def grade(
        self, spec: SWETaskSpec, sandbox: Sandbox, model_patch: str, timeout_s: float
    ) -> SWEGrade:
        instance = swebench_instance(spec, script_eval_script(spec))
        instance |= {
            "log_parser": spec.log_parser or DEFAULT_SCRIPT_PARSER,
            "eval_type": "pass_and_fail",
        }
        return await grade_patch(sandbox, model_patch, instance, spec.workdir, timeout_s)


def default_graders() -> dict[str, Grader]:
    """A grader per grading kind, with default settings (no Pro run-scripts folder: specs
    must name theirs)."""
    return {
        "swebench": SWEBenchGrader(),
        "swebench_pro": SWEBenchProGrader(),
        "script": ScriptGrader(),
    }


def grader_for(spec: SWETaskSpec, graders: Mapping[str, Grader]) -> Grader:
    if spec.grading not in graders:
        raise GradingSetupError(
            f"{spec.instance_id}: no grader for grading kind {spec.grading!r}; "
            f"known: {sorted(graders)}"
        )
    return graders[spec.grading]
