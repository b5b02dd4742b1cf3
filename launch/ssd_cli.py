"""`opd ssd`: self-sample trajectories at a truncated temperature, export them as SFT data.

opd ssd sample --policy bundled:student --tasks arithmetic:200 -n 4 --out runs/ssd/t.jsonl
opd ssd export --trajectories runs/ssd/t.jsonl --out runs/ssd/sft.parquet
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.table import Table

from launch.policies import open_policy, resolve_policy
from rollout.chat import ChatRenderer
from rollout.runner import Runner
from rollout.trajectory import TrajectoryFormatError, read_jsonl
from slime_ext.job.assembly import harness_for, runner_config
from slime_ext.job.config import config_from_dict
from slime_ext.job.sandboxes import JobSandboxes, run_owner
from slime_ext.ssd import (
    ExportSummary,
    SampleSummary,
    SSDInputError,
    done_samples,
    export_records,
    load_tasks,
    pending_samples,
    resume_seed,
    sample_trajectories,
    summarize_trajectories,
    write_summary,
)

console = Console()
err_console = Console(stderr=True)

ssd_app = typer.Typer(
    help="Self-distillation: sample the student's own trajectories, export them as SFT data.",
    no_args_is_help=True,
)


def _fail(message: str) -> typer.Exit:
    err_console.print(f"[red]error[/red] {message}", highlight=False)
    return typer.Exit(code=2)


@ssd_app.command("sample")
def sample(
    policy: Annotated[
        str,
        typer.Option(
            help="A local HF directory, factory:<preset>, bundled:student (run here on CPU), "
            "or an SGLang server URL (http://host:port)."
        ),
    ],
    tasks: Annotated[
        str,
        typer.Option(
            help="A JSONL file of Task rows, arithmetic:N (synthetic TIR) or mini_swe:N (SWE)."
        ),
    ],
    out: Annotated[Path, typer.Option(help="Trajectories JSONL; appended to, and resumed from.")],
    samples_per_task: Annotated[
        int, typer.Option("--samples-per-task", "-n", min=1, help="Trajectories per task.")
    ] = 4,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (> 0).")] = 1.1,
    top_k: Annotated[int, typer.Option(min=-1, help="-1: off.")] = 10,
    top_p: Annotated[float, typer.Option(help="Nucleus truncation, in (0, 1].")] = 0.95,
    harness: Annotated[Literal["tir", "swe"], typer.Option(help="Agent harness.")] = "tir",
    tokenizer: Annotated[
        str | None,
        typer.Option(help="The policy's tokenizer (HF dir / factory:); needed with a URL."),
    ] = None,
    think_policy: Annotated[Literal["drop", "keep"], typer.Option()] = "drop",
    tool_call_format: Annotated[Literal["hermes", "qwen3_coder"], typer.Option()] = "hermes",
    max_turns: Annotated[int, typer.Option(min=1, help="Turns per trajectory.")] = 16,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Generation per turn.")] = 512,
    max_context_tokens: Annotated[int, typer.Option(min=16)] = 4096,
    concurrency: Annotated[int, typer.Option(min=1, help="Trajectories in flight.")] = 8,
    trajectory_timeout_s: Annotated[
        float, typer.Option(help="Wall-clock limit of one trajectory.")
    ] = 600.0,
    command_timeout_s: Annotated[
        float, typer.Option(help="Deadline of one shell command (swe).")
    ] = 30.0,
    seed: Annotated[int, typer.Option(help="Task draw, factory weights, HF sampler.")] = 0,
    models_dir: Annotated[
        Path | None,
        typer.Option(help="Where factory:<preset> models are built (default: next to --out)."),
    ] = None,
) -> None:
    """Sample N trajectories per task with the student itself (temperature + top-k/top-p
    truncation) and keep every one, positive or negative; print and write a summary
    (<out>.summary.json). Re-running resumes: samples already in --out are skipped."""
    try:
        job = config_from_dict(
            {
                "algorithm": {"recipe": "ssd"},
                "rollout": {
                    "harness": harness,
                    "think_policy": think_policy,
                    "tool_call_format": tool_call_format,
                    "max_turns": max_turns,
                    "max_new_tokens": max_new_tokens,
                    "max_context_tokens": max_context_tokens,
                    "temperature": temperature,
                    "top_k": top_k,
                    "top_p": top_p,
                    "samples_per_task": samples_per_task,
                    "concurrency": concurrency,
                    "trajectory_timeout_s": trajectory_timeout_s,
                },
                "sandbox": {"command_timeout_s": command_timeout_s},
                "model": {"seed": seed},
            },
            source="ssd sample options",
        )
        task_list = load_tasks(tasks, seed=seed)
        done = done_samples(out)
        sandboxes = None
        if harness == "swe":
            sandboxes = JobSandboxes.of_job(job, run_owner(out, prefix="opd-ssd"))
        agent = harness_for(job, sandboxes)
        for task in task_list:  # a task the harness cannot start fails here, not mid-run
            agent.initial_messages(task)
        source = resolve_policy(policy, tokenizer, models_dir or out.parent / "models", seed)
    # pydantic's ValidationError, SSDInputError, PolicySpecError, UnsupportedLocalJob and
    # TrajectoryFormatError are ValueErrors; the swe harness's unknown task kind a KeyError
    except (ValueError, KeyError, FileNotFoundError) as err:
        raise _fail(str(err)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    jobs = pending_samples(task_list, samples_per_task, done)
    skipped = len(task_list) * samples_per_task - len(jobs)
    if skipped:
        console.print(
            f"resuming {out}: {skipped} of {len(task_list) * samples_per_task} samples are "
            "already there",
            highlight=False,
            soft_wrap=True,
        )

    async def run() -> None:
        sampler_seed = resume_seed(seed, len(done))
        async with (
            open_policy(source, sampler_seed, concurrency) as (backend, hf_tokenizer),
            sandboxes or contextlib.nullcontext(),
        ):
            renderer = ChatRenderer(
                hf_tokenizer,
                agent.tools,
                think_policy=think_policy,
                tool_call_format=tool_call_format,
            )
            runner = Runner(agent, backend, renderer, runner_config(job))
            await sample_trajectories(runner, jobs, out, console=console)

    if jobs:
        asyncio.run(run())
    summary = summarize_trajectories(read_jsonl(out)) if out.is_file() else SampleSummary()
    summary.sampled_this_run = len(jobs)
    summary.skipped_done = skipped
    summary.sampling = {
        "policy": policy,
        "tasks": tasks,
        "harness": harness,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "samples_per_task": samples_per_task,
        "max_turns": max_turns,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
    }
    path = write_summary(out, summary)
    _print_sample_summary(summary)
    console.print(f"wrote {out} and {path}", highlight=False)


@ssd_app.command("export")
def export(
    trajectories: Annotated[
        list[Path], typer.Option(help="Trajectories JSONL from `opd ssd sample` (repeatable).")
    ],
    out: Annotated[Path, typer.Option(help="SFT records: .parquet (or .jsonl).")],
    mask_invalid_turns: Annotated[
        bool,
        typer.Option(
            help="Leave tier-1/2 turns (no valid action, shell syntax errors) out of the loss; "
            "--no-mask-invalid-turns trains on them too (the masking ablation)."
        ),
    ] = True,
) -> None:
    """Write per-turn SFT records (context + span ids, loss on the span only, tier-1/2
    turns masked) of the completed and truncated trajectories; identical records once;
    print and write a summary (<out>.summary.json)."""
    for path in trajectories:
        if not path.is_file():
            raise _fail(f"{path} does not exist")
    try:
        summary = export_records(trajectories, out, mask_invalid_turns)
    except (SSDInputError, TrajectoryFormatError) as err:
        raise _fail(str(err)) from None
    path = write_summary(out, summary)
    _print_export_summary(summary)
    console.print(f"wrote {out} and {path}", highlight=False)


def _print_sample_summary(summary: SampleSummary) -> None:
    table = Table(title="ssd sample", show_header=False)
    total = max(summary.trajectories, 1)
    table.add_row("trajectories", f"{summary.trajectories} over {summary.tasks} tasks")
    table.add_row("statuses", _counts(summary.statuses))
    table.add_row(
        "positive (reward > 0)",
        f"{summary.positives} ({summary.positive_share:.1%}); negative {summary.negatives}, "
        f"no reward {summary.unrewarded} ({(summary.unrewarded / total):.1%})",
    )
    table.add_row("turns per tier", f"{_counts(summary.turns_per_tier)} of {summary.turns}")
    table.add_row("masked share", f"{summary.masked_share:.2%}")
    tokens = summary.tokens
    table.add_row(
        "tokens",
        f"span {tokens.span} (think {tokens.think}, action {tokens.action}), "
        f"observation {tokens.observation}, trunk {tokens.trunk}",
    )
    table.add_row("this run", f"sampled {summary.sampled_this_run}, skipped {summary.skipped_done}")
    console.print(table)


def _print_export_summary(summary: ExportSummary) -> None:
    table = Table(title="ssd export", show_header=False)
    table.add_row("records", f"{summary.records} of {summary.trajectories} trajectories")
    table.add_row("skipped trajectories", _counts(summary.skipped) or "none")
    table.add_row("duplicates dropped", str(summary.duplicates_dropped))
    table.add_row("turns per tier", _counts(summary.turns_per_tier))
    if summary.mask_invalid:
        masked = f"{summary.masked_share:.2%} ({summary.masked_turns} turns)"
    else:
        masked = f"none: {summary.masked_turns} tier-1/2 turns kept in the loss"
    table.add_row("masked share", masked)
    table.add_row(
        "tokens",
        f"loss {summary.loss_tokens} of {summary.response_tokens} span tokens; "
        f"{summary.tokens_total} in all",
    )
    console.print(table)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {count}" for name, count in counts.items())
