"""Imports run one way (DESIGN.md, Layout): launch (CLI, plans) -> slime_ext (hooks,
embedded trainer) -> rollout -> sandbox, with teacher_server beside rollout; the job's
config and assembly (slime_ext.job) below everything that runs a job, and the code the
trainer and the teacher service share (slime_ext.models, turns, vocab_parallel, losses)
below both. Read from every module's import statements, function-level ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("launch", "slime_ext", "rollout", "sandbox", "teacher_server")
HOOKS_AND_TRAINER = ("slime_ext.slime", "slime_ext.local")
SHARED_MODEL_CODE = (
    "slime_ext.models",
    "slime_ext.turns",
    "slime_ext.vocab_parallel",
    "slime_ext.losses",
)

FORBIDDEN: dict[str, tuple[str, ...]] = {
    # layer (module prefix, most specific wins) -> what it may not import
    "slime_ext": ("launch",),
    "slime_ext.job": ("launch", *HOOKS_AND_TRAINER),
    **dict.fromkeys(SHARED_MODEL_CODE, ("launch", *HOOKS_AND_TRAINER, "slime_ext.job")),
    "teacher_server": ("launch", *HOOKS_AND_TRAINER, "slime_ext.job"),
    "rollout": ("launch", "slime_ext"),
    "sandbox": ("launch", "slime_ext", "rollout", "teacher_server"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _layer(module: str) -> str | None:
    matches = [prefix for prefix in FORBIDDEN if _within(module, prefix)]
    return max(matches, key=len) if matches else None


def _violations() -> list[str]:
    problems = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = _module_name(path)
            layer = _layer(module)
            if layer is None:
                continue
            for line, imported in _imports(path):
                for banned in FORBIDDEN[layer]:
                    if _within(imported, banned):
                        where = f"{path.relative_to(ROOT)}:{line}"
                        problems.append(f"{where}: {module} ({layer}) imports {imported}")
    return problems


def test_imports_run_one_way() -> None:
    assert _violations() == []


@pytest.mark.parametrize(
    ("module", "imported", "allowed"),
    [
        ("slime_ext.job.assembly", "slime_ext.local.loop", False),
        ("slime_ext.slime.generate", "slime_ext.job.config", True),
        ("teacher_server.cli", "slime_ext.local.factory", False),
        ("teacher_server.hf_backend", "slime_ext.turns", True),
        ("rollout.runner", "teacher_server.client", True),
        ("sandbox.fleet.fleet", "rollout.trajectory", False),
        ("slime_ext.models.refs", "slime_ext.job.config", False),
    ],
)
def test_the_rules_say_what_they_mean(module: str, imported: str, allowed: bool) -> None:
    """The rules themselves, on the imports issue 25 found and the ones that must stay."""
    layer = _layer(module)
    assert layer is not None
    assert (not any(_within(imported, banned) for banned in FORBIDDEN[layer])) is allowed
