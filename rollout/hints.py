"""Hints for OPSD: the teacher is a frozen snapshot of the student whose context carries a
hint the student never sees (DESIGN.md). Sources: a reference solution (one per task,
written before the rollout), a critic model behind an OpenAI-compatible endpoint, or the
student itself (both read the finished attempt: one hint per trajectory, and the runner
scores its turns once it ended). Every hint passes a leak check first: a hint that states
the final answer (in any common surface form) or a line of the gold patch is refused,
counted, and the teacher scores without it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import httpx

from rollout.chat import ChatRenderer, Message, common_prefix_len
from rollout.harness.prompts import read_prompts
from rollout.policy import Policy, PolicyError, SamplingParams
from rollout.runner import TeacherContext
from rollout.trajectory import Task, Turn

HINTS_AFTER_ATTEMPT = frozenset({"critic", "student"})
"""teacher.hint values whose source reads the finished attempt (teacher_scoring 'after')."""

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
    patch = task.metadata.get("patch") or task.metadata.get("reference_patch")  # mini-SWE
    if isinstance(patch, str):
        for line in patch_lines(patch):
            if line in hint:
                return f"the hint contains a line of the gold patch ({line[:60]!r})"
    return None


class HintSource(Protocol):
    reads_attempt: bool
    """True: the hint is written after the trajectory, from its attempt (one per
    trajectory); False: from the task alone, before the rollout (one per task)."""

    async def hint(self, task: Task, attempt: str | None = None) -> str | None:
        """A hint for `task` (after `attempt`, for sources that read one), or None."""
        ...


def critic_messages(prompts: dict[str, Any], task: Task, attempt: str | None) -> list[Message]:
    """The critic's prompt: the task and the attempt; asks for a short hint, never the answer."""
    user = str(prompts["critic_user"]).format(task=task.prompt, attempt=attempt or "")
    return [
        {"role": "system", "content": str(prompts["critic_system"])},
        {"role": "user", "content": user},
    ]


class ReferenceHint:
    """From the task's reference: metadata["solution"], the arithmetic tasks'
    metadata["expression"] (the method, not the value), or a hint the task carries
    (mini-SWE: where the bug is and what to check, not the fix)."""

    reads_attempt = False

    def __init__(self) -> None:
        self.prompts = read_prompts("hints")

    async def hint(self, task: Task, attempt: str | None = None) -> str | None:
        return self.text(task)

    def text(self, task: Task) -> str | None:
        """The hint for `task` (no I/O: callers outside a rollout use it directly)."""
        if "solution" in task.metadata:
            return str(self.prompts["reference_solution"]).format(
                solution=task.metadata["solution"]
            )
        if "expression" in task.metadata:
            return str(self.prompts["reference_expression"]).format(
                expression=task.metadata["expression"]
            )
        if task.metadata.get("hint"):
            return str(self.prompts["reference_hint"]).format(hint=task.metadata["hint"])
        return None


