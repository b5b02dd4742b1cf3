"""Hints for OPSD: the teacher is a frozen snapshot of the student whose context carries a
hint the student never sees (DESIGN.md). Sources: a reference solution, a critic model
behind an OpenAI-compatible endpoint, or the student itself. Every hint passes a leak
check first: a hint that states the final answer (in any common surface form) or a line of
the gold patch is refused, counted, and the teacher scores without it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import httpx

from rollout.chat import ChatRenderer, Message
from rollout.harness.prompts import read_prompts
from rollout.trajectory import Task, Turn

NUMBER = re.compile(
    r"\\d?frac\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}"  # \frac{a}{b}
    r"|(-?\d[\d,]*(?:\.\d+)?)\s*/\s*(\d+)"  # a/b
    r"|(-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?)"  # 1,234.5 or 1e3
)


class HintSourceError(RuntimeError):
    """A hint source could not produce a hint (the endpoint failed)."""


def _value(text: str) -> Fraction | None:
    try:
        return Fraction(text.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def numbers_in(text: str) -> list[Fraction]:
    """Every number written in `text`: integers, decimals, thousands separators, a/b and
    \\frac{a}{b}."""
    values = []
    for match in NUMBER.finditer(text):
        frac_num, frac_den, slash_num, slash_den, plain = match.groups()
        if frac_num is not None:
            value = _value(f"{frac_num}/{frac_den}")
        elif slash_num is not None:
            value = _value(slash_num)
            den = _value(slash_den)
            value = value / den if value is not None and den else None
        else:
            value = _value(plain)
        if value is not None:
            values.append(value)
    return values


def _normalized(text: str) -> str:
    text = re.sub(r"\\boxed\{(.*)\}", r"\1", text)
    return re.sub(r"[\s$]", "", text).lower()


def patch_lines(patch: str, min_chars: int = 8) -> list[str]:
    """The added and removed lines of a unified diff (headers excluded), stripped."""
    lines = []
    for line in patch.splitlines():
        if line.startswith(("+++", "---")) or line[:1] not in ("+", "-"):
            continue
        body = line[1:].strip()
        if len(body) >= min_chars:
            lines.append(body)
    return lines


def leak_reason(hint: str, task: Task) -> str | None:
    """Why `hint` gives the answer away, or None when it does not."""
    if task.answer:
        answer = _value(task.answer.strip())
        if answer is None:
            numbers = numbers_in(task.answer)
            answer = numbers[0] if len(numbers) == 1 and _normalized(task.answer) else None
        if answer is not None:
            if answer in numbers_in(hint):
                return f"the hint states the final answer ({task.answer})"
        elif _normalized(task.answer) and _normalized(task.answer) in _normalized(hint):
            return f"the hint states the final answer ({task.answer})"
    patch = task.metadata.get("patch")
    if isinstance(patch, str):
        for line in patch_lines(patch):
            if line in hint:
                return f"the hint contains a line of the gold patch ({line[:60]!r})"
    return None


class HintSource(Protocol):
    async def hint(self, task: Task, attempt: str | None = None) -> str | None:
        """A hint for `task` (after `attempt`, for sources that read one), or None."""
        ...


class ReferenceHint:
    """From the task's reference: metadata["solution"], or the arithmetic tasks'
    metadata["expression"] (the method, not the value)."""

    def __init__(self) -> None:
        self.prompts = read_prompts("hints")

    async def hint(self, task: Task, attempt: str | None = None) -> str | None:
        if "solution" in task.metadata:
            return str(self.prompts["reference_solution"]).format(
                solution=task.metadata["solution"]
            )
        if "expression" in task.metadata:
            return str(self.prompts["reference_expression"]).format(
                expression=task.metadata["expression"]
            )
        return None


class CriticHint:
    """A critic model behind an OpenAI-compatible /v1/chat/completions endpoint."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, transport=transport
        )
        self.model = model
        self.prompts = read_prompts("hints")

    async def hint(self, task: Task, attempt: str | None = None) -> str | None:
        user = str(self.prompts["critic_user"]).format(task=task.prompt, attempt=attempt or "")
        body = {
            "model": self.model,
            "messages": [
                {"role": "system", "content": self.prompts["critic_system"]},
                {"role": "user", "content": user},
            ],
        }
        try:
            response = await self.http.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            content = response.json()["choices"][0]["message"]["content"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
            raise HintSourceError(f"critic at {self.http.base_url} failed: {err}") from err
        return str(content).strip() or None

    async def close(self) -> None:
        await self.http.aclose()


def hint_source(
    kind: str, critic_url: str | None = None, critic_model: str = "critic"
) -> HintSource | None:
    """The source a job's teacher.hint names: reference, critic (an OpenAI-compatible
    endpoint) or none (the no-hint control)."""
    if kind == "none":
        return None
    if kind == "critic":
        if not critic_url:
            raise ValueError("hint 'critic' needs critic_url")
        return CriticHint(critic_url, critic_model)
    return ReferenceHint()


@dataclass
class HintStats:
    hints: int = 0
    refused: int = 0
    missing: int = 0
    hint_tokens: list[int] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        lengths = self.hint_tokens
        return {
            "rollout/hint_count": float(self.hints),
            "rollout/hint_leak_refusals": float(self.refused),
            "rollout/hint_missing": float(self.missing),
            "rollout/hint_tokens": sum(lengths) / len(lengths) if lengths else 0.0,
        }


class HintedTeacherContext:
    """The runner's teacher_context for OPSD: the student's context with the task's hint
    appended to its last initial user message. Hints are fetched ahead (`prepare`), so the
    mapping itself is synchronous and deterministic per task."""

    def __init__(self, renderer: ChatRenderer, initial_messages: Any, source: HintSource) -> None:
        self.renderer = renderer
        self.initial_messages = initial_messages
        self.source = source
        self.prompts = read_prompts("hints")
        self.hints: dict[str, str | None] = {}
        self.stats = HintStats()

    async def prepare(self, tasks: Sequence[Task]) -> None:
        for task in tasks:
            if task.task_id in self.hints:
                continue
            text = await self.source.hint(task)
            if text is None:
                self.stats.missing += 1
            elif leak_reason(text, task) is not None:
                self.stats.refused += 1
                text = None
            else:
                self.stats.hints += 1
                self.stats.hint_tokens.append(len(self.renderer.encode(text)))
            self.hints[task.task_id] = text

    def __call__(
        self, task: Task, student_ids: list[int], earlier_turns: Sequence[Turn] = ()
    ) -> list[int]:
        """The teacher's view of a student context (the hint is the same for every turn)."""
        hint = self.hints.get(task.task_id)
        if hint is None:
            return student_ids
        messages: list[Message] = [dict(m) for m in self.initial_messages(task)]
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            return student_ids
        student_prefix = self.renderer.render_ids(messages, add_generation_prompt=False)
        last = users[-1]
        messages[last]["content"] = str(messages[last]["content"]) + str(
            self.prompts["insert"]
        ).format(hint=hint)
        teacher_prefix = self.renderer.render_ids(messages, add_generation_prompt=False)
        if student_ids[: len(student_prefix)] != student_prefix:
            raise ValueError(
                "the student's context does not start with its rendered initial messages: "
                "the hint has no place to go (a template that rewrites earlier turns?)"
            )
        return teacher_prefix + student_ids[len(student_prefix) :]
