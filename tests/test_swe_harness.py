"""The swe harness end to end on mini-SWE tasks: a scripted policy's turns go through the
factory tokenizer's chat template and tool-call parser (TrajectoryBuilder), the harness
runs them in a local sandbox, and the submission is graded in a fresh one."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from rollout.chat import ChatRenderer, Message, TrajectoryBuilder
from rollout.harness.base import StepOutcome
from rollout.harness.swe import (
    SWEEpisode,
    SWEHarness,
    SWEHarnessConfig,
    UnknownTaskKindError,
    load_prompts,
    truncate_output,
)
from rollout.policy import Generation, SamplingParams
from rollout.rewards.swe import SWEGrade
from rollout.runner import Runner, RunnerConfig
from rollout.tasks.mini_swe import family_names, generate_tasks, spec_of
from rollout.toolcalls import ToolCall
from rollout.trajectory import MaskTier, Task, Trajectory, TrajectoryStatus
from sandbox import LocalSandbox, Sandbox

FAMILIES = family_names()
TASKS = {spec_of(task).family: task for task in generate_tasks(len(FAMILIES), seed=11)}
SUBMIT = ToolCall(name="submit", arguments={})
FAST_PYTEST = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -p no:cacheprovider tests"

Action = ToolCall | str
"""A tool call, or raw assistant text (which holds no tool call)."""


def bash(command: str) -> ToolCall:
    return ToolCall(name="bash", arguments={"command": command})


@dataclass
class Replay:
    trajectory: Trajectory
    outcomes: list[StepOutcome]
    reward: float
    grade: SWEGrade
    episode: SWEEpisode

    def observation(self, k: int) -> str:
        observation = self.outcomes[k].observation
        assert observation is not None, f"turn {k} has no observation"
        return observation


def replay(harness: SWEHarness, task: Task, actions: Sequence[Action], tokenizer: Any) -> Replay:
    """Drive one episode as the runner does, with a policy that replays `actions`."""
    renderer = ChatRenderer(tokenizer, harness.tools)

    async def run() -> Replay:
        messages = harness.initial_messages(task)
        builder = TrajectoryBuilder(renderer, task, messages, f"{task.task_id}-replay")
        episode = await harness.start(task)
        outcomes: list[StepOutcome] = []
        try:
            for action in actions:
                builder.next_context()
                message: Message = {"role": "assistant", "content": action}
                if isinstance(action, ToolCall):
                    message = {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [action.model_dump()],
                    }
                turn = builder.record_turn(renderer.scripted_span_ids(message))
                outcome = await episode.step(turn)
                outcomes.append(outcome)
                if outcome.tier is not None:
                    builder.set_tier(turn.index, outcome.tier)
                if outcome.observation is not None:
                    builder.record_observation(outcome.observation)
                if outcome.done:
                    break
            reward = await episode.reward()
        finally:
            await episode.close()
        submitted = outcomes[-1].reason == "submitted"
        status = TrajectoryStatus.COMPLETED if submitted else TrajectoryStatus.TRUNCATED
        trajectory = builder.finish(status, outcomes[-1].reason or "replayed", reward)
        assert episode.grade is not None
        return Replay(trajectory, outcomes, reward, episode.grade, episode)

    return asyncio.run(run())


def _patched_module(task: Task) -> str:
    first_line = spec_of(task).reference_patch.splitlines()[0]  # diff --git a/P b/P
    return first_line.split(" b/")[-1]


def _apply_reference_fix(task: Task) -> ToolCall:
    return bash(f"git apply <<'PATCH'\n{spec_of(task).reference_patch}PATCH\ngit status --short")


@pytest.fixture(scope="module")
def harness() -> SWEHarness:
    return SWEHarness()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", FAMILIES)
def test_scripted_policy_solves_every_family(
    harness: SWEHarness, factory_tokenizer: Any, family: str
) -> None:
    task = TASKS[family]
    spec = spec_of(task)
    actions = [
        bash("ls tests"),
        bash(f"cat {_patched_module(task)}"),
        _apply_reference_fix(task),
        bash(FAST_PYTEST),
        SUBMIT,
    ]
    run = replay(harness, task, actions, factory_tokenizer)
    assert run.reward == 1.0, run.grade.reason + run.grade.log[-2000:]
    assert run.grade.fail_to_pass.success == spec.fail_to_pass
    assert run.grade.pass_to_pass.success == spec.pass_to_pass
    assert run.trajectory.status is TrajectoryStatus.COMPLETED
    assert [t.mask_tier for t in run.trajectory.turns] == [MaskTier.VALID] * len(actions)
    assert not any(t.drift for t in run.trajectory.turns)
    for hidden_path in spec.hidden_tests:  # the agent never sees the hidden tests
        assert hidden_path.split("/")[-1] not in run.observation(0)
    assert "<returncode>0</returncode>" in run.observation(2)
    assert "passed" in run.observation(3)
    assert run.episode.submission is not None
    assert run.episode.submission.startswith(f"diff --git a/{_patched_module(task)}")
    assert run.episode.details() == {
        "answer": run.episode.submission,
        "tool_calls": 4,
        "reason": "resolved",
        "resolved": True,
        "patch_applied": True,
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", FAMILIES)
def test_patch_that_leaves_the_bug_scores_zero(
    harness: SWEHarness, factory_tokenizer: Any, family: str
) -> None:
    """Also checks the generator: at the base code every FAIL_TO_PASS test fails and
    every PASS_TO_PASS test passes."""
    task = TASKS[family]
    spec = spec_of(task)
    run = replay(
        harness, task, [bash("echo 'Fixed, I think.' >> README.md"), SUBMIT], factory_tokenizer
    )
    assert run.reward == 0.0 and run.grade.patch_applied
    assert run.grade.fail_to_pass.failure == spec.fail_to_pass
    assert run.grade.pass_to_pass.success == spec.pass_to_pass
    assert "FAIL_TO_PASS" in run.grade.reason


@pytest.mark.timeout(60)
def test_wrong_fix_scores_zero(harness: SWEHarness, factory_tokenizer: Any) -> None:
    task = TASKS["off_by_one"]
    module = _patched_module(task)
    actions = [bash(f"sed -i 's/count - 1]/count + 1]/' {module} && git diff --stat"), SUBMIT]
    run = replay(harness, task, actions, factory_tokenizer)
    assert "1 file changed" in run.observation(0)
    assert run.reward == 0.0 and run.grade.fail_to_pass.failure
    assert run.grade.tests_status  # the tests ran and were parsed


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "edit",
    [
        "echo 'def test_extra():\n    pass' >> tests/{visible}",
        # A conftest hidden behind .gitignore, force-added so the diff still carries it.
        "printf 'conftest.py\\n' >> .gitignore && echo 'import pytest' > conftest.py"
        " && git add -f conftest.py",
    ],
    ids=["visible-test", "ignored-conftest"],
)
def test_patch_that_edits_tests_scores_zero_even_when_it_fixes_the_bug(
    harness: SWEHarness, factory_tokenizer: Any, edit: str
) -> None:
    task = TASKS["comparison"]
    visible = next(p for p in spec_of(task).files if p.startswith("tests/test_")).split("/")[-1]
    actions = [_apply_reference_fix(task), bash(edit.format(visible=visible)), SUBMIT]
    run = replay(harness, task, actions, factory_tokenizer)
    assert run.reward == 0.0
    assert run.grade.reason.startswith("the patch edits test files")
    assert run.grade.patch_applied and not run.grade.tests_status  # refused before any test ran


@pytest.mark.timeout(30)
def test_noop_submission_scores_zero_without_a_grading_sandbox(factory_tokenizer: Any) -> None:
    created: list[Sandbox] = []

    def factory(image: str | None) -> Sandbox:
        assert image is None  # mini-SWE tasks have no image
        created.append(LocalSandbox(SWEHarness().config.sandbox))
        return created[-1]

    harness = SWEHarness(sandbox_factory=factory)
    run = replay(
        harness, TASKS["arithmetic"], [bash("git status --short"), SUBMIT], factory_tokenizer
    )
    assert run.reward == 0.0 and run.grade.reason == "empty patch"
    assert run.episode.submission == ""
    assert len(created) == 1


@pytest.mark.timeout(30)
def test_shell_refusals_are_tier_2_and_failing_commands_stay_valid(
    harness: SWEHarness, factory_tokenizer: Any
) -> None:
    actions = [
        bash("definitely-not-a-command --help"),
        bash("if then fi"),
        bash("grep -q no-such-text README.md"),
        bash("python -c 'import sys; sys.exit(\"a real traceback would go here\")'"),
        SUBMIT,
    ]
    run = replay(harness, TASKS["empty_input"], actions, factory_tokenizer)
    tiers = [turn.mask_tier for turn in run.trajectory.turns]
    assert tiers == [MaskTier.SHELL_ERROR, MaskTier.SHELL_ERROR] + [MaskTier.VALID] * 3
    assert "<returncode>127</returncode>" in run.observation(0)
    assert "definitely-not-a-command: command not found" in run.observation(0)
    assert "<returncode>2</returncode>" in run.observation(1)
    assert "<returncode>1</returncode>" in run.observation(2)
    assert "a real traceback would go here" in run.observation(3)  # stderr is shown


@pytest.mark.timeout(30)
def test_invalid_actions_are_tier_1_and_the_model_is_told_why(
    harness: SWEHarness, factory_tokenizer: Any
) -> None:
    actions: list[Action] = [
        "Let me look at the repository first.",
        ToolCall(name="bash", arguments={"cmd": "ls"}),
        ToolCall(name="python", arguments={"code": "print(1)"}),
        bash("echo a\x00b"),
        SUBMIT,
    ]
    run = replay(harness, TASKS["swapped_args"], actions, factory_tokenizer)
    tiers = [turn.mask_tier for turn in run.trajectory.turns]
    assert tiers == [MaskTier.INVALID_ACTION] * 4 + [MaskTier.VALID]
    details = ["no <tool_call>", "command", "unknown tool 'python'", "NUL byte"]
    for k, detail in enumerate(details):
        assert run.observation(k).startswith("Your last message did not contain a valid tool call")
        assert detail in run.observation(k)
    assert run.trajectory.status is TrajectoryStatus.COMPLETED


@pytest.mark.timeout(30)
def test_long_output_is_cut_to_head_and_tail(harness: SWEHarness, factory_tokenizer: Any) -> None:
    run = replay(harness, TASKS["off_by_one"], [bash("seq 1 30000"), SUBMIT], factory_tokenizer)
    observation = run.observation(0)
    limit = harness.config.max_output_chars
    assert len(observation) < limit + 1000
    assert "<output_head>\n1\n2\n3\n" in observation
    assert "29999\n30000\n" in observation.split("<output_tail>")[1]
    total = len("\n".join(str(i) for i in range(1, 30001))) + 1
    assert f"{total - limit} characters elided" in observation


def test_truncation_keeps_short_output_and_splits_long_output_evenly() -> None:
    prompts = load_prompts()
    assert truncate_output("x" * 100, 100, prompts) == "x" * 100
    cut = truncate_output("h" * 60 + "m" * 1000 + "t" * 60, 100, prompts)
    assert "h" * 50 in cut and "h" * 51 not in cut and "t" * 50 in cut and "t" * 51 not in cut
    assert "m" * 50 not in cut and "1020 characters elided" in cut


@pytest.mark.timeout(30)
def test_step_limit_ends_the_episode_unsubmitted(factory_tokenizer: Any) -> None:
    harness = SWEHarness(SWEHarnessConfig(step_limit=3))
    actions: list[Action] = [bash("true"), "no tool call here", bash("true"), bash("true"), SUBMIT]
    run = replay(harness, TASKS["comparison"], actions, factory_tokenizer)
    assert len(run.outcomes) == 3
    last = run.outcomes[-1]
    assert last.done and last.truncated and last.observation is None and last.reason is not None
    assert last.reason.startswith("step limit")
    assert run.reward == 0.0 and run.grade.reason == "no submission"
    assert run.trajectory.status is TrajectoryStatus.TRUNCATED
    assert "at most 3 tool calls" in harness.initial_messages(TASKS["comparison"])[1]["content"]


@pytest.mark.timeout(30)
def test_command_past_its_timeout_is_killed_and_reported(factory_tokenizer: Any) -> None:
    harness = SWEHarness(SWEHarnessConfig(command_timeout_s=1))
    actions = [bash("echo started; sleep 20; echo never"), SUBMIT]
    run = replay(harness, TASKS["arithmetic"], actions, factory_tokenizer)
    observation = run.observation(0)
    assert "ran longer than 1 seconds" in observation and "started" in observation
    assert "never" not in observation and "<returncode>137</returncode>" in observation
    assert run.trajectory.turns[0].mask_tier is MaskTier.VALID


@pytest.mark.timeout(30)
def test_each_command_starts_in_the_repository_root(
    harness: SWEHarness, factory_tokenizer: Any
) -> None:
    actions = [
        bash("cd tests && export MARK=1 && pwd"),
        bash("pwd; echo mark=${MARK:-unset}"),
        SUBMIT,
    ]
    run = replay(harness, TASKS["off_by_one"], actions, factory_tokenizer)
    assert "/repo/tests\n" in run.observation(0)
    assert "/repo\nmark=unset\n" in run.observation(1)
    assert asyncio.run(run.episode.sandbox.is_alive()) is False  # closed with the episode


def test_tools_and_first_messages(harness: SWEHarness) -> None:
    assert [tool["function"]["name"] for tool in harness.tools] == ["bash", "submit"]
    task = TASKS["empty_input"]
    system, user = harness.initial_messages(task)
    assert system["role"] == "system" and "submit" in system["content"]
    assert user["role"] == "user" and task.prompt in user["content"] and "`repo`" in user["content"]
    with pytest.raises(UnknownTaskKindError, match="no task family for kind 'tir'"):
        harness.initial_messages(Task(task_id="t", kind="tir", prompt="1+1?"))


class ScriptedPolicy:
    """Replays fixed actions per task as the ids a model would sample (Policy protocol)."""

    def __init__(self, renderer: ChatRenderer, actions: dict[str, list[ToolCall]]) -> None:
        self.renderer = renderer
        self.actions = actions
        self.calls: dict[str, int] = {}

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        assert session_id is not None
        index = self.calls.get(session_id, 0)
        self.calls[session_id] = index + 1
        action = self.actions[session_id.split("#")[0]][index]
        message = {"role": "assistant", "content": "", "tool_calls": [action.model_dump()]}
        ids = self.renderer.scripted_span_ids(message)
        return Generation(output_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")


@pytest.mark.timeout(60)
def test_runner_drives_swe_episodes_concurrently(
    harness: SWEHarness, factory_tokenizer: Any
) -> None:
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    wrong = generate_tasks(1, seed=12, families=["comparison"])[0]
    actions = {task.task_id: [_apply_reference_fix(task), SUBMIT] for task in TASKS.values()}
    actions[wrong.task_id] = [bash("echo '# todo' >> README.md"), SUBMIT]
    policy = ScriptedPolicy(renderer, actions)
    config = RunnerConfig(concurrency=3, max_context_tokens=32_768, max_new_tokens=4096)
    runner = Runner(harness, policy, renderer, config)
    trajectories = asyncio.run(runner.run([*TASKS.values(), wrong]))
    assert [t.reward for t in trajectories] == [1.0] * len(TASKS) + [0.0]
    assert all(t.status is TrajectoryStatus.COMPLETED for t in trajectories)
    assert all(t.status_reason == "submitted" for t in trajectories)
    assert all(turn.mask_tier is MaskTier.VALID for t in trajectories for turn in t.turns)
