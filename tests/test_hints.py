"""OPSD hints: the leak check, the hinted teacher context, and the frozen-snapshot teacher."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rollout.chat import ChatRenderer
from rollout.harness.tir import TIRHarness
from rollout.hints import (
    CriticHint,
    HintedTeacherContext,
    ReferenceHint,
    leak_reason,
    numbers_in,
)
from rollout.policy import HFPolicy, SamplingParams
from rollout.runner import Runner, RunnerConfig
from rollout.tasks.arithmetic import make_tasks
from rollout.trajectory import Task
from slime_ext.local.factory import build_checkpoint
from teacher_server.app import create_app
from teacher_server.client import TeacherClient
from teacher_server.hf_backend import HFBackend
from teacher_server.metrics import ServerMetrics
from tests.live_server import serve_in_thread

PATCH = """--- a/calc.py
+++ b/calc.py
@@ -1,2 +1,2 @@
 def add(a, b):
-    return a - b
+    return a + b  # fixed
"""


@pytest.mark.parametrize(
    ("answer", "hint", "leaks"),
    [
        ("1234", "so the total is 1,234 apples", True),
        ("1234", "the result: 1234.0", True),
        ("1234", "answer \\boxed{1234}", True),
        ("1234", "it is \\frac{2468}{2}", True),
        ("1234", "halve 2468/2 to get it", True),
        ("1234", "compute 12 * 103 + 12340", False),
        ("\\frac{1}{2}", "about 0.5", True),
        ("\\frac{1}{2}", "take 1/2 of it", True),
        ("\\frac{1}{2}", "divide 3 by 6", False),
        ("x^2+1", "the polynomial is x^2 + 1", True),
        ("x^2+1", "expand (x+1)^2 and subtract", False),
    ],
)
def test_leak_check_finds_the_answer_in_its_surface_forms(
    answer: str, hint: str, leaks: bool
) -> None:
    task = Task(task_id="t", kind="tir", prompt="p", answer=answer)
    assert (leak_reason(hint, task) is not None) is leaks


def test_leak_check_finds_gold_patch_lines() -> None:
    task = Task(task_id="t", kind="swe", prompt="p", metadata={"patch": PATCH})
    assert leak_reason("look at add in calc.py; the sign is wrong", task) is None
    reason = leak_reason("replace it by `return a + b  # fixed`", task)
    assert reason is not None and "gold patch" in reason
    assert leak_reason("the header --- a/calc.py", task) is None  # headers are not lines


def test_numbers_in_reads_separators_fractions_and_exponents() -> None:
    assert [float(v) for v in numbers_in("1,000 and 2.5 and 3/4 and \\frac{6}{8} and 1e3")] == [
        1000.0,
        2.5,
        0.75,
        0.75,
        1000.0,
    ]


def _hinted(factory_tokenizer: Any) -> tuple[HintedTeacherContext, TIRHarness, ChatRenderer]:
    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    return (
        HintedTeacherContext(renderer, harness.initial_messages, ReferenceHint()),
        harness,
        renderer,
    )


def test_reference_hint_goes_to_the_teacher_only(factory_tokenizer: Any) -> None:
    hinted, harness, renderer = _hinted(factory_tokenizer)
    tasks = make_tasks(5, "train", seed=0)
    asyncio.run(hinted.prepare(tasks))
    assert hinted.stats.hints == 5 and hinted.stats.refused == 0  # the method, not the value
    for task in tasks:
        student = [*renderer.context_ids(harness.initial_messages(task)), 7, 8, 9]
        teacher = hinted(task, student)
        hint_ids = renderer.encode(hinted.hints[task.task_id] or "")
        text = factory_tokenizer.decode(teacher)
        assert task.metadata["expression"] in text.replace(" ", "") or "Hint" in text
        assert teacher[-3:] == [7, 8, 9] and len(teacher) > len(student)
        # no hint token run in the student's context, exactly one in the teacher's
        assert not _contains(student, hint_ids[2:8])
        assert _contains(teacher, hint_ids[2:8])


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_leaking_hints_are_refused_and_counted(factory_tokenizer: Any) -> None:
    class Leaky:
        async def hint(self, task: Task, attempt: str | None = None) -> str | None:
            return f"it comes to {task.answer}"

    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    hinted = HintedTeacherContext(renderer, harness.initial_messages, Leaky())
    tasks = make_tasks(3, "train", seed=1)
    asyncio.run(hinted.prepare(tasks))
    assert hinted.stats.refused == 3 and hinted.stats.hints == 0
    ids = renderer.context_ids(harness.initial_messages(tasks[0]))
    assert hinted(tasks[0], ids) == ids  # no hint: the teacher sees the student's context
    assert hinted.stats.metrics()["rollout/hint_leak_refusals"] == 3.0


def test_critic_hint_through_an_openai_compatible_endpoint() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"message": {"content": " Check signs. "}}]})

    critic = CriticHint("http://critic", "critic-model", transport=httpx.MockTransport(handler))
    task = Task(task_id="t", kind="tir", prompt="What is 2 - 3?", answer="-1")
    assert asyncio.run(critic.hint(task, attempt="I got 1")) == "Check signs."
    assert seen[0]["model"] == "critic-model"
    assert "I got 1" in seen[0]["messages"][1]["content"]


def test_frozen_snapshot_without_hint_scores_the_students_own_logprobs(
    factory_tokenizer: Any, tmp_path: Path
) -> None:
    """OPSD's teacher is the student's initial checkpoint served by opd-teacher: without a
    hint, its log-probs of the student's sampled spans are the student's own (fp32)."""
    student_dir = build_checkpoint("qwen3-tiny", tmp_path / "student", seed=4)
    metrics = ServerMetrics()
    backend = HFBackend(student_dir, metrics, max_context=4096)
    student = backend.scorer.model
    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    policy = HFPolicy(student, factory_tokenizer.eos_token_id, seed=0)
    with serve_in_thread(create_app(backend, metrics)) as url:

        async def run() -> Any:
            async with TeacherClient(url) as teacher:
                runner = Runner(
                    harness,
                    policy,
                    renderer,
                    RunnerConfig(
                        max_turns=2,
                        max_new_tokens=12,
                        teacher_scoring="per_turn",
                        sampling=SamplingParams(max_new_tokens=12, temperature=1.0),
                    ),
                    teacher=teacher,
                )
                return await runner.run(make_tasks(3, "train", seed=2))

        trajectories = asyncio.run(run())
    turns = [turn for t in trajectories for turn in t.turns]
    assert turns
    for turn in turns:
        assert turn.logprobs is not None and turn.teacher_logprobs is not None
        assert torch.allclose(
            torch.tensor(turn.logprobs), torch.tensor(turn.teacher_logprobs), atol=1e-5
        )
