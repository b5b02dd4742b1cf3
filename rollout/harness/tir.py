"""Math tool-integrated reasoning: a python tool on a persistent worker, at most
`max_tool_calls` calls, the final answer in \\boxed{} graded with math-verify."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollout.chat import Message, RecordedTurn
from rollout.harness.base import StepOutcome
from rollout.harness.prompts import read_prompts
from rollout.rewards.math import grade_answer, last_boxed
from rollout.toolcalls import NoToolCallError
from rollout.trajectory import MaskTier, Task
from sandbox import PythonWorker, PythonWorkerConfig

PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code; variables persist between calls.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source."}},
            "required": ["code"],
        },
    },
}


class TIRConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tool_calls: int = Field(default=16, ge=1)
    """Python calls per trajectory; past them the model must answer."""
    use_tools: bool = True
    """False: reasoning only, no python tool; the first reply is the answer."""
    call_timeout_s: float = Field(default=10.0, gt=0)
    """Deadline of one python call."""
    observation_chars: int = Field(default=2000, ge=100)
    """Longest observation; longer output keeps its head and tail."""
    grade_timeout_s: float = Field(default=10.0, gt=0)
    """Deadline for math-verify to grade one answer (overrun: reward 0)."""
    worker: PythonWorkerConfig = Field(default_factory=PythonWorkerConfig)


def clip_middle(text: str, limit: int) -> str:
    """Head and tail of `text` within `limit` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters left out ...]\n{text[-half:]}"


class TIRHarness:
    name = "tir"

    def __init__(self, config: TIRConfig | None = None) -> None:
        self.config = config or TIRConfig()
        self.prompts: dict[str, str] = read_prompts("tir")
        self.tools = [PYTHON_TOOL] if self.config.use_tools else []

    def initial_messages(self, task: Task) -> list[Message]:
        system = (
            self.prompts["system"].format(max_tool_calls=self.config.max_tool_calls)
            if self.config.use_tools
            else self.prompts["reasoning_system"].format()
        )
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": self.prompts["user"].format(problem=task.prompt)},
        ]

    async def start(self, task: Task) -> TIREpisode:
        """The episode at once; its python worker starts meanwhile (about 0.1 s of
        bubblewrap and interpreter start), so the first turn is generated while it does
        and no batch of turns waits on a sandbox. A worker that fails to start fails the
        episode's first step with the start's error (a sandbox error), as an awaited start
        failed the episode before."""
        worker = None
        if self.config.use_tools:
            worker = PythonWorker(self.config.worker)
        return TIREpisode(task, worker, self.config, self.prompts)


class TIREpisode:
    def __init__(
        self,
        task: Task,
        worker: PythonWorker | None,
        config: TIRConfig,
        prompts: dict[str, str],
    ) -> None:
        self.task = task
        self.worker = worker
        self._starting = asyncio.create_task(worker.start()) if worker is not None else None
        self.config = config
        self.prompts = prompts
        self.tool_calls = 0
        self.answer: str | None = None
        self.grade_reason: str | None = None

    async def step(self, turn: RecordedTurn) -> StepOutcome:
        if not self.config.use_tools:  # one reply, whatever it holds, is the answer
            self.answer = last_boxed(turn.message["content"])
            found = self.answer is not None
            return StepOutcome(
                done=True,
                tier=MaskTier.VALID if found else None,
                reason="boxed answer" if found else "no boxed answer",
            )
        if self._starting is not None:  # every step, as when the start was awaited first
            await self._starting
        if turn.error is not None:
            answer = last_boxed(turn.message["content"])
            if isinstance(turn.error, NoToolCallError) and answer is not None:
                self.answer = answer
                return StepOutcome(done=True, tier=MaskTier.VALID, reason="boxed answer")
            if isinstance(turn.error, NoToolCallError):
                return StepOutcome(observation=self.prompts["no_answer"].format())
            return StepOutcome(observation=self.prompts["invalid_call"].format(error=turn.error))
        if self.tool_calls >= self.config.max_tool_calls:
            return StepOutcome(
                observation=self.prompts["budget_exhausted"].format(
                    max_tool_calls=self.config.max_tool_calls
                )
            )
        assert self.worker is not None  # use_tools: started with one
        self.tool_calls += 1
        result = await self.worker.exec(
            turn.calls[0].arguments["code"], timeout_s=self.config.call_timeout_s
        )
        parts = []
        if result.worker_restarted:
            parts.append(self.prompts["worker_restarted"].format(reason=result.restart_reason))
        parts += [text for text in (result.stdout, result.stderr) if text]
        if result.timed_out:
            parts.append(self.prompts["timed_out"].format(timeout_s=self.config.call_timeout_s))
        observation = "\n".join(parts).strip() or self.prompts["no_output"].format()
        return StepOutcome(observation=clip_middle(observation, self.config.observation_chars))

    async def reward(self) -> float:
        if self.task.answer is None:
            raise ValueError(f"task {self.task.task_id} has no reference answer to grade")
        reward = await grade_answer(self.answer, self.task.answer, self.config.grade_timeout_s)
        if self.answer is None:
            self.grade_reason = "no boxed answer"
        else:
            self.grade_reason = "correct" if reward > 0 else "wrong answer"
        return reward

    def details(self) -> dict[str, Any]:
        details: dict[str, Any] = {"answer": self.answer, "tool_calls": self.tool_calls}
        if self.grade_reason is not None:
            details["reason"] = self.grade_reason
        return details

    async def close(self) -> None:
        if self.worker is None:
            return
        assert self._starting is not None
        self._starting.cancel()  # a start still running; its error, if any, is moot now
        await asyncio.wait([self._starting])  # (a cancellation of close itself propagates)
        if not self._starting.cancelled():
            self._starting.exception()  # retrieved: it was the first step's to raise
        await self.worker.close()
