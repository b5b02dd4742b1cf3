from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from rollout.trajectory import (
    MaskTier,
    Task,
    Trajectory,
    TrajectoryFormatError,
    TrajectoryStatus,
    Turn,
    read_jsonl,
    write_jsonl,
)

TASK = Task(task_id="t-1", kind="tir", prompt="What is 2 + 2?", answer="4")


def _turn(context_len: int, span: list[int], **fields: Any) -> Turn:
    return Turn(
        context_len=context_len, span_ids=span, think_len=fields.pop("think_len", 0), **fields
    )


def _trajectory(num_turns: int, span_len: int = 20, obs_len: int = 30) -> Trajectory:
    """A drop-policy trajectory: each turn appends action + observation to the trunk."""
    trunk = list(range(1, 51))  # system + task
    turns = []
    for k in range(num_turns):
        think = [100 + k] * (span_len // 2)
        action = [200 + k] * (span_len - span_len // 2)
        observation = [300 + k] * obs_len
        turns.append(
            Turn(
                context_len=len(trunk),
                span_ids=think + action,
                think_len=len(think),
                logprobs=[-0.5] * span_len,
                observation_ids=observation,
            )
        )
        trunk = trunk + action + observation
    return Trajectory(
        trajectory_id="traj-1",
        task=TASK,
        trunk_ids=trunk,
        turns=turns,
        status=TrajectoryStatus.COMPLETED,
        status_reason="boxed answer",
        reward=1.0,
    )


def test_context_and_span_reconstruct_every_turn() -> None:
    trajectory = _trajectory(4)
    trunk = list(range(1, 51))
    for k in range(4):
        assert trajectory.context_ids(k) == trunk
        assert trajectory.span_ids(k) == [100 + k] * 10 + [200 + k] * 10
        assert trajectory.turns[k].think_ids == [100 + k] * 10
        assert trajectory.turns[k].action_ids == [200 + k] * 10
        trunk = trunk + [200 + k] * 10 + [300 + k] * 30


def test_drifted_turn_reconstructs_its_own_context() -> None:
    trunk = [1, 2, 3, 4, 5, 6, 7, 8]
    drifted = Turn(
        context_len=3,
        context_suffix_ids=[9, 9],
        span_ids=[4],
        think_len=0,
        drift=True,
        drift_reason="next context re-tokenized the action",
    )
    later = Turn(context_len=7, span_ids=[8], think_len=0)
    trajectory = Trajectory(
        trajectory_id="d",
        task=TASK,
        trunk_ids=trunk,
        turns=[drifted, later],
        status=TrajectoryStatus.TRUNCATED,
        status_reason="max turns",
    )
    assert trajectory.context_ids(0) == [1, 2, 3, 9, 9]
    assert trajectory.context_ids(1) == [1, 2, 3, 4, 5, 6, 7]


def test_jsonl_round_trip(tmp_path: Path) -> None:
    trajectories = [_trajectory(3), _trajectory(1).model_copy(update={"trajectory_id": "traj-2"})]
    trajectories[0].turns[1].mask_tier = MaskTier.SHELL_ERROR
    trajectories[0].turns[2].teacher_logprobs = [-1.25] * 20
    path = tmp_path / "out.jsonl"
    assert write_jsonl(path, trajectories) == 2
    loaded = list(read_jsonl(path))
    assert loaded == trajectories
    assert loaded[0].turns[1].mask_tier is MaskTier.SHELL_ERROR
    assert loaded[0].status is TrajectoryStatus.COMPLETED


@given(
    spans=st.lists(
        st.lists(st.integers(0, 150_000), min_size=1, max_size=8), min_size=0, max_size=6
    ),
    reward=st.none() | st.floats(allow_nan=False, allow_infinity=False),
    status=st.sampled_from(list(TrajectoryStatus)),
)
def test_any_valid_trajectory_survives_json(
    spans: list[list[int]], reward: float | None, status: TrajectoryStatus
) -> None:
    trunk = [7]
    turns = []
    for span in spans:
        turns.append(
            Turn(
                context_len=len(trunk),
                span_ids=span,
                think_len=len(span) // 2,
                logprobs=[-0.1 * i for i in range(len(span))],
            )
        )
        trunk = trunk + span
    trajectory = Trajectory(
        trajectory_id="h",
        task=TASK,
        trunk_ids=trunk,
        turns=turns,
        status=status,
        status_reason="r",
        reward=reward,
    )
    assert Trajectory.from_json_line(trajectory.to_json_line()) == trajectory


def test_storage_grows_linearly_with_turns() -> None:
    sizes = {
        n: len(_trajectory(n, span_len=200, obs_len=300).to_json_line()) for n in (10, 50, 100)
    }
    per_turn_first = (sizes[50] - sizes[10]) / 40
    per_turn_last = (sizes[100] - sizes[50]) / 50
    assert per_turn_last == pytest.approx(per_turn_first, rel=0.05)
    # A per-turn copy of the context would cost the trunk length (up to ~50k ids) per turn.
    assert per_turn_last < 12 * (200 + 200 + 300)


@pytest.mark.parametrize(
    ("turn_fields", "message"),
    [
        ({"think_len": 5}, "think_len (5) exceeds len(span_ids) (3)"),
        ({"logprobs": [-1.0]}, "logprobs has 1 entries but span_ids has 3"),
        ({"teacher_logprobs": [-1.0] * 4}, "teacher_logprobs has 4 entries but span_ids has 3"),
        ({"span_ids": []}, "span_ids"),
        ({"span_ids": [1, -2, 3]}, "span_ids holds a negative token id"),
        ({"observation_ids": [-1]}, "observation_ids holds a negative token id"),
        ({"context_suffix_ids": [4]}, "context_suffix_ids is set but drift is False"),
        ({"drift": True}, "drift is True but drift_reason is empty"),
        ({"mask_tier": 3}, "mask_tier"),
        ({"context_len": -1}, "context_len"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_turn_validation_names_the_field(turn_fields: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"context_len": 2, "span_ids": [1, 2, 3], "think_len": 1}
    fields.update(turn_fields)
    with pytest.raises(ValidationError, match=re.escape(message)):
        Turn(**fields)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"trunk_ids": []}, "trunk_ids"),
        ({"trunk_ids": [1, -1, 2]}, "trunk_ids holds a negative token id"),
        ({"status": "lost"}, "status"),
        ({"status_reason": ""}, "status_reason"),
        ({"think_policy": "sometimes"}, "think_policy"),
        ({"trajectory_id": ""}, "trajectory_id"),
        ({"sample_index": -1}, "sample_index"),
    ],
)
def test_trajectory_validation_names_the_field(changes: dict[str, Any], message: str) -> None:
    data = _trajectory(2).model_dump()
    data.update(changes)
    with pytest.raises(ValidationError, match=re.escape(message)):
        Trajectory.model_validate(data)


def test_turn_context_beyond_trunk_is_rejected() -> None:
    data = _trajectory(2).model_dump()
    data["turns"][1]["context_len"] = len(data["trunk_ids"]) + 1
    expected = r"turns\[1\].context_len .* exceeds len\(trunk_ids\)"
    with pytest.raises(ValidationError, match=expected):
        Trajectory.model_validate(data)


def test_contexts_must_grow() -> None:
    data = _trajectory(3).model_dump()
    data["turns"][2]["context_len"] = data["turns"][1]["context_len"]
    with pytest.raises(ValidationError, match=r"turns\[2\] context .* is not longer than"):
        Trajectory.model_validate(data)


def test_empty_context_is_rejected() -> None:
    data = _trajectory(1).model_dump()
    data["turns"][0]["context_len"] = 0
    with pytest.raises(ValidationError, match=r"turns\[0\] has an empty context"):
        Trajectory.model_validate(data)


def test_statuses_are_the_closed_set() -> None:
    assert {s.value for s in TrajectoryStatus} == {
        "completed",
        "truncated",
        "aborted",
        "sandbox_error",
        "teacher_error",
    }


def test_bad_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = _trajectory(1).to_json_line()
    broken = json.loads(good)
    broken["turns"][0]["logprobs"] = [0.0]
    path.write_text(good + "\n\n" + json.dumps(broken) + "\n")
    reader = read_jsonl(path)
    assert next(reader) == _trajectory(1)
    with pytest.raises(TrajectoryFormatError, match=r"(?s)bad.jsonl:3: .*logprobs has 1 entries"):
        next(reader)


def test_task_is_immutable_and_strict() -> None:
    with pytest.raises(ValidationError):
        TASK.prompt = "changed"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="task_id"):
        Task(task_id="", kind="tir", prompt="p")
