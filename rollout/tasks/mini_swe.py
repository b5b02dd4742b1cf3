"""mini-SWE: generated git repositories with one planted bug each, graded like SWE-bench
without a prebuilt image.

A task is a small Python package (`<pkg>/<module>.py`, a README, visible tests under
`tests/` that pass at the base commit), a problem statement in the style of an issue, and
hidden tests: FAIL_TO_PASS tests that fail until the bug is fixed and PASS_TO_PASS tests
that must keep passing. The hidden tests never enter the agent's sandbox: grading
materializes the base repository in a fresh sandbox, applies the agent's patch, refuses it
if it touches a test path, and only then writes the hidden tests (as the test patch of a
SWE-bench-format instance) and runs them, graded through swebench's pytest log parser.

Bug families (texts and code templates in mini_swe.yaml): off_by_one (slice end),
comparison (strict vs non-strict operator), empty_input (missing empty-list guard),
swapped_args (a helper called with two arguments swapped), arithmetic (+ for - in a
discount, surcharge or tax). Names, operators and values vary with the seed.
"""

from __future__ import annotations

import difflib
import functools
import operator
import random
import shlex
from collections.abc import Callable
from importlib import resources
from string import Template
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from rollout.chat import Message
from rollout.harness.swe_scripts import bash, submit
from rollout.trajectory import Task
from sandbox.base import Sandbox, SandboxError

KIND = "mini_swe"
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "mini-swe",
    "GIT_AUTHOR_EMAIL": "mini-swe@localhost",
    "GIT_COMMITTER_NAME": "mini-swe",
    "GIT_COMMITTER_EMAIL": "mini-swe@localhost",
    # A fixed date makes the base commit's hash a function of the task alone.
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+00:00",
}
_INIT_REPO = (
    "git -c init.defaultBranch=main init -q"
    " && git config user.name mini-swe && git config user.email mini-swe@localhost"
    " && git add -A && git commit -q -m 'Initial commit' && git rev-parse HEAD"
)


class MaterializeError(SandboxError):
    """The task's repository could not be created in the sandbox (not the agent's fault)."""


class UnknownFamilyError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class MiniSWESpec(BaseModel):
    """Everything a mini-SWE task needs; stored as the Task's metadata."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    family: str
    """The bug family (off_by_one, comparison, ...)."""
    repo_dir: str = "repo"
    """The repository, relative to the sandbox's working directory; the agent's cwd."""
    files: dict[str, str]
    """The repository at its base commit, path -> text (the bug included)."""
    hidden_tests: dict[str, str]
    """Test files written into the repository only at grading."""
    fail_to_pass: list[str]
    """pytest ids that fail at the base commit and must pass after the fix."""
    pass_to_pass: list[str]
    """pytest ids that pass at the base commit and must keep passing."""
    reference_patch: str
    """A git diff that fixes the bug (for tests and scripted policies)."""
    protected_paths: list[str]
    """fnmatch patterns (relative to the repository) a submission may not touch."""
    test_command: str
    """Runs every test under tests/ with pytest's -rA summary (what the log parser reads)."""
    hint: str | None = None
    """A reference hint for a self-teacher (OPSD's `reference` source): where the bug is
    and what to check, without the fix."""
    module_path: str | None = None
    """The file that holds the bug (relative to the repository)."""
    example: str | None = None
    """The issue's failing call, a Python expression (`func([3, 4], 1)`)."""
    fix_command: str | None = None
    """A bash command that applies the reference fix by line number (sed), as the worked
    script's edit writes it."""


