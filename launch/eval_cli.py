"""`opd eval swe|math`, `opd compare`, `opd sweep temperature`.

opd eval math --policy bundled:student --dataset heldout.jsonl -k 4 --out runs/eval/math
opd eval swe --policy http://sglang:30000 --tokenizer /models/Qwen3.5-9B \\
    --dataset verified=swebench_verified.parquet --dataset pro=swebench_pro.parquet \\
    --out runs/eval/opd-i38
opd eval swe --policy gold --dataset verified=swebench_verified.parquet --out runs/eval/gold
opd compare runs/eval/base runs/eval/opd-i38 --out runs/eval/base-vs-opd
opd sweep temperature --values 0.7,0.9,1.1 --policy ... --dataset verified.jsonl -n 100 \\
    --top-k 10 --out runs/sweep
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from launch.eval_report import (
    NOT_GRADED,
    WandbMode,
    log_to_wandb,
    markdown_table,
    nothing_graded,
    rate_cells,
    settings_markdown,
    write_report,
)
from launch.evaluation import EvalOutcome, EvalSettings, RunOptions, run_evaluation
from launch.sweep import sweep_plot, sweep_table
from rollout.evaluation.compare import compare_runs, comparison_markdown
from rollout.evaluation.datasets import DatasetError
from rollout.evaluation.outcomes import load_run
from rollout.evaluation.records import EvalResultsError

console = Console()
err_console = Console(stderr=True)

eval_app = typer.Typer(help="Evaluate a policy on SWE or math benchmarks.", no_args_is_help=True)
sweep_app = typer.Typer(help="Sweep a sampling setting over evaluations.", no_args_is_help=True)

PolicyOpt = Annotated[
    str,
    typer.Option(
        help="An SGLang server URL (http://host:port), a local HF directory, factory:<preset> "
        "or bundled:student (run here). SWE also: gold (apply the dataset's patch), empty "
        "(submit no change: nothing may resolve) or replay:FILE (scripted actions, JSONL)."
    ),
]
DatasetOpt = Annotated[
    list[str],
    typer.Option(
        help="A benchmark file (JSONL / JSON / parquet), as name=path or path (named by its "
        "stem); repeatable. SWE: also mini_swe:N."
    ),
]
OutOpt = Annotated[Path, typer.Option(help="Run directory: results, reports; resumed from.")]
TokenizerOpt = Annotated[
    str | None, typer.Option(help="The policy's tokenizer (HF directory); needed with a URL.")
]
LimitOpt = Annotated[
    int | None, typer.Option("--limit", "-n", min=1, help="The first N instances of each.")
]
TemperatureOpt = Annotated[float, typer.Option(min=0.0, help="Sampling temperature (0: greedy).")]
TopKOpt = Annotated[int, typer.Option(min=-1, help="-1: off.")]
TopPOpt = Annotated[float, typer.Option(help="Nucleus truncation, in (0, 1].")]
ConcurrencyOpt = Annotated[int, typer.Option(min=1, help="Trajectories in flight.")]
WandbModeOpt = Annotated[
    str, typer.Option(help="offline (default; no key needed), online or disabled.")
]
WandbProjectOpt = Annotated[str, typer.Option(help="W&B project of the report run.")]


def _fail(message: str) -> typer.Exit:
    err_console.print(f"[red]error[/red] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code=2)


def _wandb_mode(value: str) -> WandbMode:
    if value not in ("offline", "online", "disabled"):
        raise _fail(f"--wandb-mode {value!r}: use offline, online or disabled")
    return value  # type: ignore[return-value]


def _run(settings: EvalSettings, options: RunOptions) -> EvalOutcome:
    try:
        outcome = run_evaluation(settings, options)
    # DatasetError, EvalResultsError, the policy's spec errors and pydantic's are ValueErrors
    except (ValueError, KeyError, FileNotFoundError) as err:
        raise _fail(str(err)) from None
    _print_scores(outcome)
    return outcome


def _exit_if_ungraded(outcomes: list[EvalOutcome]) -> None:
    """Exit 1, saying why, when some benchmark had nothing graded (its rates are n/a)."""
    lines = [
        f"nothing could be graded in {benchmark} ({NOT_GRADED}): " + "; ".join(why)
        for outcome in outcomes
        for benchmark, why in outcome.ungraded.items()
    ]
    if lines:
        for line in lines:
            err_console.print(f"[red]error[/red] {line}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=1)


def _print_scores(outcome: EvalOutcome) -> None:
    settings = outcome.settings
    k = settings.samples
    metric = "pass@1" if settings.kind == "swe" else f"avg@{k}"
    table = Table(title=f"opd eval {settings.kind}")
    columns = ["benchmark", "n", f"{metric} [95% CI]", "net"]
    columns += [f"pass@{k}"] if k > 1 else []
    columns += ["tool use"] if settings.kind == "math" else []
    columns += ["turns", "aborts", "timeouts"]
    for column in columns:
        table.add_column(column, overflow="fold")
    for s in outcome.scores:
        rate, interval, net, _ = rate_cells(s)
        row = [
            s.benchmark,
            str(s.problems),
            rate if nothing_graded(s) else f"{rate} {interval}",
            net,
        ]
        row += [NOT_GRADED if nothing_graded(s) else f"{s.pass_at_k:.1%}"] if k > 1 else []
        row += [f"{s.tool_use_frac:.0%}"] if settings.kind == "math" else []
        row += [f"{s.avg_turns:.1f}", str(s.aborts), str(s.timeouts)]
        table.add_row(*row)
    console.print(table)
    console.print(
        f"ran {outcome.ran} trajectories ({outcome.resumed} already done); wrote "
        + ", ".join(str(p) for p in outcome.reports),
        highlight=False,
        soft_wrap=True,
    )


@eval_app.command("swe")
def eval_swe(
    policy: PolicyOpt,
    dataset: DatasetOpt,
    out: OutOpt,
    tokenizer: TokenizerOpt = None,
    kind: Annotated[
        str, typer.Option(help="Row schema: auto, swebench, swebench_pro or generic.")
    ] = "auto",
    limit: LimitOpt = None,
    temperature: TemperatureOpt = 1.0,
    top_k: TopKOpt = -1,
    top_p: TopPOpt = 1.0,
    max_turns: Annotated[
        int,
        typer.Option(
            "--max-turns",
            "--step-limit",
            min=1,
            help="Turns before an unsubmitted end (rollout.max_turns; --step-limit: its old name).",
        ),
    ] = 100,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 4096,
    max_context_tokens: Annotated[int, typer.Option(min=16)] = 32768,
    trajectory_timeout_s: Annotated[float, typer.Option(min=1.0)] = 3600.0,
    command_timeout_s: Annotated[float, typer.Option(min=1.0)] = 60.0,
    eval_timeout_s: Annotated[float, typer.Option(min=1.0, help="Grading limit.")] = 1800.0,
    sandbox: Annotated[
        str | None,
        typer.Option(help="local or docker (default: docker when instances name images)."),
    ] = None,
    max_sandboxes: Annotated[int, typer.Option(min=1)] = 16,
    fleet: Annotated[
        Path | None, typer.Option(help="A fleet YAML ({config: ..., hosts: [...]}).")
    ] = None,
    concurrency: ConcurrencyOpt = 8,
    think_policy: Annotated[str, typer.Option(help="drop or keep.")] = "drop",
    tool_call_format: Annotated[str, typer.Option(help="hermes or qwen3_coder.")] = "hermes",
    model_name: Annotated[
        str | None, typer.Option(help="model_name_or_path in the predictions.")
    ] = None,
    seed: int = 0,
    wandb_mode: WandbModeOpt = "offline",
    wandb_project: WandbProjectOpt = "opd-eval",
) -> None:
    """Run the policy over SWE-bench (Verified, Lite), SWE-bench Pro or generic instances with
    the minimal harness and the sandbox fleet; grade each submission (swebench's grading,
    Pro's run scripts), write predictions in swebench's format and the report: pass rate,
    net pass rate (infrastructure aborts excluded), average turns, aborts, Wilson 95%
    intervals; each instance's test log and per-test statuses under <out>/instances/.
    --policy gold / empty / replay:FILE check a benchmark's images and tests without a
    model. Re-running resumes. Exit status 1 when a benchmark had nothing graded (n/a)."""
    try:
        settings = EvalSettings(
            kind="swe",
            policy=policy,
            tokenizer=tokenizer,
            datasets=dataset,
            swe_kind=kind,  # type: ignore[arg-type]
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_turns=max_turns,
            max_new_tokens=max_new_tokens,
            max_context_tokens=max_context_tokens,
            trajectory_timeout_s=trajectory_timeout_s,
            command_timeout_s=command_timeout_s,
            eval_timeout_s=eval_timeout_s,
            think_policy=think_policy,  # type: ignore[arg-type]
            tool_call_format=tool_call_format,  # type: ignore[arg-type]
            seed=seed,
        )
        options = RunOptions(
            out_dir=out,
            limit=limit,
            concurrency=concurrency,
            sandbox=sandbox,  # type: ignore[arg-type]
            max_sandboxes=max_sandboxes,
            fleet_file=fleet,
            model_name=model_name,
            wandb_mode=_wandb_mode(wandb_mode),
            wandb_project=wandb_project,
        )
    except ValueError as err:
        raise _fail(str(err)) from None
    _exit_if_ungraded([_run(settings, options)])


@eval_app.command("math")
def eval_math(
    policy: PolicyOpt,
    dataset: DatasetOpt,
    out: OutOpt,
    samples: Annotated[
        int, typer.Option("-k", "--samples", min=1, help="Samples per problem.")
    ] = 1,
    tokenizer: TokenizerOpt = None,
    mode: Annotated[str, typer.Option(help="tir (python tool) or reasoning (no tool).")] = "tir",
    limit: LimitOpt = None,
    temperature: TemperatureOpt = 1.0,
    top_k: TopKOpt = -1,
    top_p: TopPOpt = 1.0,
    max_turns: Annotated[
        int,
        typer.Option(
            "--max-turns",
            "--max-tool-calls",
            min=1,
            help="Tool calls before the answer is due (rollout.max_turns; --max-tool-calls: "
            "its old name).",
        ),
    ] = 16,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 2048,
    max_context_tokens: Annotated[int, typer.Option(min=16)] = 16384,
    trajectory_timeout_s: Annotated[float, typer.Option(min=1.0)] = 600.0,
    concurrency: ConcurrencyOpt = 8,
    think_policy: Annotated[str, typer.Option(help="drop or keep.")] = "drop",
    tool_call_format: Annotated[str, typer.Option(help="hermes or qwen3_coder.")] = "hermes",
    seed: int = 0,
    wandb_mode: WandbModeOpt = "offline",
    wandb_project: WandbProjectOpt = "opd-eval",
) -> None:
    """avg@k and pass@k over JSONL/parquet problems with reference answers (math-verify
    grading), per dataset and averaged, with the share of samples that called the tool.
    Re-running resumes."""
    if mode not in ("tir", "reasoning"):
        raise _fail(f"--mode {mode!r}: use tir or reasoning")
    try:
        settings = EvalSettings(
            kind="math",
            policy=policy,
            tokenizer=tokenizer,
            datasets=dataset,
            samples=samples,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_turns=max_turns,
            tools=mode == "tir",
            max_new_tokens=max_new_tokens,
            max_context_tokens=max_context_tokens,
            trajectory_timeout_s=trajectory_timeout_s,
            think_policy=think_policy,  # type: ignore[arg-type]
            tool_call_format=tool_call_format,  # type: ignore[arg-type]
            seed=seed,
        )
        options = RunOptions(
            out_dir=out,
            limit=limit,
            concurrency=concurrency,
            wandb_mode=_wandb_mode(wandb_mode),
            wandb_project=wandb_project,
        )
    except ValueError as err:
        raise _fail(str(err)) from None
    _exit_if_ungraded([_run(settings, options)])


def compare(
    run_a: Annotated[
        str,
        typer.Argument(
            help="Run A: opd eval's --out directory, or a swebench harness report "
            "(benchmark=report.json)."
        ),
    ],
    run_b: Annotated[str, typer.Argument(help="Run B, the same way.")],
    out: Annotated[
        Path | None, typer.Option(help="Where the comparison report goes (default: print only).")
    ] = None,
    wandb_mode: WandbModeOpt = "offline",
    wandb_project: WandbProjectOpt = "opd-eval",
) -> None:
    """Paired per-instance comparison of two evaluation runs: solved by both, only A, only
    B, neither; exact McNemar per benchmark and combined; the net per-instance gain; and a
    check that each run's headline difference equals only A - only B (runs whose instance
    sets or counts disagree are flagged). Exit status 1 when they do not reconcile."""
    try:
        comparison = compare_runs(load_run(run_a), load_run(run_b))
    except (EvalResultsError, DatasetError, FileNotFoundError) as err:
        raise _fail(str(err)) from None
    text = comparison_markdown(comparison)
    console.print(text, highlight=False, soft_wrap=True)
    if out is not None:
        rows = [
            [
                c.benchmark,
                c.paired.n,
                c.paired.both,
                c.paired.only_a,
                c.paired.only_b,
                c.paired.neither,
                c.paired.net,
                f"{c.paired.mcnemar_p:.4g}",
                c.reconciles,
            ]
            for c in comparison.benchmarks
        ]
        columns = ["benchmark", "n", "both", "only A", "only B", "neither", "net", "McNemar p"]
        table = ([*columns, "reconciles"], rows)
        paths = write_report(
            out,
            f"{comparison.name_a} vs {comparison.name_b}",
            [("Comparison", text)],
            comparison,
        )
        log_to_wandb(
            _wandb_mode(wandb_mode),
            wandb_project,
            f"compare-{out.name}",
            out,
            {"eval/comparison": table},
            {"run_a": run_a, "run_b": run_b},
        )
        console.print("wrote " + ", ".join(str(p) for p in paths), highlight=False)
    if not comparison.reconciles:
        raise typer.Exit(code=1)


@sweep_app.command("temperature")
def sweep_temperature(
    values: Annotated[str, typer.Option(help="Comma-separated temperatures, e.g. 0.7,0.8,1.0.")],
    policy: PolicyOpt,
    dataset: DatasetOpt,
    out: OutOpt,
    task: Annotated[str, typer.Option(help="swe or math.")] = "swe",
    limit: LimitOpt = None,
    top_k: TopKOpt = 10,
    top_p: TopPOpt = 1.0,
    tokenizer: TokenizerOpt = None,
    max_turns: Annotated[int, typer.Option(min=1, help="SWE step limit / math tool calls.")] = 100,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 4096,
    max_context_tokens: Annotated[int, typer.Option(min=16)] = 32768,
    trajectory_timeout_s: Annotated[float, typer.Option(min=1.0)] = 3600.0,
    sandbox: Annotated[str | None, typer.Option(help="SWE: local or docker.")] = None,
    fleet: Annotated[Path | None, typer.Option(help="SWE: a fleet YAML.")] = None,
    concurrency: ConcurrencyOpt = 8,
    seed: int = 0,
    wandb_mode: WandbModeOpt = "offline",
    wandb_project: WandbProjectOpt = "opd-eval",
) -> None:
    """pass@1 and timeouts per temperature on the same instances with fixed top-k / top-p:
    one resumable evaluation per temperature (<out>/T<value>), then a table and a plot."""
    if task not in ("swe", "math"):
        raise _fail(f"--task {task!r}: use swe or math")
    try:
        temperatures = sorted({float(v) for v in values.split(",") if v.strip()})
    except ValueError:
        raise _fail(f"--values {values!r}: write numbers separated by commas") from None
    if not temperatures or min(temperatures) < 0:
        raise _fail(f"--values {values!r}: give at least one temperature >= 0")
    mode = _wandb_mode(wandb_mode)
    outcomes: list[tuple[float, EvalOutcome]] = []
    for temperature in temperatures:
        console.print(f"[bold]temperature {temperature:g}[/bold]")
        try:
            settings = EvalSettings(
                kind=task,  # type: ignore[arg-type]
                policy=policy,
                tokenizer=tokenizer,
                datasets=dataset,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                max_turns=max_turns,
                max_new_tokens=max_new_tokens,
                max_context_tokens=max_context_tokens,
                trajectory_timeout_s=trajectory_timeout_s,
                seed=seed,
            )
            options = RunOptions(
                out_dir=out / f"T{temperature:g}",
                limit=limit,
                concurrency=concurrency,
                sandbox=sandbox,  # type: ignore[arg-type]
                fleet_file=fleet,
                models_dir=out / "models",
                wandb_mode="disabled",
            )
        except ValueError as err:
            raise _fail(str(err)) from None
        outcomes.append((temperature, _run(settings, options)))
    table = sweep_table(outcomes)
    console.print(markdown_table(table), highlight=False)
    first = outcomes[0][1].settings
    shared = first.model_dump(mode="json", exclude={"temperature"})
    paths = write_report(
        out,
        f"temperature sweep: {policy}",
        [
            ("pass@1 per temperature", markdown_table(table)),
            ("Settings", settings_markdown(shared)),
        ],
        {"settings": shared, "rows": [dict(zip(table[0], row, strict=True)) for row in table[1]]},
        plot=sweep_plot(outcomes),
    )
    log_to_wandb(
        mode,
        wandb_project,
        f"sweep-{out.name}",
        out,
        {"eval/temperature_sweep": table},
        shared,
        image=out / "report.png",
    )
    console.print("wrote " + ", ".join(str(p) for p in paths), highlight=False)
    _exit_if_ungraded([outcome for _, outcome in outcomes])
