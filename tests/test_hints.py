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
    StudentHint,
    hint_source,
    leak_reason,
    numbers_in,
)
from rollout.policy import Generation, HFPolicy, PolicyError, SamplingParams
from rollout.runner import Runner, RunnerConfig
from rollout.tasks.arithmetic import make_tasks
from rollout.tasks.mini_swe import family_names
from rollout.tasks.mini_swe import generate_tasks as generate_mini_swe
from rollout.trajectory import Task, Trajectory
from slime_ext.job.assembly import hinted_teacher_context, runner_config
from slime_ext.job.config import ConfigError, config_from_dict
from slime_ext.models.factory import build_checkpoint
from teacher_server.api import ScoreItem, ScoreResult
from teacher_server.app import create_app
from teacher_server.client import TeacherClient
from teacher_server.hf_backend import HFBackend
from teacher_server.metrics import ServerMetrics
from tests.live_server import serve_in_thread
from tests.test_runner import REPLIES, TASKS, ScriptedPolicy

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


def test_every_mini_swe_family_has_a_reference_hint_that_does_not_give_the_fix() -> None:
    """OPSD on SWE (`opd train` on mini-SWE): the self-teacher's reference hint says where
    to look and what to check; a hint quoting the fix's line is refused."""
    source = ReferenceHint()
    tasks = generate_mini_swe(2 * len(family_names()), seed=7)
    for task in tasks:
        hint = source.text(task)
        assert hint is not None and task.metadata["hint"] in hint
        assert leak_reason(hint, task) is None, (task.metadata["family"], hint)
    fixed_line = next(
        line[1:].strip()
        for line in tasks[0].metadata["reference_patch"].splitlines()
        if line.startswith("+") and not line.startswith("+++")
    )
    assert "gold patch" in (leak_reason(f"write {fixed_line}", tasks[0]) or "")


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


def test_each_trajectory_keeps_the_reference_hint_its_teacher_saw(factory_tokenizer: Any) -> None:
    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    hinted = HintedTeacherContext(renderer, harness.initial_messages, ReferenceHint())
    tasks = [
        TASKS[0].model_copy(update={"metadata": {"expression": "12 * 7 + 3"}}),
        TASKS[1].model_copy(update={"metadata": {"solution": "the answer is 1/2"}}),  # leaks
        TASKS[2],  # no reference: no hint
    ]
    teacher = RecordingTeacher([])
    runner = Runner(
        harness,
        ScriptedPolicy(renderer, REPLIES),
        renderer,
        RunnerConfig(),
        teacher=teacher,  # type: ignore[arg-type]
        teacher_context=hinted,
    )

    async def run() -> list[Trajectory]:
        await hinted.prepare(tasks)
        return await runner.run(tasks)

    records = {t.task.task_id: t.metadata["teacher_context"] for t in asyncio.run(run())}
    assert records["mul"]["hint_outcome"] == "hint" and "12 * 7 + 3" in records["mul"]["hint"]
    assert records["half"]["hint"] is None
    assert records["half"]["hint_outcome"].startswith("refused: ")
    assert records["wrong"] == {"hint": None, "hint_outcome": "missing"}


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_leaking_hints_are_refused_and_counted(factory_tokenizer: Any) -> None:
    class Leaky:
        reads_attempt = False

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


# --- the student as its own hint source ------------------------------------------------


