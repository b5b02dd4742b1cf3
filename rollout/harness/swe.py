"""The minimal SWE harness: a bash tool and a submit tool, in the manner of mini-swe-agent.

- Action: `bash {"command": ...}` runs the command with bash in a new shell whose working
  directory is the task's repository, inside the episode's sandbox; stderr is merged into
  stdout. Observation: exit code and output, the output cut to its head and tail past
  `max_output_chars`. A command the shell refused (not found, syntax error) is tier 2.
- Submission: the `submit` tool (no arguments) ends the episode; the submission is the
  repository's `git diff` against the base commit, new files included, captured then.
- Step limit: every turn counts (invalid ones too); after `step_limit` turns without a
  submit the episode ends unsubmitted, and an unsubmitted episode's reward is 0.
- Reward: the submission graded in a fresh sandbox by the task's family (apply it, run
  the tests, judge them: rollout.rewards). The grade is kept on the episode
  (`episode.grade`). An empty submission is unresolved without running the tests, unless
  `grade_empty_submissions` (the negative control of a benchmark: the tests run on the
  unchanged repository and must fail).
- Files (`keep_grade_files`): `details()` also carries the grade as files an evaluation
  run keeps per instance (report.json, test_output.txt, patch.diff) and the counts of
  FAIL_TO_PASS / PASS_TO_PASS tests that passed.
- Environment: a family may name shell text that enters the repository's environment
  (`env_setup`: SWE-bench images' conda env `testbed`, which they activate only in
  /root/.bashrc). Then the agent's commands and the grading's run after it in the same
  shell (`in_environment`): its output hidden, each command's exit status its own (the
  task's setup, which makes the repository, and the harness's own git commands go
  without). A new sandbox whose environment cannot be entered is an
  `EnvironmentSetupError` (the task's image failed, not the agent); once the agent broke
  it, each command fails with exit `ENV_SETUP_FAILED_EXIT` and says why, unrun.

A task kind maps to an `SWETaskFamily`, which knows the task's image, where the
repository is, how to enter its environment, how to put it into a sandbox and how to
grade a submission. Defaults: mini-SWE (`mini_swe`: local sandboxes, graded by the
swebench package) and the spec family (`swebench`, `swebench_pro`, `generic_swe`:
rollout.tasks.swe_family, one image per task).
Sandboxes come from `sandbox_factory(image)`: the task's image, or None for tasks without
one (default: a LocalSandbox for None, a DockerSandbox of that image otherwise;
`Fleet.sandbox` fits too).
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from rollout.chat import Message, RecordedTurn
from rollout.harness.base import SUBMITTED_REASON, StepOutcome
from rollout.harness.prompts import read_prompts
from rollout.harness.swe_env import (
    EnvironmentSandbox,
    EnvironmentSetupError,
    in_environment,
)
from rollout.masking import classify_turn
from rollout.rewards.swe import SWEGrade, grade_patch
from rollout.tasks.mini_swe import MiniSWETasks
from rollout.tasks.swe_family import SPEC_KINDS, SWESpecTasks
from rollout.toolcalls import ToolCall
from rollout.trajectory import MaskTier, Task
from sandbox.base import ExecResult, Sandbox, SandboxError, SandboxFileError
from sandbox.docker import DockerSandbox, DockerSandboxConfig
from sandbox.jail import SAFE_PATH
from sandbox.local import LocalSandbox, LocalSandboxConfig

SUBMISSION_FILE = ".opd_submission.patch"
"""Where the submitted diff is written, relative to the sandbox's working directory."""

GRADE_REPORT_FILE = "report.json"
TEST_OUTPUT_FILE = "test_output.txt"
PATCH_FILE = "patch.diff"
"""The files of a grade (`keep_grade_files`), named as swebench's harness names its logs."""

SandboxFactory = Callable[[str | None], Sandbox]
"""A new, unstarted sandbox for a task's image (None: a task without one)."""


class UnknownTaskKindError(KeyError):
    """The swe harness has no task family for the task's kind."""

    def __str__(self) -> str:
        return str(self.args[0])


class UnknownBaseCommitError(SandboxError):
    """The prepared repository has no commit to diff the submission against (the task's
    setup failed, not the agent)."""


