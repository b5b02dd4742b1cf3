"""Every `opd` and `opd-teacher` command the READMEs and docs show parses as written: its
subcommand exists and takes the options and arguments given. Each command's work is
replaced by a no-op (their own tests run them); the parsing and the option checks are
click's own."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.testing
from typer.testing import CliRunner

from launch.cli import app as opd
from teacher_server.cli import app as opd_teacher

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "launch/README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = {"opd": opd, "opd-teacher": opd_teacher}
SHELL_BREAKS = ("|", "||", "&&", ";", ">", ">>", "2>&1", "&")


def _shown_commands() -> list[tuple[str, int, list[str]]]:
    """(file, line, argv) for each indented command line of an opd program, with its
    continuation lines, cut at comments and shell operators."""
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        number = 0
        while number < len(lines):
            line = lines[number]
            start = number
            while line.endswith("\\") and number + 1 < len(lines):
                number += 1
                line = line[:-1] + " " + lines[number].strip()
            number += 1
            if not line.startswith("    "):
                continue
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            if not words:
                continue
            program = words[0].removeprefix(".venv/bin/")
            if program not in PROGRAMS:
                continue
            argv = []
            for word in words[1:]:
                if word in SHELL_BREAKS:
                    break
                argv.append(word)
            found.append((f"{doc.relative_to(ROOT)}:{start + 1}", start, [program, *argv]))
    return found


COMMANDS = _shown_commands()


def _no_op(command: Any) -> Any:
    """The command tree with every command's work replaced by a no-op."""
    for sub in getattr(command, "commands", {}).values():
        _no_op(sub)
    if not hasattr(command, "commands"):
        command.callback = lambda **_: None
    return command


def test_the_docs_show_commands_of_every_program() -> None:
    shown = {argv[0] for _, _, argv in COMMANDS}
    assert shown == set(PROGRAMS) and len(COMMANDS) >= 20, COMMANDS


@pytest.mark.parametrize(("where", "line", "argv"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_documented_command_parses(
    where: str, line: int, argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if any(re.fullmatch(r"<[^>]+>|\.\.\.", word) for word in argv):
        argv = [w for w in argv if w != "..."]
        argv = [("x" if re.fullmatch(r"<[^>]+>", w) else w) for w in argv]
    command = _no_op(typer.main.get_command(PROGRAMS[argv[0]]))
    # typer's runner builds the command from the app: it gets the no-op tree instead
    monkeypatch.setattr(typer.testing, "_get_command", lambda _: command)
    result = CliRunner().invoke(PROGRAMS[argv[0]], argv[1:], prog_name=argv[0])
    assert result.exit_code == 0, f"{where}: {shlex.join(argv)}\n{result.output}"


@pytest.mark.parametrize(
    "argv",
    [
        ["opd", "eval", "swe", "--policy", "p", "--dataset", "d", "--step-limt", "4"],
        ["opd", "no-such-command"],
        ["opd-teacher", "serve"],  # --model is required
    ],
)
def test_the_check_fails_a_command_that_does_not_parse(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    command = _no_op(typer.main.get_command(PROGRAMS[argv[0]]))
    monkeypatch.setattr(typer.testing, "_get_command", lambda _: command)
    assert CliRunner().invoke(PROGRAMS[argv[0]], argv[1:], prog_name=argv[0]).exit_code != 0
