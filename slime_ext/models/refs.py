"""Model references, as configs and command lines name models: a local HF directory,
`factory:<preset>` (a small random-init model built and cached on first use), or
`bundled:student` / `bundled:teacher` (the math demo's models shipped in this package,
re-created by `opd demo-models build`) or `bundled:swe-student` / `bundled:swe-teacher`
(the SWE demo's, `opd demo-models build --harness swe`)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from slime_ext.models.factory import materialize

BUNDLED_PREFIX = "bundled:"
BUNDLED_MODELS = ("student", "teacher", "swe-student", "swe-teacher")
DEMO_CHECKPOINTS = "demo_checkpoints"
"""The bundled models' directory in this package: student/ and teacher/ (math TIR), and
swe/student/ and swe/teacher/."""
DEMO_HARNESS_DIRS = {"tir": ".", "swe": "swe"}


class ModelRefError(ValueError):
    """A model reference that names no model, with the ones it could name."""


def bundled_name_problem(name: str) -> str | None:
    """Why `bundled:<name>` names no bundled model; None for other names."""
    if not name.startswith(BUNDLED_PREFIX):
        return None
    if name.removeprefix(BUNDLED_PREFIX) in BUNDLED_MODELS:
        return None
    names = ", ".join(BUNDLED_PREFIX + model for model in BUNDLED_MODELS)
    return f"{name!r}: bundled models are {names}"


def bundled_dir(harness: str = "tir") -> Path:
    """Where a demo's bundled models live in this package."""
    root = Path(str(resources.files(__package__).joinpath(DEMO_CHECKPOINTS)))
    return (root / DEMO_HARNESS_DIRS[harness]).resolve()


def bundled_models(harness: str = "tir") -> tuple[Path, Path]:
    """(student, teacher) directories of a demo's models shipped with the package (`opd
    demo-models build [--harness swe]`)."""
    root = bundled_dir(harness)
    student, teacher = root / "student", root / "teacher"
    for path in (student, teacher):
        if not (path / "config.json").is_file():
            flag = "" if harness == "tir" else f" --harness {harness}"
            raise FileNotFoundError(f"{path} is missing: run `opd demo-models build{flag}` first")
    return student, teacher


def resolve_model(name: str, cache_dir: Path, seed: int) -> Path:
    """A local HF directory for `bundled:student|teacher`, `factory:<preset>` (built under
    `cache_dir` with `seed`) or a path (returned as it is)."""
    if name.startswith(BUNDLED_PREFIX):
        if problem := bundled_name_problem(name):
            raise ModelRefError(problem)
        harness, _, role = name.removeprefix(BUNDLED_PREFIX).rpartition("-")
        student, teacher = bundled_models(harness or "tir")
        return student if role == "student" else teacher
    return materialize(name, cache_dir, seed=seed)
