"""The synthetic arithmetic tasks: exact answers, disjoint splits, and the rephrasings the
self-distillation bench trains on kept apart from the bundled models' default families."""

from __future__ import annotations

import pytest

from rollout.tasks.arithmetic import make_tasks, rephrased_families, trace_messages


def test_answers_are_the_values_of_their_expressions_and_splits_are_disjoint() -> None:
    names = rephrased_families("practice") + rephrased_families("unseen")
    train = make_tasks(200, "train", seed=4) + make_tasks(200, "train", seed=4, families=names)
    heldout = make_tasks(100, "heldout", seed=4)
    heldout += make_tasks(100, "heldout", seed=4, families=names)
    for task in train + heldout:
        assert int(task.answer) == eval(task.metadata["expression"])  # digits and operators
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    assert len({t.task_id for t in train + heldout}) == 600


def test_rephrasings_are_never_drawn_by_default_and_their_groups_do_not_overlap() -> None:
    practice, unseen = rephrased_families("practice"), rephrased_families("unseen")
    assert practice and unseen and not set(practice) & set(unseen)
    default = {t.metadata["family"] for t in make_tasks(100, "train", seed=0)}
    assert default == {"add", "subtract", "multiply", "two_step", "linear"}
    drawn = {t.metadata["family"] for t in make_tasks(40, "heldout", seed=0, families=unseen)}
    assert drawn == set(unseen)


def test_an_unknown_family_is_refused_with_the_known_names() -> None:
    with pytest.raises(ValueError, match=r"unknown arithmetic families \['nope'\].*train_ride"):
        make_tasks(3, "train", families=["add", "nope"])


def test_a_rephrased_task_has_the_same_worked_trace_shape() -> None:
    (task,) = make_tasks(1, "train", seed=2, families=["train_ride"])
    messages = trace_messages(task)
    code = messages[0]["tool_calls"][0]["function"]["arguments"]["code"]
    assert code == f"print({task.metadata['expression']})"
    assert messages[1]["content"] == task.answer
