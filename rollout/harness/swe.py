"""The minimal SWE harness: a bash tool and a submit tool, in the manner of mini-swe-agent.

- Action: `bash {"command": ...}` runs the command with bash in a new shell whose working
  directory is the task's repository, inside the episode's sandbox; stderr is merged into
  stdout. Observation: exit code and output, the output cut to its head and tail past
  `max_output_chars`. A command the shell refused (not found, syntax error) is tier 2.
- Submission: the `submit` tool (no arguments) ends the episode; the submission is the
  repository's `git diff` against the base commit, new files included, captured then.
- Step limit: every turn counts (invalid ones too); after `step_limit` turns without a
  submit the episode ends unsubmitted, and an unsubmitted episode's reward is 0.
- Reward: the submission graded in a fresh sandbox by `rollout.rewards.swe.grade_patch`
  (apply it, refuse it if it touches protected paths, run the task's eval script, grade
  the log with swebench). The grade is kept on the episode (`episode.grade`).

A task kind maps to an `SWETaskFamily`, which knows where the repository is, how to put
it into a sandbox and how to grade in SWE-bench's terms; mini-SWE is the default family.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from rollout.chat import Message, RecordedTurn
from rollout.harness.base import StepOutcome
from rollout.harness.prompts import read_prompts
from rollout.masking import classify_turn
from rollout.rewards.swe import SWEGrade, grade_patch
from rollout.tasks.mini_swe import MiniSWETasks
from rollout.toolcalls import ToolCall
from rollout.trajectory import MaskTier, Task
from sandbox.base import ExecResult, Sandbox, SandboxError, SandboxFileError
from sandbox.jail import SAFE_PATH
from sandbox.local import LocalSandbox, LocalSandboxConfig

SUBMISSION_FILE = ".opd_submission.patch"
"""Where the submitted diff is written, relative to the sandbox's working directory."""


class UnknownTaskKindError(KeyError):
    """The swe harness has no task family for the task's kind."""

    def __str__(self) -> str:
        return str(self.args[0])


class UnknownBaseCommitError(SandboxError):
    """The prepared repository has no commit to diff the submission against (the task's
    setup failed, not the agent)."""


class SWETaskFamily(Protocol):
    """What the swe harness needs from a kind of task."""

    def repo_dir(self, task: Task) -> str:
        """The repository in the sandbox: every command's working directory."""
        ...

    async def prepare(self, task: Task, sandbox: Sandbox) -> None:
        """Put the repository at its base commit into a started sandbox (the agent's, and
        a fresh one for grading); raises sandbox.SandboxError when it cannot."""
        ...

    def instance(self, task: Task) -> dict[str, Any]:
        """The task as a SWE-bench instance (FAIL_TO_PASS, PASS_TO_PASS, eval_script, ...)."""
        ...

    def protected_paths(self, task: Task) -> list[str]:
        """fnmatch patterns of repository paths a submission may not change."""
        ...


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
    sandbox: LocalSandboxConfig = Field(default_factory=_local_sandbox_config)
    """Settings of the local sandboxes the harness creates (agent and grading)."""
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
        sandbox_factory: Callable[[], Sandbox] | None = None,
    ) -> None:
        self.config = config or SWEHarnessConfig()
        self.prompts = load_prompts(self.config.prompts_file)
        self.tools = swe_tools(self.prompts)
        self.families: dict[str, SWETaskFamily] = dict(families or {"mini_swe": MiniSWETasks()})
        self.sandbox_factory = sandbox_factory or (lambda: LocalSandbox(self.config.sandbox))

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

    async def new_sandbox(self, task: Task) -> Sandbox:
        """A started sandbox holding the task's repository at its base commit."""
        sandbox = self.sandbox_factory()
        try:
            await sandbox.start()
            await self.family(task).prepare(task, sandbox)
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

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
        self.steps = 0
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
            return StepOutcome(tier=MaskTier.VALID, done=True, reason="submitted")
        config = self.harness.config
        # Merging stderr on the command's own first line keeps bash's line numbers.
        result = await self.sandbox.exec(
            f"exec 2>&1; {call.arguments['command']}", config.command_timeout_s, cwd=self.repo_dir
        )
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
        if not self.submission.strip():
            return SWEGrade(instance_id=self.task.task_id, resolved=False, reason="empty patch")
        family, config = self.harness.family(self.task), self.harness.config
        # A fresh sandbox: nothing the agent left outside its diff reaches the tests.
        sandbox = await self.harness.new_sandbox(self.task)
        try:
            return await grade_patch(
                sandbox,
                self.submission,
                family.instance(self.task),
                self.repo_dir,
                config.eval_timeout_s,
                family.protected_paths(self.task),
            )
        finally:
            await sandbox.close()

    async def close(self) -> None:
        await self.sandbox.close()
