"""Synthetic arithmetic and algebra word problems with exact answers, and worked traces.

The numbers are large enough that a small model cannot do the arithmetic in its head: it
must copy them into a python call and copy the result into \\boxed{} (tool-integrated
reasoning at CPU scale). Splits are disjoint by construction: a problem's text decides
its split, so train and held-out never share a problem.
"""

from __future__ import annotations

import functools
import hashlib
import random
from importlib import resources
from typing import Any, Literal

import yaml

from rollout.chat import Message
from rollout.trajectory import Task

Split = Literal["train", "heldout"]
HELDOUT_SHARE = 0.2


@functools.cache
def _spec() -> dict[str, Any]:
    """arithmetic.yaml, parsed once (read only: a trace per task re-parsed it each time)."""
    spec: dict[str, Any] = yaml.safe_load(
        resources.files("rollout.tasks").joinpath("arithmetic.yaml").read_text()
    )
    return spec


def _split_of(problem: str) -> Split:
    digest = int(hashlib.sha256(problem.encode()).hexdigest()[:8], 16)
    return "heldout" if digest % 1000 < HELDOUT_SHARE * 1000 else "train"


def _evaluate(expression: str) -> int:
    """The value of a generated integer expression (digits, + - * // and parentheses)."""
    if set(expression) - set("0123456789+-*/() "):
        raise ValueError(f"not a generated arithmetic expression: {expression!r}")
    value = eval(expression, {"__builtins__": {}}, {})  # only digits and operators: checked
    return int(value)


def _family_specs(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every family by name: the default ones and each group of rephrasings."""
    specs: dict[str, dict[str, Any]] = dict(spec["families"])
    for group in spec["rephrased"].values():
        specs.update(group)
    return specs


def rephrased_families(group: Literal["practice", "unseen"]) -> list[str]:
    """The rephrasings in `group` (arithmetic.yaml explains what each group is for)."""
    return sorted(_spec()["rephrased"][group])


def make_tasks(
    count: int, split: Split, seed: int = 0, families: list[str] | None = None
) -> list[Task]:
    """`count` distinct problems of `split`, deterministic by seed, families round-robin
    (by default the five the bundled models trained on; rephrasings only when named)."""
    spec = _spec()
    specs = _family_specs(spec)
    names = families or sorted(spec["families"])
    unknown = sorted(set(names) - set(specs))
    if unknown:
        raise ValueError(f"unknown arithmetic families {unknown}; known: {sorted(specs)}")
    rng = random.Random(f"{seed}-{split}")
    tasks: list[Task] = []
    seen: set[str] = set()
    attempts = 0
    while len(tasks) < count:
        attempts += 1
        if attempts > 100 * count + 1000:
            raise ValueError(f"could not draw {count} distinct {split} problems")
        name = names[len(tasks) % len(names)]
        family = specs[name]
        numbers = {key: rng.randint(low, high) for key, (low, high) in family["numbers"].items()}
        for key, template in (family.get("derived") or {}).items():
            numbers[key] = _evaluate(template.format(**numbers))
        problem = family["problem"].format(**numbers)
        if problem in seen or _split_of(problem) != split:
            continue
        seen.add(problem)
        expression = family["expression"].format(**numbers)
        value = _evaluate(expression)
        task_id = f"arith-{split}-{hashlib.sha256(problem.encode()).hexdigest()[:10]}"
        tasks.append(
            Task(
                task_id=task_id,
                kind="tir",
                prompt=problem,
                answer=str(value),
                metadata={"family": name, "expression": expression},
            )
        )
    return tasks


def trace_messages(task: Task) -> list[Message]:
    """The worked solution: plan, one python call, read the result, answer in \\boxed{}."""
    trace = _spec()["trace"]
    expression = task.metadata["expression"]
    value = task.answer
    call = {
        "type": "function",
        "function": {"name": "python", "arguments": {"code": f"print({expression})"}},
    }
    return [
        {
            "role": "assistant",
            "reasoning_content": trace["plan"].format(expression=expression),
            "content": "",
            "tool_calls": [call],
        },
        {"role": "tool", "content": str(value)},
        {
            "role": "assistant",
            "reasoning_content": trace["read"].format(value=value),
            "content": trace["answer"].format(value=value),
        },
    ]
