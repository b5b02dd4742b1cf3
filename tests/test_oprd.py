"""OPRD: reminder scoping in the teacher's contexts, outcome-routed losses, and a tiny run."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from pydantic import ValidationError

from rollout.chat import ChatRenderer, Message, RecordedTurn, trajectory_from_conversation
from rollout.harness.base import StepOutcome
from rollout.harness.tir import TIRHarness
from rollout.policy import Generation, SamplingParams
from rollout.reminders import (
    Reminder,
    ReminderFile,
    ReminderTeacherContext,
    RuleReminders,
    Step,
    read_reminder_file,
    reminder_source,
    teacher_view,
)
from rollout.runner import Runner, RunnerConfig
from rollout.tasks.arithmetic import make_tasks, trace_messages
from rollout.toolcalls import ToolCall, render_tool_call
from rollout.trajectory import MaskTier, Task, Trajectory
from slime_ext.job.config import ConfigError, JobConfig, config_from_dict
from slime_ext.local.trainer import LocalTrainer, SelfTeacher, TrainerConfig
from slime_ext.losses import (
    masked_nll,
    per_trajectory_mean,
    teacher_topk_kl,
    topk_shared_support_kl,
)
from slime_ext.models.factory import build_model
from teacher_server.api import ScoreItem, ScoreResult

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SPEC = read_reminder_file()
RULE_TEXT = {rule.name: rule.text for rule in SPEC.rules}
TASK = Task(task_id="calc", kind="tir", prompt="What is 6 * 7?", answer="42")
TRACEBACK = (
    'Traceback (most recent call last):\n  File "<cell>", line 1\n'
    "NameError: name 'x' is not defined"
)
FAILED = "FAILED test_calc.py::test_mul - assert 41 == 42\n===== 1 failed, 2 passed in 0.1s ====="


def _call(code: str) -> str:
    return render_tool_call(ToolCall(name="python", arguments={"code": code}))


# (reply, observation): turn k's observation raises the reminders the teacher reads at k+1
SCRIPT = [
    (_call("print(x)"), TRACEBACK),  # error: local, read at turn 1 only
    (_call("print(6 * 7)"), "42"),
    (_call("print(6 * 7)"), "42"),  # repeated action: global from turn 3 on
    (_call("run_tests()"), FAILED),  # failing tests: local, read at turn 4 only
    ("I am not sure.", "Your reply had no tool call."),  # invalid action: local, turn 5
    ("The answer is \\boxed{42}.", None),
]


class ScriptedPolicy:
    """Replays SCRIPT and records every context it is given (what the student saw)."""

    def __init__(self, renderer: ChatRenderer) -> None:
        self.renderer = renderer
        self.seen: list[list[int]] = []

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        reply = SCRIPT[len(self.seen)][0]
        self.seen.append(list(input_ids))
        ids = [*self.renderer.encode(reply), self.renderer.eos_id]
        return Generation(output_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop")


class ScriptedEpisode:
    def __init__(self) -> None:
        self.steps = 0

    async def step(self, turn: RecordedTurn) -> StepOutcome:
        observation = SCRIPT[self.steps][1]
        self.steps += 1
        if observation is None:
            return StepOutcome(done=True, tier=MaskTier.VALID, reason="boxed answer")
        return StepOutcome(observation=observation)

    async def reward(self) -> float:
        return 0.0

    def details(self) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        pass


class ScriptedHarness:
    name = "scripted"

    def __init__(self) -> None:
        self.tools = TIRHarness().tools

    def initial_messages(self, task: Task) -> list[Message]:
        return [
            {"role": "system", "content": "Solve it."},
            {"role": "user", "content": task.prompt},
        ]

    async def start(self, task: Task) -> ScriptedEpisode:
        return ScriptedEpisode()


class RecordingTeacher:
    """Stands in for the teacher service: records each request, scores every token -1."""

    def __init__(self) -> None:
        self.items: list[ScoreItem] = []

    async def score(self, items: Sequence[ScoreItem]) -> list[ScoreResult]:
        self.items += items
        return [ScoreResult(logprobs=[-1.0] * (len(i.input_ids) - i.span_start)) for i in items]


def _contains(ids: Sequence[int], part: Sequence[int]) -> bool:
    return any(list(ids[i : i + len(part)]) == list(part) for i in range(len(ids) - len(part) + 1))


def _rollout(factory_tokenizer: Any) -> tuple[Trajectory, ScriptedPolicy, RecordingTeacher, Any]:
    harness = ScriptedHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    reminders = ReminderTeacherContext(renderer, RuleReminders(SPEC), SPEC)
    policy, teacher = ScriptedPolicy(renderer), RecordingTeacher()
    runner = Runner(
        harness,
        policy,
        renderer,
        RunnerConfig(max_turns=len(SCRIPT), teacher_scoring="per_turn"),
        teacher=teacher,  # type: ignore[arg-type]
        teacher_context=reminders,
    )
    [trajectory] = asyncio.run(runner.run([TASK]))
    return trajectory, policy, teacher, reminders


def test_reminders_reach_the_teacher_in_their_scope_and_never_the_student(
    factory_tokenizer: Any,
) -> None:
    trajectory, policy, teacher, reminders = _rollout(factory_tokenizer)
    assert trajectory.num_turns == len(SCRIPT) and trajectory.status.value == "completed"
    assert trajectory.turns[4].mask_tier is MaskTier.INVALID_ACTION
    task_global = SPEC.global_reminders["tir"][0]
    error = RULE_TEXT["error"].format(match="NameError: name 'x' is not defined")
    repeated = RULE_TEXT["repeated_action"].format(action=" ".join(_call("print(6 * 7)").split()))
    failing = RULE_TEXT["failing_tests"].format(match="===== 1 failed, 2 passed in 0.1s =====")
    invalid = RULE_TEXT["invalid_action"]
    expected = {  # turn -> what its teacher context reads, globals first
        0: [task_global],
        1: [task_global, error],
        2: [task_global],
        3: [task_global, repeated],
        4: [task_global, repeated, failing],
        5: [task_global, repeated, invalid],
    }
    requests = sorted(teacher.items, key=lambda item: item.span_start)
    assert len(requests) == len(SCRIPT)
    decode = factory_tokenizer.decode
    header = reminders.block_ids(["x"])[:6]  # the reminder message's opening ids
    for k, (item, turn) in enumerate(zip(requests, trajectory.turns, strict=True)):
        student = trajectory.context_ids(k)
        assert policy.seen[k] == student
        # the teacher scores the student's exact span, after the student's exact context
        # with one reminder message spliced in before the generation prompt
        assert item.input_ids[item.span_start :] == turn.span_ids
        cut = len(student) - len(reminders.generation_prompt)
        block = reminders.block_ids(expected[k])
        assert item.input_ids[: item.span_start] == student[:cut] + block + student[cut:]
        text = decode(item.input_ids[: item.span_start])
        for reminder in {error, repeated, failing, invalid, task_global}:
            assert text.count(reminder) == (reminder in expected[k]), (k, reminder)
        # no reminder token in anything the student conditioned on
        assert not _contains(student, header)
        assert "Reminders" not in decode(student)
        assert not any(r in decode(student) for r in (error, repeated, failing, invalid))
    assert not _contains(trajectory.trunk_ids, header)
    # the trainer rebuilds the same teacher contexts from the stored trajectory
    view = teacher_view(trajectory, reminders)
    for k, item in enumerate(requests):
        assert view.context_ids(k) == item.input_ids[: item.span_start]
        assert view.span_ids(k) == trajectory.span_ids(k)
        assert view.turns[k].mask_tier == trajectory.turns[k].mask_tier
    metrics = reminders.stats.take()
    assert metrics["rollout/reminder_global_count"] == 4  # task + repeated, each view once
    assert metrics["rollout/reminder_local_count"] == 6  # error, failing, invalid, twice
    assert metrics["rollout/reminder_context_frac"] == 1.0
    assert reminders.stats.take()["rollout/reminder_local_count"] == 0  # taken: reset


def test_no_reminders_leaves_the_teachers_context_the_students(factory_tokenizer: Any) -> None:
    renderer = ChatRenderer(factory_tokenizer, TIRHarness().tools)
    control = ReminderTeacherContext(renderer, reminder_source("none"))
    ids = renderer.context_ids(TIRHarness().initial_messages(TASK))
    assert control(TASK, ids, ()) == ids


class OnlyGlobal:
    def reminders(self, task: Task, steps: Sequence[Step]) -> list[Reminder]:
        return [Reminder("keep it short", "global")] if not steps else []


def test_reminder_sources_are_pluggable_and_their_files_checked(tmp_path: Path) -> None:
    custom = reminder_source("tests.test_oprd.OnlyGlobal")
    assert custom is not None and custom.reminders(TASK, []) == [
        Reminder("keep it short", "global")
    ]
    with pytest.raises(ValueError, match="cannot load"):
        reminder_source("tests.test_oprd.Missing")
    path = tmp_path / "reminders.yaml"
    spec = {
        "insert": "R:\n{items}",
        "global": {"all": ["be careful"]},
        "rules": [
            {"name": "empty", "when": "pattern", "pattern": "^$", "scope": "global", "text": "x"}
        ],
    }
    path.write_text(yaml.safe_dump(spec))
    source = reminder_source("rules", path)
    assert source is not None
    task = TASK.model_copy(update={"metadata": {"reminders": ["no imports"]}})
    assert [r.text for r in source.reminders(task, [])] == ["be careful", "no imports"]
    assert source.reminders(task, [Step("a", "")]) == [Reminder("x", "global")]
    spec["rules"] = [{"name": "bad", "when": "pattern", "pattern": "(", "text": "x"}]
    with pytest.raises(ValidationError, match="bad pattern"):
        ReminderFile.model_validate(spec)
    spec["rules"] = [{"name": "lost", "when": "repeated_action", "pattern": "a", "text": "x"}]
    with pytest.raises(ValidationError, match="only"):
        ReminderFile.model_validate(spec)


# --- losses ---------------------------------------------------------------------------


def _traces(factory_tokenizer: Any, rewards: Sequence[float]) -> list[Trajectory]:
    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    tasks = make_tasks(len(rewards), "train", seed=3)
    return [
        trajectory_from_conversation(
            renderer,
            task,
            harness.initial_messages(task) + trace_messages(task),
            f"{task.task_id}#0",
            reward=reward,
        )
        for task, reward in zip(tasks, rewards, strict=True)
    ]


def _forward(model: Any, context: list[int], span: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([context + span])).logits[0].float()
    return logits[len(context) - 1 : -1]


def _setup(factory_tokenizer: Any, rewards: Sequence[float], **config: Any) -> tuple[Any, ...]:
    trajectories = _traces(factory_tokenizer, rewards)
    for trajectory in trajectories:  # the final answers are valid (the harness says so)
        for turn in trajectory.turns:
            turn.mask_tier = MaskTier.VALID
    trajectories[0].turns[0].mask_tier = MaskTier.INVALID_ACTION
    renderer = ChatRenderer(factory_tokenizer, TIRHarness().tools)
    reminders = ReminderTeacherContext(renderer, RuleReminders(SPEC), SPEC)
    student = build_model("qwen3-tiny", factory_tokenizer, seed=2)
    teacher = build_model("qwen3-tiny", factory_tokenizer, seed=5)
    trainer = LocalTrainer(
        student, TrainerConfig(chunk_size=7, **config), SelfTeacher(teacher, reminders)
    )
    return trajectories, reminders, student, teacher, trainer


def _success_loss(student: Any, trajectories: list[Trajectory]) -> torch.Tensor:
    """Mean over trajectories of token-mean NLL, tier-1/2 turns left out."""
    logprobs, mask, owner = [], [], []
    for index, trajectory in enumerate(trajectories):
        for k, turn in enumerate(trajectory.turns):
            rows = torch.log_softmax(
                _forward(student, trajectory.context_ids(k), turn.span_ids), -1
            )
            logprobs.append(rows.gather(-1, torch.tensor(turn.span_ids)[:, None])[:, 0])
            mask += [turn.mask_tier is MaskTier.VALID] * len(turn.span_ids)
            owner += [index] * len(turn.span_ids)
    mask_t = torch.tensor(mask)
    nll = masked_nll(torch.cat(logprobs), mask_t).per_token
    return per_trajectory_mean(nll, mask_t, torch.tensor(owner), len(trajectories))


def _failure_loss(
    student: Any, teacher: Any, reminders: Any, trajectories: list[Trajectory], temperature: float
) -> torch.Tensor:
    """Mean over trajectories of token-mean shared-support KL, the teacher reading each turn
    through the reminders (every turn trained, invalid ones too)."""
    student_rows, teacher_rows, owner = [], [], []
    for index, trajectory in enumerate(trajectories):
        for k, turn in enumerate(trajectory.turns):
            context = trajectory.context_ids(k)
            reminded = reminders(trajectory.task, context, trajectory.turns[:k])
            assert len(reminded) > len(context)  # the teacher reads reminders
            student_rows.append(_forward(student, context, turn.span_ids))
            teacher_rows.append(_forward(teacher, reminded, turn.span_ids))
            owner += [index] * len(turn.span_ids)
    mask = torch.ones(len(owner), dtype=torch.bool)
    kl = topk_shared_support_kl(
        torch.cat(student_rows), torch.cat(teacher_rows), mask, 100, temperature
    ).per_token
    return per_trajectory_mean(kl, mask, torch.tensor(owner), len(trajectories))


def test_a_success_trajectory_trains_on_masked_nll(factory_tokenizer: Any) -> None:
    trajectories, _, student, _, trainer = _setup(factory_tokenizer, [1.0, 1.0], temperature=1.0)
    loss, metrics = trainer.loss(trajectories, "oprd")
    expected = _success_loss(student, trajectories)
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-4)
    masked = len(trajectories[0].turns[0].span_ids)
    total = sum(t.span_token_count() for t in trajectories)
    assert metrics["train/success_masked_token_frac"] == pytest.approx(masked / total)
    assert (
        metrics["train/failure_trajectories"] == 0 and "train/opd_reverse_kl_failure" not in metrics
    )
    # the invalid turn carries no loss: the same batch with it valid trains differently
    trajectories[0].turns[0].mask_tier = MaskTier.VALID
    unmasked, _ = trainer.loss(trajectories, "oprd")
    assert float(unmasked.detach()) != pytest.approx(float(loss.detach()), rel=1e-3)
    assert float(unmasked.detach()) == pytest.approx(
        float(_success_loss(student, trajectories)), rel=1e-4
    )


def test_a_failure_trajectory_trains_on_the_shared_support_kl(factory_tokenizer: Any) -> None:
    trajectories, reminders, student, teacher, trainer = _setup(
        factory_tokenizer, [0.0, 0.0], temperature=0.8
    )
    loss, metrics = trainer.loss(trajectories, "oprd")
    expected = _failure_loss(student, teacher, reminders, trajectories, 0.8)
    assert float(expected) > 0
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-4)
    assert metrics["train/success_trajectories"] == 0
    assert (
        "train/opd_reverse_kl_failure" in metrics and "train/opd_reverse_kl_success" not in metrics
    )
    # it differs from a teacher that reads no reminders: the reminders are in its contexts
    assert trainer.self_teacher is not None
    trainer.self_teacher.teacher_context = ReminderTeacherContext(reminders.renderer, None)
    plain, _ = trainer.loss(trajectories, "oprd")
    assert float(plain.detach()) != pytest.approx(float(loss.detach()), rel=1e-3)


def test_branch_weights_scale_each_branchs_mean(factory_tokenizer: Any) -> None:
    trajectories, reminders, student, teacher, trainer = _setup(
        factory_tokenizer,
        [1.0, 0.0, 0.0],
        oprd_success_weight=0.3,
        oprd_failure_weight=2.0,
    )
    loss, metrics = trainer.loss(trajectories, "oprd")
    success = _success_loss(student, trajectories[:1])
    failure = _failure_loss(student, teacher, reminders, trajectories[1:], 1.0)
    assert float(loss.detach()) == pytest.approx(float(0.3 * success + 2.0 * failure), rel=1e-4)
    assert metrics["train/success_branch_loss"] == pytest.approx(float(success), rel=1e-4)
    assert metrics["train/failure_branch_loss"] == pytest.approx(float(failure), rel=1e-4)
    assert {"train/opd_reverse_kl_success", "train/opd_reverse_kl_failure"} <= set(metrics)


def test_a_remote_teacher_trains_failures_on_its_topk_with_a_tail(factory_tokenizer: Any) -> None:
    trajectories = _traces(factory_tokenizer, [0.0, 1.0])
    generator = torch.Generator().manual_seed(0)
    for trajectory in trajectories:
        for turn in trajectory.turns:
            span = len(turn.span_ids)
            turn.teacher_logprobs = [-2.0] * span
            turn.teacher_topk_ids = torch.randint(0, 50, (span, 4), generator=generator).tolist()
            turn.teacher_topk_logprobs = (torch.rand(span, 4, generator=generator) - 3).tolist()
    student = build_model("qwen3-tiny", factory_tokenizer, seed=2)
    trainer = LocalTrainer(
        student, TrainerConfig(oprd_failure_loss="teacher_topk", oprd_success_weight=0.0)
    )
    loss, metrics = trainer.loss(trajectories, "oprd")
    failed = trajectories[0]
    rows = torch.cat(
        [_forward(student, failed.context_ids(k), t.span_ids) for k, t in enumerate(failed.turns)]
    )
    ids = torch.tensor([row for t in failed.turns for row in t.teacher_topk_ids or []])
    logprobs = torch.tensor([row for t in failed.turns for row in t.teacher_topk_logprobs or []])
    mask = torch.ones(len(rows), dtype=torch.bool)
    expected = teacher_topk_kl(rows, ids, logprobs, mask, tail=True).per_token.mean()
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-4)
    assert metrics["train/opd_reverse_kl_failure"] != 0


def test_a_served_teacher_trains_failures_on_the_sampled_reverse_kl(
    factory_tokenizer: Any,
) -> None:
    """oprd_failure_loss sampled (what slime's loss trains): a failure's tokens carry
    k_t = s(x_t) - t(x_t) against the service's log-prob of the student's own token, in
    policy-gradient form (gradient stopgrad(k_t) * grad s); successes keep the NLL."""
    trajectories = _traces(factory_tokenizer, [0.0, 1.0])
    for trajectory in trajectories:
        for turn in trajectory.turns:
            turn.mask_tier = MaskTier.VALID
            turn.teacher_logprobs = [-2.0 - 0.1 * i for i in range(len(turn.span_ids))]
    student = build_model("qwen3-tiny", factory_tokenizer, seed=2)
    config = TrainerConfig(
        oprd_failure_loss="sampled", oprd_success_weight=0.5, oprd_failure_weight=2.0
    )
    loss, metrics = LocalTrainer(student, config).loss(trajectories, "oprd")

    def span_logprobs(trajectory: Trajectory) -> torch.Tensor:  # with gradient
        rows = []
        for k, turn in enumerate(trajectory.turns):
            context = trajectory.context_ids(k)
            logits = student(input_ids=torch.tensor([context + turn.span_ids])).logits[0]
            logprobs = torch.log_softmax(logits[len(context) - 1 : -1].float(), -1)
            rows.append(logprobs.gather(-1, torch.tensor(turn.span_ids)[:, None])[:, 0])
        return torch.cat(rows)

    failed, won = trajectories
    student_logprobs = span_logprobs(failed)
    teacher_logprobs = torch.tensor(
        [p for turn in failed.turns for p in turn.teacher_logprobs or []]
    )
    k_t = (student_logprobs - teacher_logprobs).detach()
    success = -span_logprobs(won).mean()  # every turn valid: the plain token-mean NLL
    assert float(success) == pytest.approx(float(_success_loss(student, [won])), rel=1e-5)
    assert float(loss.detach()) == pytest.approx(float(0.5 * success + 2.0 * k_t.mean()), rel=1e-4)
    assert metrics["train/failure_branch_loss"] == pytest.approx(float(k_t.mean()), rel=1e-4)
    # the failure's gradient is the policy gradient with advantage -k_t
    weight = student.get_output_embeddings().weight
    (got,) = torch.autograd.grad(loss, weight)
    surrogate = 0.5 * success + 2.0 * (k_t * student_logprobs).mean()
    (want,) = torch.autograd.grad(surrogate, weight)
    assert torch.allclose(got, want, atol=1e-6)


# --- config, slime, and a run ---------------------------------------------------------


def test_oprd_config_defaults_and_refusals(tmp_path: Path) -> None:
    job = config_from_dict({"algorithm": {"recipe": "oprd"}, "teacher": {"kind": "self"}})
    assert job.teacher.snapshot == "refresh" and job.teacher.refresh_at == [0.2, 0.4, 0.6, 0.8]
    assert job.teacher.reminders == "rules"
    assert job.algorithm.oprd_failure_loss == "shared_support"
    kept = {"algorithm": {"recipe": "oprd"}, "teacher": {"kind": "self", "snapshot": "fixed"}}
    assert config_from_dict(kept).teacher.snapshot == "fixed"
    with pytest.raises(ConfigError, match="top_k"):
        config_from_dict(
            {
                "algorithm": {"recipe": "oprd", "oprd_failure_loss": "teacher_topk"},
                "teacher": {"kind": "self"},
            }
        )
    with pytest.raises(ConfigError, match="dotted path"):
        config_from_dict({"teacher": {"reminders": "mine"}})
    from launch.plan import check_cluster
    from slime_ext.slime.settings import HookConfigError, job_config, load_job

    # a cluster's teacher service gives no full distribution: shared_support is local only
    with pytest.raises(ConfigError, match="oprd_failure_loss sampled or teacher_topk"):
        check_cluster(job)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job.model_dump(mode="json")))
    with pytest.raises(HookConfigError, match="local trainer"):
        job_config(SimpleNamespace(opd_job_config=str(path)))
    job.algorithm.oprd_failure_loss = "sampled"
    path.write_text(yaml.safe_dump(job.model_dump(mode="json")))
    load_job.cache_clear()
    assert job_config(SimpleNamespace(opd_job_config=str(path))).algorithm.recipe == "oprd"


@pytest.mark.timeout(300)
def test_oprd_trains_locally_and_refreshes_its_in_process_teacher(tmp_path: Path) -> None:
    """Recipe oprd end to end: rollouts without a teacher service, the reminded in-process
    snapshot in the loss, the refresh at 20/40/60/80% of training copying the student in."""
    from rollout.tasks.arithmetic import make_tasks as tasks_for
    from slime_ext.local.loop import LocalRun
    from slime_ext.models.refs import resolve_model

    job = JobConfig.model_validate(
        {
            "model": {"student": "factory:qwen3-tiny", "seed": 0},
            "rollout": {"max_turns": 2, "max_new_tokens": 12, "tasks_per_step": 2},
            "teacher": {"kind": "self"},
            "algorithm": {"recipe": "oprd", "steps": 2, "lr": 1e-2},
            "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
        }
    )
    student_dir = resolve_model(job.model.student, tmp_path / "models", seed=0)
    run = LocalRun(job, student_dir, tmp_path / "run")
    initial = {k: v.clone() for k, v in run.model.state_dict().items()}
    history = asyncio.run(run.train(tasks_for(8, "train", seed=0), None))
    assert len(history) == 2
    for metrics in history:
        assert metrics["train/loss_tokens"] > 0 and metrics["train/teacher_processed_tokens"] > 0
        assert metrics["train/success_trajectories"] + metrics["train/failure_trajectories"] == 2
        assert metrics["rollout/reminder_global_count"] >= 2  # the task's, per trajectory
        assert "rollout/opd_reverse_kl" in metrics and "rollout/student_gt_teacher_frac" in metrics
        assert "rollout/masked_turn_frac" in metrics
    # 2 steps: 0.2 and 0.4 fall in step 1, 0.6 and 0.8 in step 2
    pushed = sorted(p.name for p in (tmp_path / "run/teacher_snapshots").glob("step_*"))
    assert pushed == ["step_00001", "step_00002"]
    assert run.trainer.self_teacher is not None
    teacher = run.trainer.self_teacher.model.state_dict()
    student = run.model.state_dict()
    assert all(torch.equal(teacher[k], student[k]) for k in student)
    assert any(not torch.equal(initial[k], student[k]) for k in student)


@pytest.mark.timeout(300)
def test_oprd_trains_against_a_served_snapshot_with_topk(tmp_path: Path) -> None:
    """oprd_failure_loss teacher_topk: the snapshot is served on 127.0.0.1, scores each turn
    after its reminded context with its top-k, and reloads the student at each refresh."""
    from slime_ext.local.run_config import run_local_job

    job = config_from_dict(
        {
            "model": {"student": "factory:qwen3-tiny", "seed": 0},
            "rollout": {"max_turns": 2, "max_new_tokens": 12, "tasks_per_step": 2},
            "teacher": {"kind": "self", "top_k": 8},
            "algorithm": {
                "recipe": "oprd",
                "steps": 2,
                "lr": 1e-2,
                "oprd_failure_loss": "teacher_topk",
            },
            "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
        }
    )
    history = run_local_job(job)
    assert [m["teacher/snapshot_step"] for m in history] == [1.0, 2.0]
    for metrics in history:
        assert metrics["train/trajectories_trained"] == 2  # every turn scored, top-k too
        assert metrics["rollout/reminder_context_frac"] == 1.0  # the task's global reminder
        assert "rollout/opd_reverse_kl" in metrics
        if metrics["train/failure_trajectories"]:
            assert "train/teacher_topk_kl" in metrics