class SWETaskFamily(Protocol):
    """What the swe harness needs from a kind of task."""

    def image(self, task: Task) -> str | None:
        """The image of the task's sandboxes; None: the harness's image-less sandbox."""
        ...

    def repo_dir(self, task: Task) -> str:
        """The repository in the sandbox: every command's working directory."""
        ...

    def env_setup(self, task: Task) -> str | None:
        """Shell text that enters the repository's environment, run before each of the
        agent's commands and the grading's (`in_environment`); None: the image's
        environment as it is."""
        ...

    async def prepare(self, task: Task, sandbox: Sandbox) -> None:
        """Put the repository at its base commit into a started sandbox (the agent's, and
        a fresh one for grading); raises sandbox.SandboxError when it cannot."""
        ...

    async def grade(
        self, task: Task, sandbox: Sandbox, model_patch: str, timeout_s: float
    ) -> SWEGrade:
        """Judge `model_patch` in `sandbox`, a fresh one that `prepare` filled (an empty
        patch: the tests on the unchanged repository)."""
        ...

    def reference_patch(self, task: Task) -> str:
        """The dataset's fix of the task ('' when its row has none): what
        `opd eval swe --policy gold` applies."""
        ...


class SWEBenchInstanceTasks(Protocol):
    """Tasks that describe themselves as SWE-bench instances and need no image (mini-SWE)."""

    def repo_dir(self, task: Task) -> str: ...

    async def prepare(self, task: Task, sandbox: Sandbox) -> None: ...

    def instance(self, task: Task) -> dict[str, Any]:
        """The task as a SWE-bench instance (FAIL_TO_PASS, PASS_TO_PASS, eval_script, ...)."""
        ...

    def protected_paths(self, task: Task) -> list[str]:
        """fnmatch patterns of repository paths a submission may not change."""
        ...


class SWEBenchInstanceFamily:
    """An SWETaskFamily of `SWEBenchInstanceTasks`: image-less sandboxes, graded by the
    swebench package (rollout.rewards.swe.grade_patch) with the tasks' protected paths."""

    def __init__(self, tasks: SWEBenchInstanceTasks) -> None:
        self.tasks = tasks

    def image(self, task: Task) -> None:
        return None

    def repo_dir(self, task: Task) -> str:
        return self.tasks.repo_dir(task)

    def env_setup(self, task: Task) -> str | None:
        return None  # local sandboxes: the interpreter on PATH is the environment

    async def prepare(self, task: Task, sandbox: Sandbox) -> None:
        await self.tasks.prepare(task, sandbox)

    async def grade(
        self, task: Task, sandbox: Sandbox, model_patch: str, timeout_s: float
    ) -> SWEGrade:
        return await grade_patch(
            sandbox,
            model_patch,
            self.tasks.instance(task),
            self.tasks.repo_dir(task),
            timeout_s,
            self.tasks.protected_paths(task),
        )

    def reference_patch(self, task: Task) -> str:
        return str(self.tasks.instance(task).get("patch") or "")


def default_families() -> dict[str, SWETaskFamily]:
    """mini-SWE, and the spec family for SWE-bench, SWE-bench Pro and generic rows."""
    specs = SWESpecTasks()
    return {"mini_swe": SWEBenchInstanceFamily(MiniSWETasks()), **dict.fromkeys(SPEC_KINDS, specs)}


def _task_docker_config() -> DockerSandboxConfig:
    # The repository lives in the image's own file system (/testbed, /app): it must be
    # writable. The sandbox's working directory stays a fresh scratch volume beside it.
    return DockerSandboxConfig(read_only=False)


def _local_sandbox_config() -> LocalSandboxConfig:
    # The interpreter running this code is exposed read-only in the sandbox: put it first
    # on PATH so `python` and `python -m pytest` work for the agent and the eval script.
    return LocalSandboxConfig(env={"PATH": f"{Path(sys.executable).parent}:{SAFE_PATH}"})


class SWEHarnessConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step_limit: int = Field(default=50, ge=1)
    """Turns (valid or not) before the episode ends without a submission."""
    command_timeout_s: float = Field(default=60.0, gt=0)
    """Wall-clock limit of one bash action."""
    max_output_chars: int = Field(default=10_000, ge=100)
    """Longer outputs are shown as head + tail (half each) with a note."""
    eval_timeout_s: float = Field(default=600.0, gt=0)
    """Limit of each grading step (applying the patch, running the tests)."""
    grade_empty_submissions: bool = False
    """Run the tests on an empty submission too (the unchanged repository: its
    FAIL_TO_PASS tests must fail); False: it is unresolved, 'empty patch', unrun."""
    keep_grade_files: bool = False
    """`details()` carries the grade's files (`files`: report.json, test_output.txt,
    patch.diff) and test counts (`tests`), for an evaluation run to keep per instance."""
    sandbox: LocalSandboxConfig = Field(default_factory=_local_sandbox_config)
    """Settings of the local sandboxes the default factory creates for tasks without an
    image (agent and grading)."""
    docker: DockerSandboxConfig = Field(default_factory=_task_docker_config)
    """Settings of the Docker sandboxes the default factory creates for tasks with an
    image (its `image` is replaced by the task's)."""
    prompts_file: Path | None = None
    """A YAML file of prompts like prompts/swe.yaml; None: the packaged one."""


class SWEPrompts(BaseModel):
    """The texts of prompts/swe.yaml (str.format templates)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    system: str
    """Fields: command_timeout_s."""
    instance: str
    """The first user message. Fields: problem_statement, repo_dir, step_limit."""
    observation: str
    """A bash action's result. Fields: exit_code, output."""
    long_output: str
    """Replaces an output past max_output_chars. Fields: total_chars, head, tail,
    elided_chars."""
    timeout: str
    """Prefixed to the output of a killed command. Fields: timeout_s, output."""
    format_error: str
    """The observation of an invalid turn (tier 1). Fields: error."""
    tools: dict[str, str]
    """Tool descriptions: bash, bash_command (its argument), submit."""


def load_prompts(path: Path | None = None) -> SWEPrompts:
    """The prompts in `path`, or the packaged prompts/swe.yaml."""
    return SWEPrompts.model_validate(read_prompts("swe", path))


def swe_tools(prompts: SWEPrompts) -> list[dict[str, Any]]:
    bash = {
        "type": "object",
        "properties": {
            "command": {
                "type": "string",
                "minLength": 1,
                "description": prompts.tools["bash_command"],
            }
        },
        "required": ["command"],
        "additionalProperties": False,
    }
    submit = {"type": "object", "properties": {}, "additionalProperties": False}
    return [
        {
            "type": "function",
            "function": {"name": name, "description": prompts.tools[name], "parameters": params},
        }
        for name, params in (("bash", bash), ("submit", submit))
    ]


