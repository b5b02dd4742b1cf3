"""Model references, as configs and command lines name models: a local HF directory,
`factory:<preset>` (a small random-init model built and cached on first use), or
`bundled:student` / `bundled:teacher` (the demo's models shipped in this package,
re-created by `opd demo-models build`)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from slime_ext.models.factory import materialize

BUNDLED_PREFIX = "bundled:"
BUNDLED_MODELS = ("student", "teacher")
DEMO_CHECKPOINTS = "demo_checkpoints"
"""The bundled models' directory in this package."""


class ModelRefError(ValueError):
    """A model reference that names no model, with the ones it could name."""


def bundled_name_problem(name: str) -> str | None:
    """Why `bundled:<name>` names no bundled model; None for other names."""
    if not name.startswith(BUNDLED_PREFIX):
        return None
    if name.removeprefix(BUNDLED_PREFIX) in BUNDLED_MODELS:
        return None
    return f"{name!r}: bundled models are bundled:student and bundled:teacher"


def bundled_models() -> tuple[Path, Path]:
    """(student, teacher) directories shipped with the package (`opd demo-models build`)."""
    root = Path(str(resources.files(__package__).joinpath(DEMO_CHECKPOINTS)))
    student, teacher = root / "student", root / "teacher"
    for path in (student, teacher):
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is missing: run `opd demo-models build` first")
    return student, teacher


def resolve_model(name: str, cache_dir: Path, seed: int) -> Path:
    """A local HF directory for `bundled:student|teacher`, `factory:<preset>` (built under
    `cache_dir` with `seed`) or a path (returned as it is)."""
    if name.startswith(BUNDLED_PREFIX):
        if problem := bundled_name_problem(name):
            raise ModelRefError(problem)
        student, teacher = bundled_models()
        return student if name.removeprefix(BUNDLED_PREFIX) == "student" else teacher
    return materialize(name, cache_dir, seed=seed)