class CriticHint:
    """A critic model behind an OpenAI-compatible /v1/chat/completions endpoint."""

    reads_attempt = True

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
        body = {"model": self.model, "messages": critic_messages(self.prompts, task, attempt)}
        try:
            response = await self.http.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            content = response.json()["choices"][0]["message"]["content"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
            raise HintSourceError(f"critic at {self.http.base_url} failed: {err}") from err
        return str(content).strip() or None

    async def close(self) -> None:
        await self.http.aclose()


class StudentHint:
    """The student writes its own hint: once a trajectory ended, the policy that sampled it
    (slime's SGLang router, or the local HF model) is asked, with the critic's prompt, for a
    hint given that attempt. Only the text after its think is the hint; none of these
    tokens is trained on, and the student's rollout contexts never contain them."""

    reads_attempt = True

    def __init__(
        self,
        policy: Policy,
        renderer: ChatRenderer,
        sampling: SamplingParams,
        max_context_tokens: int,
    ) -> None:
        self.policy = policy
        # a plain chat (no tool schema): the student answers in text
        self.renderer = ChatRenderer(
            renderer.tokenizer,
            tools=None,
            think_policy=renderer.think_policy,
            tool_call_format=renderer.tool_call_format,
        )
        self.sampling = sampling
        self.max_context_tokens = max_context_tokens
        self.prompts = read_prompts("hints")

    async def hint(self, task: Task, attempt: str | None = None) -> str | None:
        prompt_ids = self._prompt_ids(task, attempt or "")
        # the hint's draws follow from what it reads, not from when it is asked
        digest = hashlib.blake2b((attempt or "").encode(), digest_size=8).hexdigest()
        sampling = self.sampling.model_copy(
            update={"sampling_key": f"hint/{task.task_id}/{digest}"}
        )
        try:
            generation = await self.policy.generate(prompt_ids, sampling)
        except PolicyError as err:
            raise HintSourceError(f"the student could not write a hint: {err}") from err
        if generation.finish_reason != "stop":  # cut off (often mid-think): not a hint
            return None
        output = generation.output_ids
        output = output[self.renderer.think_len(output) :]
        if output and output[-1] == self.renderer.eos_id:
            output = output[:-1]
        text = str(self.renderer.tokenizer.decode(output, skip_special_tokens=True)).strip()
        return text or None

    def _prompt_ids(self, task: Task, attempt: str) -> list[int]:
        """The critic prompt with the attempt's tail cut to what the context budget leaves."""
        budget = self.max_context_tokens - self.sampling.max_new_tokens
        fixed = len(self.renderer.context_ids(critic_messages(self.prompts, task, "")))
        attempt = tail_tokens(self.renderer, attempt, max(budget - fixed, 0))
        return self.renderer.context_ids(critic_messages(self.prompts, task, attempt))


def tail_tokens(renderer: ChatRenderer, text: str, max_tokens: int) -> str:
    """`text` cut to its last `max_tokens` tokens."""
    ids = renderer.encode(text)
    if len(ids) <= max_tokens:
        return text
    return str(renderer.tokenizer.decode(ids[len(ids) - max_tokens :])) if max_tokens else ""


def hint_source(
    kind: str,
    critic_url: str | None = None,
    critic_model: str = "critic",
    *,
    critic_api_key: str | None = None,
    student: StudentHint | None = None,
) -> HintSource | None:
    """The source a job's teacher.hint names: reference, critic (an OpenAI-compatible
    endpoint), student (`student`: the rollout policy asked for a hint) or none (the no-hint
    control)."""
    if kind == "none":
        return None
    if kind == "critic":
        if not critic_url:
            raise ValueError("hint 'critic' needs critic_url")
        return CriticHint(critic_url, critic_model, api_key=critic_api_key)
    if kind == "student":
        if student is None:
            raise ValueError("hint 'student' needs the policy that samples the rollouts")
        return student
    if kind != "reference":
        raise ValueError(f"unknown hint source {kind!r}: reference, critic, student or none")
    return ReferenceHint()


@dataclass
class HintStats:
    """Counts per hint asked for: one per task (reference) or per trajectory (critic,
    student), since the run started."""

    hints: int = 0
    refused: int = 0
    missing: int = 0
    errors: int = 0
    """The source failed (the critic's endpoint, the student's policy): scored without."""
    hint_tokens: list[int] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        lengths = self.hint_tokens
        return {
            "rollout/hint_count": float(self.hints),
            "rollout/hint_leak_refusals": float(self.refused),
            "rollout/hint_missing": float(self.missing),
            "rollout/hint_errors": float(self.errors),
            "rollout/hint_tokens": sum(lengths) / len(lengths) if lengths else 0.0,
        }


class HintedTeacherContext:
    """The runner's teacher_context for OPSD: the student's context with the hint appended
    to its last initial user message. Task-level hints are fetched ahead (`prepare`);
    hints that read the attempt are fetched once the trajectory ended (`for_trajectory`,
    which the runner awaits before scoring). The mapping itself is synchronous."""

    def __init__(
        self,
        renderer: ChatRenderer,
        initial_messages: Any,
        source: HintSource,
        attempt_tokens: int = 8192,
    ) -> None:
        self.renderer = renderer
        self.initial_messages = initial_messages
        self.source = source
        self.reads_attempt = source.reads_attempt
        self.attempt_tokens = attempt_tokens
        self.prompts = read_prompts("hints")
        self.hints: dict[str, str | None] = {}
        self.outcomes: dict[str, str] = {}
        """Per task (reference hints): hint, refused (leak), missing or error."""
        self.stats = HintStats()

    async def prepare(self, tasks: Sequence[Task]) -> None:
        """Task-level hints for the coming rollouts (nothing to do for attempt readers)."""
        if self.reads_attempt:
            return
        for task in tasks:
            if task.task_id not in self.hints:
                hint, outcome = await self._checked(task, None)
                self.hints[task.task_id], self.outcomes[task.task_id] = hint, outcome

    async def for_trajectory(self, task: Task, messages: Sequence[Message]) -> TeacherContext:
        """The teacher's view for one finished trajectory (`messages`: its conversation)."""
        if not self.reads_attempt:
            return self
        hint, outcome = await self._checked(task, self.attempt(task, messages))
        return _AttemptView(self, hint, outcome)

    def attempt(self, task: Task, messages: Sequence[Message]) -> str:
        """What the hint writer reads: the trajectory after the task (actions and
        observations as the student's chat template renders them), its last
        `attempt_tokens` tokens."""
        initial = list(self.initial_messages(task))
        prefix = self.renderer.render_ids(initial, add_generation_prompt=False)
        whole = self.renderer.render_ids(messages, add_generation_prompt=False)
        after = whole[common_prefix_len(prefix, whole) :][-self.attempt_tokens :]
        # special tokens dropped: chat markers inside the hint prompt would fake turns
        return str(self.renderer.tokenizer.decode(after, skip_special_tokens=True)).strip()

    async def _checked(self, task: Task, attempt: str | None) -> tuple[str | None, str]:
        """The source's hint, or None (counted) when it has none, fails or leaks; and
        which of those it was (hint, missing, error, refused: <the leak>)."""
        try:
            text = await self.source.hint(task, attempt)
        except HintSourceError as err:
            self.stats.errors += 1
            return None, f"error: {err}"
        if text is None:
            self.stats.missing += 1
            return None, "missing"
        leak = leak_reason(text, task)
        if leak is not None:
            self.stats.refused += 1
            return None, f"refused: {leak}"
        self.stats.hints += 1
        self.stats.hint_tokens.append(len(self.renderer.encode(text)))
        return text, "hint"

    def record(self, task: Task) -> dict[str, Any] | None:
        """What the teacher saw for `task` (the trajectory's metadata["teacher_context"])."""
        if task.task_id not in self.outcomes:
            return None
        return {"hint": self.hints.get(task.task_id), "hint_outcome": self.outcomes[task.task_id]}

    def __call__(
        self, task: Task, student_ids: list[int], earlier_turns: Sequence[Turn] = ()
    ) -> list[int]:
        """The teacher's view of a student context (the task's hint, the same every turn)."""
        return self.with_hint(self.hints.get(task.task_id), task, student_ids)

    def with_hint(self, hint: str | None, task: Task, student_ids: list[int]) -> list[int]:
        """`student_ids` with `hint` appended to the last initial user message."""
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


@dataclass
class _AttemptView:
    """The teacher's view for one finished trajectory: its own hint (critic, student)."""

    context: HintedTeacherContext
    hint: str | None
    outcome: str

    def __call__(
        self, task: Task, student_ids: list[int], earlier_turns: Sequence[Turn] = ()
    ) -> list[int]:
        return self.context.with_hint(self.hint, task, student_ids)

    def record(self, task: Task) -> dict[str, Any]:
        return {"hint": self.hint, "hint_outcome": self.outcome}
