"""Prompt files of the harnesses (YAML), and the one reader of them."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml


def read_prompts(name: str, path: Path | None = None) -> dict[str, Any]:
    """The prompts in `path`, or the packaged `<name>.yaml`."""
    source = path or resources.files(__name__).joinpath(f"{name}.yaml")
    prompts: dict[str, Any] = yaml.safe_load(source.read_text("utf-8"))
    return prompts