def truncate_output(
    output: str, max_chars: int, prompts: SWEPrompts, total_chars: int | None = None
) -> str:
    """`output` itself when short, else its head and tail with a note (mini-swe-agent).
    `total_chars`: the size before the sandbox already cut it, when it did."""
    if len(output) <= max_chars:
        return output
    head, tail = output[: max_chars // 2], output[len(output) - max_chars // 2 :]
    total = max(total_chars or 0, len(output))
    return prompts.long_output.format(
        total_chars=total, head=head, tail=tail, elided_chars=total - len(head) - len(tail)
    )


class SWEHarness:
    """Builds episodes of SWE tasks; see the module docstring."""

    name = "swe"

    def __init__(
        self,
        config: SWEHarnessConfig | None = None,
        families: Mapping[str, SWETaskFamily] | None = None,
        sandbox_factory: SandboxFactory | None = None,
    ) -> None:
        """`families`: by task kind (default: `default_families()`); `sandbox_factory`:
        sandboxes by image (default: `default_sandbox`)."""
        self.config = config or SWEHarnessConfig()
        self.prompts = load_prompts(self.config.prompts_file)
        self.tools = swe_tools(self.prompts)
        self.families: dict[str, SWETaskFamily] = dict(families or default_families())
        self.sandbox_factory: SandboxFactory = sandbox_factory or self.default_sandbox

    def default_sandbox(self, image: str | None) -> Sandbox:
        """A LocalSandbox for a task without an image, else a DockerSandbox of `image`."""
        if image is None:
            return LocalSandbox(self.config.sandbox)
        return DockerSandbox(self.config.docker.model_copy(update={"image": image}))

    def family(self, task: Task) -> SWETaskFamily:
        if task.kind not in self.families:
            raise UnknownTaskKindError(
                f"the swe harness has no task family for kind {task.kind!r}; "
                f"known: {sorted(self.families)}"
            )
        return self.families[task.kind]

    def initial_messages(self, task: Task) -> list[Message]:
        system = self.prompts.system.format(command_timeout_s=self.config.command_timeout_s)
        user = self.prompts.instance.format(
            problem_statement=task.prompt,
            repo_dir=self.family(task).repo_dir(task),
            step_limit=self.config.step_limit,
        )
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def in_environment(self, task: Task, sandbox: Sandbox) -> Sandbox:
        """`sandbox` running every command in the task's environment (the family's
        `env_setup`); `sandbox` itself for a task without one."""
        env_setup = self.family(task).env_setup(task)
        return sandbox if env_setup is None else EnvironmentSandbox(sandbox, env_setup)

    async def new_sandbox(self, task: Task) -> Sandbox:
        """A started sandbox holding the task's repository at its base commit (prepared in
        the image as it is), whose environment can be entered (else
        EnvironmentSetupError)."""
        family = self.family(task)
        sandbox = self.sandbox_factory(family.image(task))
        try:
            await sandbox.start()
            await family.prepare(task, sandbox)
            env_setup = family.env_setup(task)
            if env_setup is not None:
                await self._check_environment(task, sandbox, env_setup)
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    async def _check_environment(self, task: Task, sandbox: Sandbox, env_setup: str) -> None:
        repo_dir = self.family(task).repo_dir(task)
        entered = await sandbox.exec(
            in_environment("true", env_setup), self.config.command_timeout_s, cwd=repo_dir
        )
        if not entered.ok:
            output = (entered.stdout + entered.stderr).strip()[-2000:]
            raise EnvironmentSetupError(
                f"{task.task_id}: cannot enter the repository's environment in {repo_dir} "
                f"(exit {entered.exit_code}{', timed out' if entered.timed_out else ''}): "
                f"{output}"
            )

    async def start(self, task: Task) -> SWEEpisode:
        family = self.family(task)
        sandbox = await self.new_sandbox(task)
        try:
            head = await sandbox.exec("git rev-parse HEAD", 30, cwd=family.repo_dir(task))
        except BaseException:
            await sandbox.close()
            raise
        if not head.ok:
            await sandbox.close()
            raise UnknownBaseCommitError(
                f"{task.task_id}: `git rev-parse HEAD` failed in the repository: {head.stderr}"
            )
        return SWEEpisode(self, task, sandbox, head.stdout.strip())


def grade_test_counts(grade: SWEGrade) -> dict[str, dict[str, int]]:
    """How many FAIL_TO_PASS and PASS_TO_PASS tests passed and failed."""
    return {
        name: {"passed": len(tests.success), "failed": len(tests.failure)}
        for name, tests in (
            ("FAIL_TO_PASS", grade.fail_to_pass),
            ("PASS_TO_PASS", grade.pass_to_pass),
        )
    }


def _invalid_action(turn: RecordedTurn, call: ToolCall | None) -> str | None:
    """Why the turn holds no action this harness can run (tier 1), or None."""
    if turn.error is not None:
        return str(turn.error)
    if call is None:
        return "no tool call"
    if call.name not in ("bash", "submit"):
        return f"unknown tool {call.name!r}; available: bash, submit"
    if call.name == "submit":
        return None
    command = call.arguments.get("command")
    if not isinstance(command, str) or not command:
        return "bash: `command` must be a non-empty string"
    if "\x00" in command:
        return "bash: the command contains a NUL byte, which a shell cannot run"
    return None


class SWEEpisode:
    """One trajectory's sandbox, steps and submission."""

    def __init__(self, harness: SWEHarness, task: Task, sandbox: Sandbox, base_commit: str) -> None:
        self.harness = harness
        self.task = task
        self.sandbox = sandbox
        self.base_commit = base_commit
        self.repo_dir = harness.family(task).repo_dir(task)
        self.env_setup = harness.family(task).env_setup(task)
        """Entered before each bash action (the harness's own git commands go without)."""
        self.steps = 0
        self.tool_calls = 0
        """bash actions run (valid turns that were not the submit)."""
        self.submission: str | None = None
        """The submitted diff; None until submit."""
        self.grade: SWEGrade | None = None

    async def step(self, turn: RecordedTurn) -> StepOutcome:
        self.steps += 1
        outcome = await self._act(turn)
        if outcome.done or self.steps < self.harness.config.step_limit:
            return outcome
        limit = self.harness.config.step_limit
        return StepOutcome(
            tier=outcome.tier,
            done=True,
            truncated=True,
            reason=f"step limit: {limit} steps without submit",
        )

    async def _act(self, turn: RecordedTurn) -> StepOutcome:
        call = turn.calls[0] if turn.error is None and turn.calls else None
        problem = _invalid_action(turn, call)
        if problem is not None or call is None:
            return StepOutcome(
                observation=self.harness.prompts.format_error.format(error=problem),
                tier=MaskTier.INVALID_ACTION,
            )
        if call.name == "submit":
            self.submission = await self._capture_diff()
            return StepOutcome(tier=MaskTier.VALID, done=True, reason=SUBMITTED_REASON)
        config = self.harness.config
        self.tool_calls += 1
        # Merging stderr on the command's own first line keeps bash's line numbers.
        command = in_environment(f"exec 2>&1; {call.arguments['command']}", self.env_setup)
        result = await self.sandbox.exec(command, config.command_timeout_s, cwd=self.repo_dir)
        output = result.stdout + result.stderr
        return StepOutcome(
            observation=self._observation(result, output),
            tier=classify_turn(None, result.exit_code, output),
        )

    def _observation(self, result: ExecResult, output: str) -> str:
        prompts, config = self.harness.prompts, self.harness.config
        total = None
        if result.stdout_truncated or result.stderr_truncated:
            # The sandbox kept head + tail of its own; its byte counts are the real size.
            total = result.stdout_bytes + result.stderr_bytes
        shown = truncate_output(output, config.max_output_chars, prompts, total)
        if result.timed_out:
            shown = prompts.timeout.format(timeout_s=config.command_timeout_s, output=shown)
        return prompts.observation.format(exit_code=result.exit_code, output=shown)

    async def _capture_diff(self) -> str:
        """The repository's changes against the base commit, untracked files included."""
        repo = shlex.quote(self.repo_dir)
        command = (
            f"rm -f {SUBMISSION_FILE} && git -C {repo} add -A"
            f" && git -C {repo} -c core.quotepath=off diff --cached --binary --no-ext-diff"
            f" --no-textconv {self.base_commit} > {SUBMISSION_FILE}"
        )
        result = await self.sandbox.exec(command, self.harness.config.eval_timeout_s)
        if not result.ok:  # the agent broke its repository: nothing to submit
            return ""
        try:
            data = await self.sandbox.read_file(SUBMISSION_FILE)
        except SandboxFileError:  # the agent swapped the file for a link, or it is huge
            return ""
        return data.decode(errors="replace")

    async def reward(self) -> float:
        if self.grade is None:
            self.grade = await self._grade()
        return self.grade.reward

    async def _grade(self) -> SWEGrade:
        if self.submission is None:
            return SWEGrade(instance_id=self.task.task_id, resolved=False, reason="no submission")
        if not self.submission.strip() and not self.harness.config.grade_empty_submissions:
            return SWEGrade(instance_id=self.task.task_id, resolved=False, reason="empty patch")
        family = self.harness.family(self.task)
        # A fresh sandbox: nothing the agent left outside its diff reaches the tests.
        sandbox = await self.harness.new_sandbox(self.task)
        try:
            return await family.grade(
                self.task,
                self.harness.in_environment(self.task, sandbox),
                self.submission,
                self.harness.config.eval_timeout_s,
            )
        finally:
            await sandbox.close()

    def details(self) -> dict[str, Any]:
        """The submitted patch, the bash actions run, and after `reward` the grade's
        reason and outcome (the test log stays on `grade`; with `keep_grade_files` it
        comes as `files` too)."""
        details: dict[str, Any] = {"answer": self.submission, "tool_calls": self.tool_calls}
        if self.grade is None:
            return details
        details |= {
            "reason": self.grade.reason,
            "resolved": self.grade.resolved,
            "patch_applied": self.grade.patch_applied,
        }
        if self.harness.config.keep_grade_files:
            details |= {"tests": grade_test_counts(self.grade), "files": self._grade_files()}
        return details

    def _grade_files(self) -> dict[str, str]:
        """report.json (the grade: FAIL_TO_PASS / PASS_TO_PASS tests that passed and
        failed, every test's status), the grader's raw log, the submitted patch."""
        assert self.grade is not None
        report = self.grade.model_dump(mode="json", exclude={"log"})
        files = {GRADE_REPORT_FILE: json.dumps(report, indent=2) + "\n"}
        if self.grade.log:
            files[TEST_OUTPUT_FILE] = self.grade.log
        if self.submission:
            files[PATCH_FILE] = self.submission
        return files

    async def close(self) -> None:
        await self.sandbox.close()