class StudentStandIn:
    """The rollout policy: replays scripted replies for trajectories (session ids) and, for
    a request without a session (the hint prompt), writes `hint` after a think."""

    def __init__(self, renderer: ChatRenderer, hint: str, fail: bool = False) -> None:
        self.rollouts = ScriptedPolicy(renderer, REPLIES)
        self.renderer = renderer
        self.hint = hint
        self.fail = fail
        self.rollout_inputs: list[list[int]] = []
        self.hint_inputs: list[list[int]] = []
        self.events: list[str] = []

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        if session_id is not None:
            self.rollout_inputs.append(list(input_ids))
            return await self.rollouts.generate(input_ids, params, session_id)
        self.hint_inputs.append(list(input_ids))
        self.events.append("hint")
        if self.fail:
            raise PolicyError("router down")
        text = f"<think>\nThe attempt went wrong.\n</think>\n\n{self.hint}"
        ids = [*self.renderer.encode(text), self.renderer.eos_id]
        return Generation(output_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")


class RecordingTeacher:
    """A teacher service stand-in: records each scored context, answers -1 per span token."""

    def __init__(self, events: list[str]) -> None:
        self.contexts: list[list[int]] = []
        self.events = events

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        self.events.append("score")
        self.contexts += [item.input_ids[: item.span_start] for item in items]
        return [ScoreResult(logprobs=[-1.0] * (len(i.input_ids) - i.span_start)) for i in items]


def _student_hint_run(
    factory_tokenizer: Any, hint: str, fail: bool = False
) -> tuple[list[Trajectory], HintedTeacherContext, StudentStandIn, RecordingTeacher]:
    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    policy = StudentStandIn(renderer, hint, fail)
    sampling = SamplingParams(max_new_tokens=64)
    source = hint_source("student", student=StudentHint(policy, renderer, sampling, 4096))
    assert source is not None and source.reads_attempt
    hinted = HintedTeacherContext(renderer, harness.initial_messages, source)
    teacher = RecordingTeacher(policy.events)
    runner = Runner(
        harness,
        policy,
        renderer,
        RunnerConfig(teacher_scoring="after"),
        teacher=teacher,  # type: ignore[arg-type]
        teacher_context=hinted,
    )

    async def run() -> list[Trajectory]:
        await hinted.prepare(TASKS)  # nothing ahead: the hint needs the attempt
        assert hinted.hints == {}
        return await runner.run(TASKS)

    return asyncio.run(run()), hinted, policy, teacher


HINT = "Recheck the last tool output before you answer."


def test_student_hint_goes_into_the_teacher_context_only(factory_tokenizer: Any) -> None:
    trajectories, hinted, policy, teacher = _student_hint_run(factory_tokenizer, HINT)
    assert all(t.status.value == "completed" for t in trajectories)
    # one hint per trajectory, written by the rollout policy from the critic's prompt
    assert len(policy.hint_inputs) == len(TASKS)
    assert hinted.stats.hints == len(TASKS) and hinted.stats.refused == 0
    # trajectories end in any order: find the hint prompt of TASKS[0]
    prompts = [factory_tokenizer.decode(ids) for ids in policy.hint_inputs]
    prompt = next(p for p in prompts if TASKS[0].prompt in p)
    assert all("You review an agent's attempt" in p for p in prompts)
    assert "x = 12 * 7" in prompt and "print(x + 3)" in prompt  # the attempt's actions
    assert "The attempt went wrong" not in prompt
    # every turn is scored after its trajectory's hint was written
    first_hint = policy.events.index("hint")
    assert "score" not in policy.events[:first_hint]
    hint_ids = hinted.renderer.encode(hinted.prompts["insert"].format(hint=HINT))
    turns = [(t, k) for t in trajectories for k in range(t.num_turns)]
    assert len(teacher.contexts) == len(turns)
    for context in teacher.contexts:
        assert _contains(context, hint_ids[3:12])
        assert "The attempt went wrong" not in factory_tokenizer.decode(context)  # no think
    for trajectory in trajectories:
        for k in range(trajectory.num_turns):
            assert not _contains(trajectory.context_ids(k), hint_ids[3:12])
        assert not _contains(trajectory.trunk_ids, hint_ids[3:12])
    for ids in policy.rollout_inputs:  # what the student sampled from
        assert not _contains(ids, hint_ids[3:12])
    assert all(turn.teacher_logprobs is not None for t in trajectories for turn in t.turns)
    # each trajectory keeps the hint its teacher saw
    for trajectory in trajectories:
        assert trajectory.metadata["teacher_context"] == {"hint": HINT, "hint_outcome": "hint"}


def test_a_leaking_student_hint_is_refused_and_counted(factory_tokenizer: Any) -> None:
    leaky = "Just report \\boxed{87}."  # the answer of task 'mul'; the others get no leak
    trajectories, hinted, _, teacher = _student_hint_run(factory_tokenizer, leaky)
    assert hinted.stats.refused == 1 and hinted.stats.hints == len(TASKS) - 1
    assert hinted.stats.metrics()["rollout/hint_leak_refusals"] == 1.0
    leaked = hinted.renderer.encode("\\boxed{87}")
    mul = next(t for t in trajectories if t.task.task_id == "mul")
    mul_contexts = {tuple(mul.context_ids(k)) for k in range(mul.num_turns)}
    scored = [c for c in teacher.contexts if tuple(c) in mul_contexts]
    assert len(scored) == mul.num_turns  # the teacher read the student's own contexts
    assert not any(_contains(c, leaked) for c in teacher.contexts)
    record = mul.metadata["teacher_context"]
    assert record["hint"] is None and record["hint_outcome"].startswith("refused: ")
    others = [t.metadata["teacher_context"] for t in trajectories if t is not mul]
    assert others and all(r == {"hint": leaky, "hint_outcome": "hint"} for r in others)


def test_a_failed_student_hint_is_counted_and_the_turns_still_scored(
    factory_tokenizer: Any,
) -> None:
    trajectories, hinted, _, teacher = _student_hint_run(factory_tokenizer, HINT, fail=True)
    assert hinted.stats.errors == len(TASKS) and hinted.stats.hints == 0
    assert all(t.status.value == "completed" for t in trajectories)
    for trajectory in trajectories:
        record = trajectory.metadata["teacher_context"]
        assert record["hint"] is None and "router down" in record["hint_outcome"]
    assert len(teacher.contexts) == sum(t.num_turns for t in trajectories)


def test_a_student_hint_cut_off_by_its_budget_is_not_used(factory_tokenizer: Any) -> None:
    class Rambling:
        async def generate(
            self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
        ) -> Generation:
            ids = factory_tokenizer("<think>\nstill thinking")["input_ids"]
            return Generation(output_ids=ids, logprobs=[0.0] * len(ids), finish_reason="length")

    renderer = ChatRenderer(factory_tokenizer, TIRHarness().tools)
    student = StudentHint(Rambling(), renderer, SamplingParams(max_new_tokens=8), 4096)
    task = Task(task_id="t", kind="tir", prompt="What is 2 - 3?", answer="-1")
    assert asyncio.run(student.hint(task, "I got 1")) is None


def test_student_hint_prompt_keeps_the_attempts_end_within_the_context(
    factory_tokenizer: Any,
) -> None:
    seen: list[list[int]] = []

    class Recorder:
        async def generate(
            self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
        ) -> Generation:
            seen.append(input_ids)
            return Generation(output_ids=[5], logprobs=[0.0], finish_reason="stop")

    renderer = ChatRenderer(factory_tokenizer, TIRHarness().tools)
    student = StudentHint(Recorder(), renderer, SamplingParams(max_new_tokens=100), 400)
    task = Task(task_id="t", kind="tir", prompt="What is 2 - 3?", answer="-1")
    attempt = " ".join(f"step{i}" for i in range(400)) + " FINAL-STEP"
    asyncio.run(student.hint(task, attempt))
    assert len(seen[0]) <= 400 - 100 + 4  # a few ids of slack at the cut
    text = factory_tokenizer.decode(seen[0])
    assert "FINAL-STEP" in text and "step0 " not in text


def test_student_hints_need_the_rollout_policy_and_scoring_after_the_trajectory(
    factory_tokenizer: Any,
) -> None:
    with pytest.raises(ValueError, match="policy that samples the rollouts"):
        hint_source("student")
    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    policy = StudentStandIn(renderer, HINT)
    source = StudentHint(policy, renderer, SamplingParams(max_new_tokens=8), 4096)
    hinted = HintedTeacherContext(renderer, harness.initial_messages, source)
    with pytest.raises(ValueError, match="teacher_scoring 'after'"):
        Runner(
            harness,
            policy,
            renderer,
            RunnerConfig(teacher_scoring="per_turn"),
            teacher=RecordingTeacher([]),  # type: ignore[arg-type]
            teacher_context=hinted,
        )


@pytest.mark.parametrize(
    ("hint", "scoring"),
    [("student", "after"), ("critic", "after"), ("reference", "per_turn"), ("none", "per_turn")],
)
def test_opsd_jobs_score_after_the_trajectory_when_the_hint_reads_it(
    hint: str, scoring: str, factory_tokenizer: Any
) -> None:
    job = config_from_dict(
        {
            "teacher": {"kind": "self", "hint": hint, "critic_url": "http://critic"},
            "algorithm": {"recipe": "opsd"},
        }
    )
    assert runner_config(job).teacher_scoring == scoring
    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    policy = StudentStandIn(renderer, HINT)
    hinted = hinted_teacher_context(job, renderer, harness.initial_messages, policy)
    if hint == "none":
        assert hinted is None
        return
    assert hinted is not None and hinted.reads_attempt is (scoring == "after")
    if hint == "student":  # the job's rollout policy writes the hint, at the job's budget
        assert isinstance(hinted.source, StudentHint) and hinted.source.policy is policy
        assert hinted.source.sampling.max_new_tokens == job.teacher.hint_max_new_tokens


def test_config_accepts_the_student_hint_and_checks_its_budget() -> None:
    job = config_from_dict(
        {"teacher": {"kind": "self", "hint": "student"}, "algorithm": {"recipe": "opsd"}}
    )
    assert job.teacher.hint == "student" and job.teacher.model == job.model.student
    with pytest.raises(ConfigError, match="hint_max_new_tokens"):
        config_from_dict(
            {
                "rollout": {"max_context_tokens": 2048},
                "teacher": {"kind": "self", "hint": "student", "hint_max_new_tokens": 2048},
                "algorithm": {"recipe": "opsd"},
            }
        )
    with pytest.raises(ConfigError, match=r"teacher\.hint"):
        config_from_dict({"teacher": {"kind": "self", "hint": "self"}})
