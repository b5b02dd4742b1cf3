"""What the runner needs from a harness: the first messages, and an episode that turns
each recorded turn into an observation until the task ends, then a reward.

A harness owns its sandbox (one per trajectory); an infrastructure failure there raises
`sandbox.SandboxError` out of `step` or `reward`, and the runner ends the trajectory with
status sandbox_error. The command's own failure is an observation, never an exception.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from rollout.chat import Message, RecordedTurn
from rollout.trajectory import MaskTier, Task

SUBMITTED_REASON = "submitted"
"""The status reason of a trajectory whose agent ended it by submitting (SWE's submit)."""


class StepOutcome(BaseModel):
    """What a turn's action led to."""

    model_config = ConfigDict(frozen=True)

    observation: str | None = None
    """The tool's answer for the next context (None: the episode ended with this turn)."""
    tier: MaskTier | None = None
    """Overrides the turn's tier (a final answer without a tool call is VALID; a shell
    refusal is SHELL_ERROR); None keeps what parsing decided."""
    done: bool = False
    """The episode is over (answer given, patch submitted, or a harness limit reached)."""
    truncated: bool = False
    """With done: it ended at a harness limit (e.g. a step limit), not by finishing."""
    reason: str | None = None
    """Why it ended, for the trajectory's status_reason."""


class Episode(Protocol):
    async def step(self, turn: RecordedTurn) -> StepOutcome: ...

    async def reward(self) -> float:
        """Grade the finished (or truncated) episode."""
        ...

    def details(self) -> dict[str, Any]:
        """What happened, as JSON for the trajectory's metadata["episode"] (evaluation
        records read it): `answer` (a final answer, a submitted patch), `tool_calls`, and
        after `reward` the grade's `reason` and anything else the harness keeps."""
        ...

    async def close(self) -> None: ...


class Harness(Protocol):
    name: str
    tools: list[dict[str, Any]]
    """OpenAI-style tool schemas, rendered into the system prompt by the chat template."""

    def initial_messages(self, task: Task) -> list[Message]: ...

    async def start(self, task: Task) -> Episode:
        """Create the episode's sandbox; raises sandbox.SandboxError if it cannot."""
        ...
