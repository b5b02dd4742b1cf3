"""Token exactness of per-turn trajectories (DESIGN.md invariant 1) with the factory tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from rollout.chat import ChatRenderer, Message, TrajectoryBuilder, trajectory_from_conversation
from rollout.harness.tir import PYTHON_TOOL
from rollout.toolcalls import NoToolCallError, ToolCall, render_tool_call
from rollout.trajectory import (
    MaskTier,
    Task,
    Trajectory,
    TrajectoryStatus,
    token_accounting,
)

TOOLS = [PYTHON_TOOL]  # the TIR harness's python tool
TASK = Task(task_id="sum-squares", kind="tir", prompt="Sum the squares of 1..10.", answer="385")
PROMPT: list[Message] = [
    {"role": "system", "content": "Use python. Answer in \\boxed{}."},
    {"role": "user", "content": TASK.prompt},
]
TURNS = 10


def _think(k: int) -> str:
    return f"Step {k}: I will check part {k} of the sum with python."


def _scripted_action(k: int) -> str:
    if k == TURNS - 1:
        return "The sum is \\boxed{385}."
    call = ToolCall(name="python", arguments={"code": f"print(sum(i * i for i in range({k})))"})
    return render_tool_call(call)


def _run_scripted_policy(
    renderer: ChatRenderer, span_for: Any = None
) -> tuple[Trajectory, list[list[int]], list[list[int]]]:
    """Drive the builder as a rollout does; return what the policy saw and sampled."""
    builder = TrajectoryBuilder(renderer, TASK, PROMPT, "scripted-0")
    seen, sampled = [], []
    for k in range(TURNS):
        context = builder.next_context()
        seen.append(context)
        if span_for is not None:
            span = span_for(k, renderer)
        else:
            think = f"<think>\n{_think(k)}\n</think>\n\n"
            span = [*renderer.encode(think + _scripted_action(k)), renderer.eos_id]
        sampled.append(span)
        recorded = builder.record_turn(span, logprobs=[-0.5] * len(span), finish_reason="stop")
        if k < TURNS - 1:
            assert recorded.error is None and recorded.calls[0].name == "python"
            builder.record_observation(str(sum(i * i for i in range(k))))
        else:
            assert isinstance(recorded.error, NoToolCallError)
            builder.set_tier(recorded.index, MaskTier.VALID)  # a final answer is valid
    return builder.finish(TrajectoryStatus.COMPLETED, "boxed answer", reward=1.0), seen, sampled


@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_stored_trajectory_reproduces_every_context_and_span(
    factory_tokenizer: Any, policy: str
) -> None:
    renderer = ChatRenderer(factory_tokenizer, TOOLS, think_policy=policy)  # type: ignore[arg-type]
    trajectory, seen, sampled = _run_scripted_policy(renderer)
    restored = Trajectory.from_json_line(trajectory.to_json_line())
    assert restored.num_turns == TURNS
    for k in range(TURNS):
        assert restored.context_ids(k) == seen[k]
        assert restored.span_ids(k) == sampled[k]
        assert not restored.turns[k].drift, restored.turns[k].drift_reason
        assert restored.turns[k].context_suffix_ids == []
    assert restored.trunk_ids == seen[-1]
    assert all(turn.mask_tier is MaskTier.VALID for turn in restored.turns)


def test_drop_policy_removes_think_and_keep_policy_keeps_it(factory_tokenizer: Any) -> None:
    for policy, present in (("drop", False), ("keep", True)):
        renderer = ChatRenderer(factory_tokenizer, TOOLS, think_policy=policy)  # type: ignore[arg-type]
        trajectory, _, _ = _run_scripted_policy(renderer)
        text = factory_tokenizer.decode(trajectory.trunk_ids)
        assert (_think(3) in text) is present
        assert _scripted_action(3) in text
        if policy == "drop":  # the next context holds the action right after this context
            turn = trajectory.turns[3]
            nxt = trajectory.turns[4].context_len
            assert trajectory.trunk_ids[turn.context_len : nxt][: len(turn.action_ids)] == (
                turn.action_ids
            )


def test_think_boundary_and_action_split(factory_tokenizer: Any) -> None:
    renderer = ChatRenderer(factory_tokenizer, TOOLS)
    trajectory, _, _ = _run_scripted_policy(renderer)
    turn = trajectory.turns[2]
    assert factory_tokenizer.decode(turn.think_ids) == f"<think>\n{_think(2)}\n</think>\n\n"
    assert factory_tokenizer.decode(turn.action_ids) == _scripted_action(2) + "<|im_end|>"


def test_non_canonical_sampled_ids_are_detected_as_drift(factory_tokenizer: Any) -> None:
    """The policy sampled the action one character at a time; the tokenizer merges those
    characters when the action is rendered into the next context."""

    def span_for(k: int, renderer: ChatRenderer) -> list[int]:
        think = renderer.encode(f"<think>\n{_think(k)}\n</think>\n\n")
        action = _scripted_action(k)
        if k == 4:
            per_char = [i for ch in action for i in renderer.encode(ch)]
            assert per_char != renderer.encode(action)
            return [*think, *per_char, renderer.eos_id]
        return [*think, *renderer.encode(action), renderer.eos_id]

    renderer = ChatRenderer(factory_tokenizer, TOOLS)
    trajectory, seen, sampled = _run_scripted_policy(renderer, span_for)
    assert [turn.drift for turn in trajectory.turns] == [k == 4 for k in range(TURNS)]
    assert "re-tokenized the sampled action" in (trajectory.turns[4].drift_reason or "")
    for k in range(TURNS):  # recorded, never patched: what was seen and sampled survives
        assert trajectory.context_ids(k) == seen[k]
        assert trajectory.span_ids(k) == sampled[k]


class _EldingRenderer(ChatRenderer):
    """Context management that shortens old observations once the episode grows: later
    contexts stop extending earlier ones."""

    def visible(self, messages: Sequence[Message]) -> list[Message]:
        shown = super().visible(messages)
        tool_messages = [i for i, m in enumerate(shown) if m["role"] == "tool"]
        if len(tool_messages) > 5:
            first = tool_messages[0]
            shown[first] = {**shown[first], "content": "[output elided]"}
        return shown


def test_a_context_that_stops_extending_is_drift_and_contexts_survive(
    factory_tokenizer: Any,
) -> None:
    renderer = _EldingRenderer(factory_tokenizer, TOOLS)
    trajectory, seen, sampled = _run_scripted_policy(renderer)
    drifted = [k for k, turn in enumerate(trajectory.turns) if turn.drift]
    # turn 5's observation is the sixth: context_6 rewrites the first observation, which
    # every context from turn 1 on contains
    assert drifted == [1, 2, 3, 4, 5]
    assert "does not extend" in (trajectory.turns[5].drift_reason or "")
    assert "a later context rewrote" in (trajectory.turns[1].drift_reason or "")
    for k in range(TURNS):
        assert trajectory.context_ids(k) == seen[k]
        assert trajectory.span_ids(k) == sampled[k]
    restored = Trajectory.from_json_line(trajectory.to_json_line())
    assert [restored.context_ids(k) for k in range(TURNS)] == seen


def test_conversation_to_trajectory_matches_the_builder(factory_tokenizer: Any) -> None:
    renderer = ChatRenderer(factory_tokenizer, TOOLS)
    built, seen, sampled = _run_scripted_policy(renderer)
    messages: list[Message] = list(PROMPT)
    for k in range(TURNS):
        messages.append(renderer.assistant_message(sampled[k], built.turns[k].think_len))
        if k < TURNS - 1:
            messages.append({"role": "tool", "content": str(sum(i * i for i in range(k)))})
    converted = trajectory_from_conversation(renderer, TASK, messages, "scripted-0")
    assert [converted.context_ids(k) for k in range(TURNS)] == seen
    assert [converted.span_ids(k) for k in range(TURNS)] == sampled
    with pytest.raises(ValueError, match="2 spans for 10 assistant messages"):
        trajectory_from_conversation(renderer, TASK, messages, "x", spans=sampled[:2])


def test_structured_tool_calls_script_the_same_ids(factory_tokenizer: Any) -> None:
    renderer = ChatRenderer(factory_tokenizer, TOOLS)
    message = {
        "role": "assistant",
        "reasoning_content": "think",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "python", "arguments": {"code": "print(1)"}}}
        ],
    }
    span = renderer.scripted_span_ids(message)
    rendered = renderer.render_ids([*PROMPT, message], add_generation_prompt=False)
    context = renderer.context_ids(PROMPT)
    think_len = renderer.think_len(span)
    assert rendered[len(context) :][: len(span) - think_len] == span[think_len:]


def test_token_accounting(factory_tokenizer: Any) -> None:
    renderer = ChatRenderer(factory_tokenizer, TOOLS)
    trajectory, seen, sampled = _run_scripted_policy(renderer)
    counts = token_accounting(trajectory)
    assert counts["num_turns"] == TURNS
    assert counts["tokens_per_turn"] == pytest.approx(sum(map(len, sampled)) / TURNS)
    assert counts["per_turn_processed_tokens"] == sum(
        len(c) + len(s) for c, s in zip(seen, sampled, strict=True)
    )
    assert counts["tree_packed_processed_tokens"] == len(seen[-1]) + sum(map(len, sampled))
    assert counts["think_tokens_per_turn"] + counts["action_tokens_per_turn"] == pytest.approx(
        counts["tokens_per_turn"]
    )
    assert counts["observation_tokens_per_turn"] > 0


def test_record_turn_needs_a_fresh_context(factory_tokenizer: Any) -> None:
    builder = TrajectoryBuilder(ChatRenderer(factory_tokenizer, TOOLS), TASK, PROMPT, "t")
    with pytest.raises(RuntimeError, match="fresh next_context"):
        builder.record_turn([1, 2])


def test_bad_think_policy(factory_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="think_policy must be 'drop' or 'keep'"):
        ChatRenderer(factory_tokenizer, TOOLS, think_policy="sometimes")  # type: ignore[arg-type]
