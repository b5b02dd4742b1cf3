"""Scripted SWE agents: no model, actions known in advance. They check a benchmark's
images, tests and grading end to end, through the same harness, tool-call parser and
grader a model's run goes through (`opd eval swe --policy gold|empty|replay:FILE`).

- gold: writes the row's reference fix (the dataset's `patch`) into the repository with
  bash (`git apply`, `patch` as a fallback), then submits. Every instance whose image and
  tests are right is resolved; a row without a patch ends with that reason (the policy
  fails: an abort, not a wrong answer).
- empty: submits at once, nothing changed; the harness then runs the tests on the
  unchanged repository (SWEHarnessConfig.grade_empty_submissions), so FAIL_TO_PASS tests
  must fail and nothing is resolved: the negative control that shows the tests run.
- replay: each instance's turns from a JSONL file, one line per instance:

      {"instance_id": "django__django-11099",
       "actions": [{"name": "bash", "arguments": {"command": "sed -i 's/a/b/' f.py"}},
                   {"content": "text before the call", "name": "bash",
                    "arguments": {"command": "python -m pytest -x"}},
                   {"content": "a turn without a tool call (a format error)"},
                   {"name": "submit", "arguments": {}}]}

  An action is one assistant turn: optional text, then at most one tool call (`name`,
  `arguments`). An instance the file does not name, or whose actions run out before the
  episode ends, fails the policy (an abort naming the instance).

`ScriptedSWEPolicy` writes each scripted turn as the tokens a model would sample
(`ChatRenderer.scripted_span_ids`); the runner parses them back like a model's output.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollout.chat import ChatRenderer, Message
from rollout.policy import Generation, PolicyError, SamplingParams
from rollout.trajectory import Task

CHUNK_BYTES = 60_000
"""Most bytes of the patch one bash action carries: a command is one argument of the
sandbox's shell, and Linux refuses an argument over 128 KiB."""
GOLD_PATCH_PATH = '"$(git rev-parse --git-dir)/opd-gold.patch"'
"""Where the gold policy writes the patch: inside .git, so never part of the diff."""
APPLY_COMMAND = (
    f"git apply --verbose {GOLD_PATCH_PATH} || patch --batch --fuzz=5 -p1 -i {GOLD_PATCH_PATH}"
)
"""swebench's first and last ways of applying a patch."""


class ReplayFileError(ValueError):
    """A replay file that cannot be read; names the file and the line."""


class ReplayAction(BaseModel):
    """One scripted assistant turn: optional text, then at most one tool call."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    content: str = ""
    name: str | None = None
    """The tool to call (bash, submit); None: a turn without a tool call."""
    arguments: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _says_something(self) -> ReplayAction:
        if self.name is None and not self.content:
            raise ValueError("an action needs a tool call (name, arguments) or content")
        if self.name is None and self.arguments:
            raise ValueError("arguments without a tool name")
        return self

    def message(self) -> Message:
        if self.name is None:
            return {"role": "assistant", "content": self.content}
        call = {"name": self.name, "arguments": self.arguments}
        return {"role": "assistant", "content": self.content, "tool_calls": [call]}


class ReplayScript(BaseModel):
    """One line of a replay file."""

    model_config = ConfigDict(extra="forbid")

    instance_id: str = Field(min_length=1)
    actions: list[ReplayAction] = Field(min_length=1)


def bash(command: str) -> Message:
    return ReplayAction(name="bash", arguments={"command": command}).message()


def submit() -> Message:
    return ReplayAction(name="submit").message()


def gold_script(patch: str) -> list[Message]:
    """Write `patch` into the repository in pieces of at most CHUNK_BYTES (one bash action
    each, the last one applying it), then submit."""
    from swebench.utils import generate_heredoc_delimiter

    patch = patch if patch.endswith("\n") else patch + "\n"
    delimiter = generate_heredoc_delimiter(patch)
    pieces = _line_chunks(patch, CHUNK_BYTES)
    script = []
    for index, piece in enumerate(pieces):
        redirect = ">" if index == 0 else ">>"
        command = f"cat {redirect} {GOLD_PATCH_PATH} <<'{delimiter}'\n{piece}{delimiter}"
        if index == len(pieces) - 1:
            command += f"\n{APPLY_COMMAND}"
        script.append(bash(command))
    return [*script, submit()]


def _line_chunks(text: str, max_bytes: int) -> list[str]:
    """`text` cut at line ends into pieces of at most `max_bytes` (a longer line alone)."""
    pieces: list[str] = []
    current: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        length = len(line.encode())
        if current and size + length > max_bytes:
            pieces.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += length
    if current:
        pieces.append("".join(current))
    return pieces


def load_replay(path: Path) -> dict[str, list[Message]]:
    """instance_id -> its scripted turns, from a replay JSONL file (module docstring)."""
    if not path.is_file():
        raise ReplayFileError(f"replay file {path} does not exist")
    scripts: dict[str, list[Message]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            script = ReplayScript.model_validate_json(line)
        except ValidationError as err:
            raise ReplayFileError(
                f"{path}:{number}: not a replay line ({{instance_id, actions: [{{name, "
                f"arguments}} or {{content}}, ...]}}): {err}"
            ) from err
        if script.instance_id in scripts:
            raise ReplayFileError(f"{path}:{number}: {script.instance_id!r} appears twice")
        scripts[script.instance_id] = [action.message() for action in script.actions]
    if not scripts:
        raise ReplayFileError(f"replay file {path} holds no instances")
    return scripts


def gold_scripts(
    tasks: Iterable[Task], reference_patch: Callable[[Task], str]
) -> tuple[dict[str, list[Message]], dict[str, str]]:
    """(scripts by task id, why there is none) for the gold policy."""
    scripts: dict[str, list[Message]] = {}
    unscripted: dict[str, str] = {}
    for task in tasks:
        patch = reference_patch(task)
        if patch.strip():
            scripts[task.task_id] = gold_script(patch)
        else:
            unscripted[task.task_id] = "the row has no reference patch (its `patch` is empty)"
    return scripts, unscripted


class ScriptedSWEPolicy:
    """A Policy replaying `scripts[task_id]`, one message per turn, as token ids; a task
    without a script (`unscripted` says why) or whose script ran out fails the policy."""

    def __init__(
        self,
        name: str,
        renderer: ChatRenderer,
        scripts: Mapping[str, Sequence[Message]],
        unscripted: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.renderer = renderer
        self.scripts = scripts
        self.unscripted = dict(unscripted or {})
        self.turns: Counter[str] = Counter()
        """Turns generated per trajectory id (task_id#sample)."""

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        if session_id is None:
            raise PolicyError(f"{self.name}: a scripted policy needs the trajectory id")
        task_id = session_id.rpartition("#")[0]
        turn = self.turns[session_id]
        self.turns[session_id] += 1
        script = self.scripts.get(task_id)
        if script is None:
            why = self.unscripted.get(task_id, "no script names this instance")
            raise PolicyError(f"{self.name}: {task_id}: {why}")
        if turn >= len(script):
            raise PolicyError(
                f"{self.name}: {task_id}: the script's {len(script)} actions ran out before "
                "the episode ended (end it with a submit)"
            )
        ids = self.renderer.scripted_span_ids(script[turn])
        return Generation(output_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")
