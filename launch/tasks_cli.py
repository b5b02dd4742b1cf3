"""`opd tasks`: a cluster job's tasks file (cluster.tasks_file) from what users have.

opd tasks write --harness swe verified=swebench_verified.parquet --out tasks.jsonl
opd tasks write --harness swe mini_swe:2000 --out mini.jsonl
opd tasks write --harness tir math.jsonl --out math-tasks.jsonl
opd tasks check tasks.jsonl --harness swe
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.markup import escape

from launch.tasks_file import TasksFileError, check, load_tasks, write_tasks_file
from rollout.evaluation.datasets import named

console = Console()
err_console = Console(stderr=True)

tasks_app = typer.Typer(
    help="Write and check a cluster job's tasks file (cluster.tasks_file: slime's prompt data).",
    no_args_is_help=True,
)

Harness = Annotated[Literal["swe", "tir"], typer.Option(help="The job's rollout.harness.")]


def _fail(message: str) -> typer.Exit:
    err_console.print(f"[red]error[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code=2)


@tasks_app.command("write")
def write(
    sources: Annotated[
        list[str],
        typer.Argument(
            help="swe: SWE-bench / SWE-bench Pro / generic rows (.jsonl, .json, .parquet; as "
            "`opd eval swe` reads them) or mini_swe:N; tir: a math dataset file (as `opd eval "
            "math` reads it) or arithmetic:N. A `name=` prefix is allowed and ignored. "
            "Several sources are concatenated."
        ),
    ],
    out: Annotated[Path, typer.Option(help="The tasks file to write (JSONL).")],
    harness: Harness = "swe",
    kind: Annotated[
        Literal["auto", "swebench", "swebench_pro", "generic"],
        typer.Option(help="swe: the rows' format (auto: from each row's fields)."),
    ] = "auto",
    seed: Annotated[int, typer.Option(help="mini_swe:N and arithmetic:N: the draw.")] = 0,
    limit: Annotated[int | None, typer.Option(min=1, help="Keep the first N tasks.")] = None,
) -> None:
    """Write slime's prompt data for a cluster job: one row per task, the whole task in its
    metadata (the hooks rebuild it from there). Refuses a source it cannot read, naming
    the row and the field, and a task id that appears twice; writes nothing then."""
    if out.suffix.lower() != ".jsonl":
        raise _fail(f"--out {out}: write a .jsonl file (slime's --prompt-data rows)")
    tasks = []
    seen: dict[str, str] = {}
    try:
        for spec in sources:
            _, source = named(spec)  # `opd eval`'s `name=source`
            for task in load_tasks(source, harness, seed, kind):
                if task.task_id in seen:
                    raise TasksFileError(
                        f"task {task.task_id!r} is in {seen[task.task_id]} and in {source}"
                    )
                seen[task.task_id] = source
                tasks.append(task)
        if limit is not None:
            tasks = tasks[:limit]
        written = write_tasks_file(tasks, out)
        rows = check(out, harness, "opd")  # what validate will read back
    except (TasksFileError, OSError) as err:
        raise _fail(str(err)) from None
    kinds = sorted({task.kind for task in tasks})
    console.print(
        f"wrote {written} tasks ({', '.join(kinds)}) to {out}; set cluster.tasks_file: {out} "
        f"(`opd config validate` reads it back: {rows} rows)",
        highlight=False,
        soft_wrap=True,
    )


@tasks_app.command("check")
def check_file(
    path: Annotated[Path, typer.Argument(help="A tasks file (cluster.tasks_file).")],
    harness: Harness = "swe",
    recipe: Annotated[
        str, typer.Option(help="The job's algorithm.recipe (sft, ssd: turn records).")
    ] = "opd",
) -> None:
    """Check a tasks file as `opd config validate` does: every row counted, the first rows
    parsed; exit 2 naming the row and the field."""
    try:
        rows = check(path, harness, recipe)
    except TasksFileError as err:
        raise _fail(str(err)) from None
    except OSError as err:
        raise _fail(f"{path}: {err.strerror}") from None
    console.print(f"ok: {path}: {rows} rows for the {harness} harness", highlight=False)
