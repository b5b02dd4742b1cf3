"""What every command's --help and --version print, for `opd` and `opd-teacher`."""

from __future__ import annotations

import re
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from launch.cli import app as opd
from teacher_server.cli import app as opd_teacher


def _commands(app: typer.Typer) -> list[list[str]]:
    """Every command path of `app`, as argv prefixes ([] is the root)."""
    root = typer.main.get_command(app)
    found: list[list[str]] = []

    def walk(command: Any, path: list[str]) -> None:
        found.append(path)
        for name, sub in getattr(command, "commands", {}).items():  # a group's
            walk(sub, [*path, name])

    walk(root, [])
    return found


@pytest.mark.parametrize(
    ("app", "path"),
    [(opd, path) for path in _commands(opd)] + [(opd_teacher, p) for p in _commands(opd_teacher)],
)
def test_flags_show_no_value_type(app: typer.Typer, path: list[str]) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output
    assert "--help" in result.output


@pytest.mark.parametrize(("app", "name"), [(opd, "opd"), (opd_teacher, "opd-teacher")])
def test_version(app: typer.Typer, name: str) -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert re.fullmatch(rf"{name} \d+\.\d+\.\d+\S*\n", result.output)
