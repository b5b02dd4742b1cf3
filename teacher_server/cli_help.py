"""How our commands' --help reads: shared by `opd-teacher` and `opd` (which sits above the
service and imports it from here)."""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperOption


def hide_flag_types() -> None:
    """typer (0.2x with click 8.2+) prints a type beside every option, so a flag that takes
    no value reads `--dry-run <bool>` as if it wanted one; flags get no type column."""
    original = TyperOption.display_type_rich
    if getattr(original, "hides_flag_types", False):
        return

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else original(self, ctx)

    display_type_rich.hides_flag_types = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


def version_option(program: str) -> Any:
    """The eager `--version` option of a command group: prints `program` and the package's
    version, then exits."""

    def show(asked: bool) -> None:
        if asked:
            from importlib.metadata import version

            typer.echo(f"{program} {version('opd')}")
            raise typer.Exit()

    return typer.Option(
        "--version", callback=show, is_eager=True, help="Print the version and exit."
    )