class _Family(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    funcs: list[str]
    helpers: list[str]
    module: str
    bug: str
    fix: str
    visible_tests: str
    visible_pass_to_pass: list[str]
    hidden_tests: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    statement: str
    hint: str
    """Where to look and what to check, never the fix (OPSD's reference hint)."""
    example: str
    """The call the statement shows failing (a Python expression)."""


class _Catalog(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    packages: list[str]
    modules: list[str]
    nouns: list[str]
    repo_files: dict[str, str]
    module_path: str
    visible_tests_path: str
    hidden_tests_path: str
    protected_paths: list[str]
    test_command: str
    eval_script: str
    families: dict[str, _Family]


@functools.cache
def load_catalog() -> _Catalog:
    text = resources.files("rollout.tasks").joinpath("mini_swe.yaml").read_text("utf-8")
    return _Catalog.model_validate(yaml.safe_load(text))


def family_names() -> list[str]:
    return list(load_catalog().families)


def _fill(text: str, names: dict[str, str]) -> str:
    return Template(text).substitute(names)


def _ints(values: list[int]) -> str:
    return ", ".join(map(str, values))


def _off_by_one(rng: random.Random) -> dict[str, Any]:
    values = [rng.randint(1, 99) for _ in range(rng.randint(5, 7))]
    count = rng.randint(2, len(values) - 1)
    return {
        "values": _ints(values),
        "n_values": len(values),
        "count": count,
        "first": values[0],
        "past_end": len(values) + rng.randint(1, 5),
        "total": sum(values),
        "right": sum(values[:count]),
        "wrong": sum(values[: count - 1]),
    }


_COMPARE: dict[str, Callable[[int, int], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}
_OPERATORS = {
    ">": (">=", "strictly greater than"),
    ">=": (">", "greater than or equal to"),
    "<": ("<=", "strictly less than"),
    "<=": ("<", "less than or equal to"),
}


def _comparison(rng: random.Random) -> dict[str, Any]:
    op = rng.choice(sorted(_OPERATORS))
    bug_op, op_words = _OPERATORS[op]
    limit = rng.randint(20, 80)
    away = [rng.choice([rng.randint(1, limit - 1), rng.randint(limit + 1, 99)]) for _ in range(5)]
    values = [*away[:3], limit, *away[3:]]

    def count(op_text: str, items: list[int]) -> int:
        return sum(1 for item in items if _COMPARE[op_text](item, limit))

    return {
        "op": op,
        "bug_op": bug_op,
        "op_words": op_words,
        "limit": limit,
        "values": _ints(values),
        "sorted_values": _ints(sorted(values)),
        "values_away": _ints(away),
        "right": count(op, values),
        "wrong": count(bug_op, values),
        "right_away": count(op, away),
    }


def _empty_input(rng: random.Random) -> dict[str, Any]:
    values = [rng.randint(1, 99) for _ in range(rng.randint(3, 6))]
    default = rng.choice(["0", "0.0", "None"])
    return {
        "values": _ints(values),
        "first": values[0],
        "total": sum(values),
        "mean": repr(sum(values) / len(values)),
        "default": default,
        "default_check": "is None" if default == "None" else f"== {default}",
    }


def _swapped_args(rng: random.Random) -> dict[str, Any]:
    low = rng.randint(10, 40)
    high = low + rng.randint(10, 40)
    values = [rng.randint(0, low - 1), rng.randint(low, high), rng.randint(high + 1, high + 30)]
    values += [rng.randint(0, high + 30) for _ in range(rng.randint(1, 3))]
    rng.shuffle(values)
    return {
        "low": low,
        "high": high,
        "mid": rng.randint(low, high),
        "below": rng.randint(0, low - 1),
        "values": _ints(values),
        "clamped": _ints([max(low, min(v, high)) for v in values]),
        "wrong": _ints([max(high, min(v, low)) for v in values]),
        "all_low": _ints([low] * len(values)),
    }


_ADJUSTMENTS = {
    "discount": ("-", "+", "less a `discount_pct` percent discount"),
    "surcharge": ("+", "-", "plus a `surcharge_pct` percent surcharge"),
    "tax": ("+", "-", "plus `tax_pct` percent tax"),
}


def _arithmetic(rng: random.Random) -> dict[str, Any]:
    adj = rng.choice(sorted(_ADJUSTMENTS))
    op, bug_op, adj_words = _ADJUSTMENTS[adj]
    unit, quantity = rng.randint(2, 200), rng.randint(2, 12)
    pct = rng.choice([5, 10, 15, 20, 25, 30])
    subtotal = unit * quantity
    share = subtotal * pct / 100
    return {
        "adj": adj,
        "op": op,
        "bug_op": bug_op,
        "adj_words": adj_words,
        "unit": unit,
        "quantity": quantity,
        "pct": pct,
        "pct_of_unit": repr(unit * pct / 100),
        "subtotal": subtotal,
        "right": repr(subtotal - share if op == "-" else subtotal + share),
        "wrong": repr(subtotal + share if op == "-" else subtotal - share),
    }


_SAMPLERS: dict[str, Callable[[random.Random], dict[str, Any]]] = {
    "off_by_one": _off_by_one,
    "comparison": _comparison,
    "empty_input": _empty_input,
    "swapped_args": _swapped_args,
    "arithmetic": _arithmetic,
}


def generate_tasks(n: int, seed: int, families: list[str] | None = None) -> list[Task]:
    """`n` tasks, the same for the same arguments; families take turns in order."""
    chosen = families or family_names()
    if unknown := sorted(set(chosen) - set(load_catalog().families)):
        raise UnknownFamilyError(f"unknown mini-SWE families {unknown}; known: {family_names()}")
    return [make_task(chosen[i % len(chosen)], seed, i) for i in range(n)]


def make_task(family_name: str, seed: int, index: int) -> Task:
    catalog = load_catalog()
    family = catalog.families[family_name]
    rng = random.Random(f"mini_swe:{seed}:{index}:{family_name}")
    noun, pkg = rng.choice(catalog.nouns), rng.choice(catalog.packages)
    names = {
        "pkg": pkg,
        "module": rng.choice(catalog.modules),
        "noun": noun,
        "NOUNS": f"{noun.upper()}S",
        "title": pkg.capitalize(),
        "func": rng.choice(family.funcs),
        "helper": rng.choice(family.helpers),
        **{key: str(value) for key, value in _SAMPLERS[family_name](rng).items()},
    }
    module_path = _fill(catalog.module_path, names)
    visible_path = _fill(catalog.visible_tests_path, names)
    hidden_path = _fill(catalog.hidden_tests_path, names)
    buggy = _fill(family.module, {**names, "site": _fill(family.bug, names)})
    fixed = _fill(family.module, {**names, "site": _fill(family.fix, names)})
    files = {_fill(path, names): _fill(text, names) for path, text in catalog.repo_files.items()}
    files |= {module_path: buggy, visible_path: _fill(family.visible_tests, names)}
    spec = MiniSWESpec(
        family=family_name,
        files=files,
        hidden_tests={hidden_path: _fill(family.hidden_tests, names)},
        fail_to_pass=[f"{hidden_path}::{_fill(t, names)}" for t in family.fail_to_pass],
        pass_to_pass=[f"{visible_path}::{_fill(t, names)}" for t in family.visible_pass_to_pass]
        + [f"{hidden_path}::{_fill(t, names)}" for t in family.pass_to_pass],
        reference_patch=file_diff(module_path, buggy, fixed),
        protected_paths=catalog.protected_paths,
        test_command=catalog.test_command,
        hint=_fill(family.hint, {**names, "module_path": module_path}).strip(),
        module_path=module_path,
        example=_fill(family.example, names),
        fix_command=line_edit_command(module_path, buggy, fixed),
    )
    return Task(
        task_id=f"{KIND}-{seed}-{index:04d}-{family_name}",
        kind=KIND,
        prompt=_fill(family.statement, names).strip(),
        metadata=spec.model_dump(),
    )


def spec_of(task: Task) -> MiniSWESpec:
    return MiniSWESpec.model_validate(task.metadata)


def file_diff(path: str, old: str, new: str) -> str:
    """A git-style diff of one file (`old` empty: the file is new)."""
    header = f"diff --git a/{path} b/{path}\n"
    if not old:
        header += "new file mode 100644\n"
    lines = difflib.unified_diff(
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        fromfile=f"a/{path}" if old else "/dev/null",
        tofile=f"b/{path}",
    )
    return header + "".join(lines)


def line_edit_command(path: str, old: str, new: str) -> str:
    """A sed command that turns `old` into `new` (texts of `path`) where they differ in one
    place: the changed lines replaced by line number (`Ns|.*|text|`), or lines inserted
    before one (`Ni\\text`). Raises ValueError for any other difference."""
    old_lines, new_lines = old.splitlines(), new.splitlines()
    changes = [
        op
        for op in difflib.SequenceMatcher(a=old_lines, b=new_lines).get_opcodes()
        if op[0] != "equal"
    ]
    if len(changes) != 1:
        raise ValueError(f"{path}: {len(changes)} changed places; a line edit makes one")
    kind, start, end, new_start, new_end = changes[0]
    inserted = new_lines[new_start:new_end]
    if any("'" in line for line in inserted):
        raise ValueError(f"{path}: a line edit cannot write a single quote")
    if kind == "replace" and end - start == 1 and len(inserted) == 1:
        text = inserted[0].replace("\\", "\\\\").replace("&", "\\&").replace("|", "\\|")
        return f"sed -i '{start + 1}s|.*|{text}|' {shlex.quote(path)}"
    if kind == "insert" and start < len(old_lines):
        text = "\\n".join(line.replace("\\", "\\\\") for line in inserted)
        return f"sed -i '{start + 1}i\\{text}' {shlex.quote(path)}"
    raise ValueError(f"{path}: a {kind} of {end - start} lines is not a line edit")


def swebench_instance(task: Task) -> dict[str, Any]:
    """The task as a SWE-bench instance: its hidden tests are the test patch, its eval
    script runs them in the shape swebench's harness expects."""
    from swebench.utils import generate_heredoc_delimiter

    spec = spec_of(task)
    test_patch = "".join(file_diff(p, "", text) for p, text in spec.hidden_tests.items())
    eval_script = _fill(
        load_catalog().eval_script,
        {
            "repo_dir": shlex.quote(spec.repo_dir),
            "delimiter": generate_heredoc_delimiter(test_patch),
            "test_patch": test_patch,
            "test_command": spec.test_command,
        },
    )
    return {
        "instance_id": task.task_id,
        "repo": f"mini-swe/{spec.family}",
        "version": "1",
        "problem_statement": task.prompt,
        "patch": spec.reference_patch,
        "test_patch": test_patch,
        "FAIL_TO_PASS": spec.fail_to_pass,
        "PASS_TO_PASS": spec.pass_to_pass,
        "eval_script": eval_script,
        "log_parser": "parse_log_pytest",
        "eval_type": "pass_and_fail",
        "image": "local",
    }


async def materialize(task: Task, sandbox: Sandbox, timeout_s: float = 60.0) -> str:
    """Write the task's repository (without the hidden tests) into the sandbox and commit
    it; returns the base commit. Raises MaterializeError when git fails there."""
    spec = spec_of(task)
    for path, text in spec.files.items():
        await sandbox.write_file(f"{spec.repo_dir}/{path}", text.encode())
    result = await sandbox.exec(_INIT_REPO, timeout_s, cwd=spec.repo_dir, env=GIT_IDENTITY)
    if not result.ok:
        raise MaterializeError(
            f"could not create the git repository of {task.task_id} in the sandbox "
            f"(exit {result.exit_code}): {(result.stderr or result.stdout).strip()}"
        )
    return result.stdout.strip().splitlines()[-1]


VISIBLE_TESTS_COMMAND = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -qq tests"
"""How the worked script runs the visible tests: -qq leaves out the timing line, so the
observation is the same in every run; the interpreter's third-party plugins stay out, as
in the task's test_command."""


def worked_script(task: Task) -> list[Message]:
    """The turns of a careful engineer fixing `task`: list the files, read the module, run
    the visible tests, run the issue's example, apply the fix, run the example and the tests
    again, submit (traces for the SWE demo's models, `opd demo-models build --harness swe`)."""
    spec = spec_of(task)
    if spec.module_path is None or spec.example is None or spec.fix_command is None:
        raise ValueError(f"{task.task_id}: a task from before worked scripts (no example)")
    module = spec.module_path.removesuffix(".py").replace("/", ".")
    func = spec.example.partition("(")[0]
    example = f"python -c 'from {module} import {func}; print({spec.example})'"
    return [
        bash("git ls-files"),
        bash(f"cat -n {shlex.quote(spec.module_path)}"),
        bash(VISIBLE_TESTS_COMMAND),
        bash(example),
        bash(spec.fix_command),
        bash(example),
        bash(VISIBLE_TESTS_COMMAND),
        submit(),
    ]


class MiniSWETasks:
    """The mini-SWE tasks as the swe harness reads them (rollout.harness.swe.SWEBenchInstanceTasks,
    wrapped into a family by SWEBenchInstanceFamily)."""

    kind = KIND

    def repo_dir(self, task: Task) -> str:
        return spec_of(task).repo_dir

    async def prepare(self, task: Task, sandbox: Sandbox) -> None:
        await materialize(task, sandbox)

    def instance(self, task: Task) -> dict[str, Any]:
        return swebench_instance(task)

    def protected_paths(self, task: Task) -> list[str]:
        return spec_of(task).protected_paths
