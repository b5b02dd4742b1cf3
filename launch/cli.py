"""The `opd` command line. Subcommands are added by the parts that own them."""

from __future__ import annotations

import json
import os
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console
from rich.markup import escape

from launch.dashboard import (
    DEFAULT_NAME,
    DEFAULT_X_AXIS,
    DashboardKind,
    MissingWandbKey,
    dashboard,
)
from launch.eval_cli import compare, eval_app, sweep_app
from launch.ssd_cli import ssd_app
from launch.tasks_cli import tasks_app
from slime_ext.job.config import (
    ConfigError,
    JobConfig,
    apply_overrides,
    config_to_explained_yaml,
    config_to_yaml,
    config_without_refused_keys,
    load_config,
    read_config_data,
)
from teacher_server.cli_help import hide_flag_types, version_option


class DemoHarness(str, Enum):
    """The demos: math with a python tool, or mini-SWE repositories."""

    tir = "tir"
    swe = "swe"


class DemoSandbox(str, Enum):
    """Where `opd demo swe` runs the agent's commands and gradings."""

    local = "local"
    docker = "docker"


hide_flag_types()
console = Console()
err_console = Console(stderr=True)

app = typer.Typer(
    name="opd",
    help="Per-turn on-policy distillation for code and math agents.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root(
    version: Annotated[bool, version_option("opd")] = False,
) -> None:
    """Per-turn on-policy distillation for code and math agents."""


config_app = typer.Typer(help="Check and inspect job configs (YAML).", no_args_is_help=True)
factory_app = typer.Typer(help="Small local models for tests and demos.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(factory_app, name="factory")
app.add_typer(ssd_app, name="ssd")
app.add_typer(tasks_app, name="tasks")
app.add_typer(eval_app, name="eval")
app.add_typer(sweep_app, name="sweep")
app.command("compare")(compare)

ConfigPath = Annotated[Path, typer.Argument(help="A job config YAML file.")]
Overrides = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override one key: section.key=value (repeatable)."),
]


def _load_or_exit(path: Path, overrides: list[str] | None, checked: bool = False) -> JobConfig:
    """The validated config, or exit 2 naming every problem; `checked`: also the problems
    the command's own checks find in the rest of the config (its refused keys left at
    their defaults), so that one pass lists what a user must fix."""
    try:
        return load_config(path, overrides)
    except ConfigError as err:
        err_console.print(
            f"[red]invalid config[/red] {escape(str(err))}", highlight=False, soft_wrap=True
        )
        if checked:
            _more_problems(path, overrides)
        raise typer.Exit(code=2) from None


def _more_problems(path: Path, overrides: list[str] | None) -> None:
    from launch.checks import preflight

    try:
        data = apply_overrides(read_config_data(path), overrides or [])
    except ConfigError:
        return
    found = config_without_refused_keys(data)
    if found is None:
        return
    config, left_out = found
    if "parallel.gpus_per_node" in left_out:
        return  # its default (0) would check the config for another command (opd train)
    command, problems = preflight(config)
    if problems:
        err_console.print(
            f"and what {command} refuses in the rest of it (checked with "
            f"{', '.join(left_out)} at their defaults):",
            highlight=False,
            soft_wrap=True,
        )
        err_console.print("\n".join(problems), highlight=False, markup=False, soft_wrap=True)


def _exit(header: str, lines: list[str], code: int) -> typer.Exit:
    err_console.print(f"[red]{header}[/red]", highlight=False, soft_wrap=True)
    err_console.print("\n".join(lines), highlight=False, markup=False, soft_wrap=True)
    return typer.Exit(code=code)


def _refuse(header: str, problems: list[str]) -> typer.Exit:
    """Print every problem (each says its fix) under `header`; exit code 2."""
    return _exit(header, problems, 2)


def _failed(header: str, reason: str) -> typer.Exit:
    """A run that started and could not go on: what stopped it; exit code 1."""
    return _exit(header, [reason], 1)


@config_app.command("validate")
def config_validate(path: ConfigPath, overrides: Overrides = None) -> None:
    """Check a config for the command it is for: `opd launch` when parallel.gpus_per_node >
    0, else `opd train`. Runs every check that command makes before it starts (the same
    functions), so a config that passes is not refused by it; exit 2 naming every
    problem and its fix."""
    from launch.checks import TRAIN, check_tasks_file, preflight
    from slime_ext.job.sequence_layout import layout_warning
    from slime_ext.job.sequence_layout import resolve as resolve_layout
    from slime_ext.local.preflight import local_job_warnings

    config = _load_or_exit(path, overrides, checked=True)
    command, problems = preflight(config)
    if problems:
        raise _refuse(f"not ready for {command}: {path}", problems)
    layout = config.parallel
    line = (
        f"[green]ok for {command}[/green]: {path}: recipe {config.algorithm.recipe}, "
        f"harness {config.rollout.harness}, teacher {config.teacher.kind}, "
        f"{layout.world_size} worker(s) as TP{layout.tp} x CP{layout.cp} x PP{layout.pp} "
        f"x DP{layout.data_parallel}"
    )
    if command != TRAIN:
        if (rows := check_tasks_file(config)) is not None:
            line += f", {rows} rows in {escape(str(config.cluster.tasks_file))}"
        sequences = resolve_layout(config)
        line += f", sequence layout {sequences.layout} ({escape(sequences.why)})"
    console.print(line, highlight=False, soft_wrap=True)
    warnings = [layout_warning(config)] if command != TRAIN else local_job_warnings(config)
    for warning in filter(None, warnings):
        err_console.print(f"[yellow]warning[/yellow]: {escape(warning)}", soft_wrap=True)


@config_app.command("show")
def config_show(
    path: Annotated[
        Path | None, typer.Argument(help="A config file; omit for the embedded default.")
    ] = None,
    overrides: Overrides = None,
    explain: Annotated[
        bool,
        typer.Option("--explain", help="Each key under its explanation, as YAML comments."),
    ] = False,
) -> None:
    """Print the full config with every default filled in (valid YAML: save it as a
    starting point)."""
    config = JobConfig() if path is None else _load_or_exit(path, overrides)
    text = config_to_explained_yaml(config) if explain else config_to_yaml(config)
    console.print(text, highlight=False, markup=False, soft_wrap=True)


@factory_app.command("list")
def factory_list() -> None:
    """List the factory's model presets."""
    from slime_ext.models.factory import PRESETS

    for name, spec in sorted(PRESETS.items()):
        console.print(
            f"{name}: {spec.arch}, {spec.num_layers} layers, hidden {spec.hidden_size}",
            highlight=False,
        )


@factory_app.command("build")
def factory_build(
    preset: Annotated[str, typer.Argument(help="A preset name (see `opd factory list`).")],
    out: Annotated[Path, typer.Option(help="Directory to write the HF checkpoint to.")],
    seed: Annotated[int, typer.Option(help="Initialization seed.")] = 0,
) -> None:
    """Build a random-init model and its tokenizer as a HF directory."""
    from slime_ext.models.factory import UnknownPresetError, build_checkpoint

    try:
        path = build_checkpoint(preset, out, seed=seed)
    except UnknownPresetError as err:
        err_console.print(f"[red]error[/red] {err}", highlight=False)
        raise typer.Exit(code=2) from None
    console.print(f"wrote {path}", highlight=False)


@app.command("demo")
def demo(
    harness: Annotated[
        DemoHarness,
        typer.Argument(
            help="tir: math with a python tool (bundled:student / teacher); swe: mini-SWE "
            "repositories in sandboxes (bundled:swe-student / swe-teacher; --sandbox)."
        ),
    ] = DemoHarness.tir,
    out: Annotated[
        Path | None,
        typer.Option(help="Run directory (replaced); default runs/demo or runs/demo-swe."),
    ] = None,
    steps: Annotated[int | None, typer.Option(help="OPD steps (default: tir 24, swe 16).")] = None,
    n_heldout: Annotated[
        int | None,
        typer.Option(help="Held-out problems or tasks evaluated (default: tir 300, swe 100)."),
    ] = None,
    eval_every: Annotated[
        int,
        typer.Option(
            min=0,
            help="Also evaluate during training, every this many steps, on the first 64 "
            "held-out problems (logging.eval_problems); 0: only before and after.",
        ),
    ] = 0,
    seed: Annotated[
        int | None,
        typer.Option(
            help="Seed of the training problems' order and of every sampled token "
            "(the config's model.seed, 0); the bundled models and held-out set stay.",
        ),
    ] = None,
    sandbox: Annotated[
        DemoSandbox,
        typer.Option(
            help="swe: where the agent's commands and the gradings run (sandbox.backend): "
            "local (own uid, bubblewrap, no network) or docker (a container of --image "
            "each, no network; a daemon must answer and the image be present, checked "
            "before any model loads). tir: local only (its python tool).",
        ),
    ] = DemoSandbox.local,
    image: Annotated[
        str | None,
        typer.Option(
            help="--sandbox docker: the image (sandbox.image; default "
            "opd-sandbox-swe-base:latest, built from docker/sandbox-swe-base.Dockerfile as "
            "docker/README.md shows).",
        ),
    ] = None,
) -> None:
    """The one-machine OPD demo: evaluate the bundled student, run per-turn OPD against the
    bundled teacher (served on 127.0.0.1) for a few minutes, evaluate again. A line per
    step, checkpoint and evaluation. `opd demo swe`: the same on mini-SWE, an agent fixing
    repositories over several turns in local sandboxes, or in Docker ones with `--sandbox
    docker` (summary.json records which)."""
    from sandbox.base import SandboxUnavailableError
    from slime_ext.local.loop import RolloutsFailedError
    from slime_ext.local.opd_demo import DemoSandboxError, run_opd_demo

    try:
        run_opd_demo(
            out,
            steps=steps,
            n_heldout=n_heldout,
            console=console,
            eval_every_steps=eval_every,
            seed=seed,
            harness=harness.value,
            sandbox=sandbox.value,
            image=image,
        )
    except DemoSandboxError as err:
        raise _refuse(f"cannot run opd demo {harness.value}", [str(err)]) from None
    except SandboxUnavailableError as err:
        raise _failed(f"cannot run opd demo {harness.value}", str(err)) from None
    except RolloutsFailedError as err:
        raise _failed("the demo stopped", str(err)) from None


@app.command("train")
def train(
    path: ConfigPath,
    overrides: Overrides = None,
    fresh: Annotated[
        bool,
        typer.Option(
            "--fresh",
            help="Start over at step 0: what the run directory holds moves to "
            "previous-<time>/ in it (nothing is deleted; the models/ cache stays).",
        ),
    ] = False,
    resume_from: Annotated[
        int | None,
        typer.Option(
            "--resume-from",
            metavar="STEP",
            min=1,
            help="Resume from this kept checkpoint (run_dir/checkpoints/step_<STEP>) instead "
            "of the newest; the later checkpoints and trajectories move to previous-<time>/.",
        ),
    ] = None,
    allow_changed: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-changed",
            metavar="KEY",
            help="Resume although this setting (section.key) differs from the run's "
            "config.yaml; recorded there (repeatable).",
        ),
    ] = None,
) -> None:
    """Run a job config on this machine: recipes opd, opsd, oprd, rl and sft, on the TIR
    harness (math with a python tool) or the SWE one (rollout.harness swe: mini-SWE or your
    SWE rows in local, Docker or E2B sandboxes; launch/configs/swe-local.yaml).
    Checkpoints go to run_dir/checkpoints/step_<N>/ (the newest logging.keep_checkpoints
    are kept; run_dir/checkpoint links to the newest) and the resolved config to
    run_dir/config.yaml. Run again, it resumes from the newest checkpoint; it refuses to
    resume with settings that change what is trained, naming them (--fresh, another
    logging.run_dir or --allow-changed KEY). Prints a line per step (loss, reverse KL or
    reward, tokens/s, ETA) and per checkpoint; with `-s logging.eval_every_steps=N`, greedy
    held-out accuracy every N steps."""
    from slime_ext.local.checkpoints import ResumeOptions, RunDirError
    from slime_ext.local.loop import RolloutsFailedError
    from slime_ext.local.run_config import UnsupportedLocalJob, run_local_job

    if fresh and resume_from is not None:
        raise _refuse(
            "--fresh and --resume-from together",
            ["--fresh starts over at step 0, --resume-from resumes a checkpoint: pass one"],
        )
    config = _load_or_exit(path, overrides)
    resume = ResumeOptions(fresh, resume_from, tuple(allow_changed or ()))
    try:
        run_local_job(config, console=console, resume=resume)
    except UnsupportedLocalJob as err:
        raise _refuse(f"cannot train: {path}", [str(err)]) from None
    except RunDirError as err:
        header, *problems = str(err).splitlines()
        raise _refuse(header, problems) from None
    except RolloutsFailedError as err:
        raise _failed(f"training stopped: {path}", str(err)) from None


@app.command("launch")
def launch(
    path: ConfigPath,
    overrides: Overrides = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print every command; run nothing.")
    ] = False,
    sbatch: Annotated[
        Path | None, typer.Option(help="Write a Slurm batch script here instead of running.")
    ] = None,
    stop: Annotated[
        bool,
        typer.Option(
            "--stop",
            help="Stop what a launch of this config started (its daemons: Ray, the teacher, "
            "the snapshot sync), last started first; under Slurm, scancel the job instead.",
        ),
    ] = False,
    rehearse: Annotated[
        bool,
        typer.Option(
            "--rehearse",
            help="Rehearse the job on this machine at rehearsal scale (tiny models of the "
            "student's architecture, a few trajectories, 2 rollouts, every node a loopback "
            "address here): prints each component up or down, each stage's time and a "
            "projected step time; exit 0 only when every component worked.",
        ),
    ] = False,
    rehearse_on: Annotated[
        str,
        typer.Option(
            help="here: every node a loopback address of this machine, under the CPU "
            "runtime; nodes: the config's own nodes through its executor (each checked "
            "reachable first; the rehearsal's files under logging.run_dir/rehearsal, which "
            "they must share).",
        ),
    ] = "here",
    rehearse_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where the rehearsal's models, run and logs go (default: a new "
            "directory under the system's temp dir)."
        ),
    ] = None,
    allow_changed: Annotated[
        list[str] | None,
        typer.Option(
            help="A relaunch of the run may change this setting (section.key; repeatable): "
            "other changes stop it before anything starts. Where and how it runs (nodes, "
            "ports, launch options) may change without it."
        ),
    ] = None,
    detach: Annotated[
        bool,
        typer.Option(
            "--detach",
            help="Return once the job is submitted, leaving its daemons running (stop them "
            "with --stop). By default the launch follows the job and stops them when it ends.",
        ),
    ] = False,
) -> None:
    """Start a cluster job: the teacher service on its node, Ray on the training and
    sandbox nodes, the HF -> Megatron conversion when needed, and `ray job submit` of
    slime's train.py with our hooks. Nodes are reached per cluster.executor. A launch first
    stops what an earlier launch of the same run left; it stops what it started when a
    step fails, when a daemon the job needs ends, on Ctrl-C, and when the job ends.
    Launched again, the same run (logging.run_dir) goes on from its newest checkpoint with
    the same W&B run, and refuses changed settings unless --allow-changed names them."""
    from launch.checks import launch_problems
    from launch.executor import Executor, LaunchError
    from launch.plan import (
        build_plan,
        hosts_from_config,
        render_dry_run,
        render_sbatch,
        secret_names,
    )
    from slime_ext.job.sequence_layout import layout_warning

    config = _load_or_exit(path, overrides, checked=True)
    # the checks `opd config validate` runs; --sbatch takes its nodes from the allocation
    problems = launch_problems(config, place_hosts=sbatch is None)
    if problems:
        raise _refuse(f"cannot launch: {path}", problems)
    # the job's processes read the secrets by name from the environment passed on
    unset = [name for name in secret_names(config) if not os.environ.get(name)]
    if unset and not (dry_run or sbatch or stop or rehearse):
        raise _refuse(
            f"cannot launch: {path}",
            [
                f"{name} is unset here: export it before `opd launch` (the job's processes "
                "read it by name from the environment the launch passes on)"
                for name in unset
            ],
        )
    if not stop and (warning := layout_warning(config)):
        err_console.print(f"[yellow]warning[/yellow]: {escape(warning)}", soft_wrap=True)
    if rehearse:
        if dry_run or sbatch or stop or detach:
            raise _refuse(
                f"cannot rehearse: {path}",
                ["--rehearse runs alone (no --dry-run, --sbatch, --stop or --detach)"],
            )
        if rehearse_on not in ("here", "nodes"):
            raise _refuse(
                f"cannot rehearse: {path}", [f"--rehearse-on {rehearse_on!r}: here or nodes"]
            )
        on: Literal["here", "nodes"] = "nodes" if rehearse_on == "nodes" else "here"
        raise typer.Exit(code=0 if _rehearse(config, rehearse_dir, on) else 1)
    try:
        if sbatch is not None:
            sbatch.parent.mkdir(parents=True, exist_ok=True)
            sbatch.write_text(render_sbatch(config, sbatch, allow_changed or ()))
            logs = Path(config.logging.run_dir) / "logs"
            try:  # Slurm opens the job's --output there before the script runs
                logs.mkdir(parents=True, exist_ok=True)
                where = f"its output goes to {logs}"
            except OSError as err:
                where = f"create {logs} where sbatch runs first ({err.strerror}): Slurm opens "
                where += "the job's output there before the script runs"
            console.print(
                f"wrote {sbatch}; submit it with: sbatch {sbatch} ({where})", highlight=False
            )
            return
        steps = build_plan(
            config,
            hosts_from_config(config),
            wait_for_job=not detach,
            allow_changed=allow_changed or (),
        )
        if stop:
            reporter = Executor(config, report=lambda line: console.print(line, highlight=False))
            stopped = reporter.stop(steps)
            console.print(f"stopped {len(stopped)} daemon(s) of {config.logging.run_dir}")
            return
        if dry_run:  # plain text: rich would wrap the long commands
            typer.echo(render_dry_run(steps, f"{config.logging.run_dir}/logs"), nl=False)
            return
        executor = Executor(
            config, report=lambda line: console.print(line, highlight=False, soft_wrap=True)
        )
        executor.run(steps, until_done=not detach)
    except ConfigError as err:
        err_console.print(f"[red]cannot launch[/red] {err}", highlight=False)
        raise typer.Exit(code=2) from None
    except LaunchError as err:
        # one line per line of the message (not wrapped at 80 columns in a log file)
        err_console.print(f"[red]launch failed[/red] {escape(str(err))}", soft_wrap=True)
        raise typer.Exit(code=1) from None
    if detach:
        console.print(
            "[green]submitted[/green]; follow it with `ray job logs` on the head node, stop "
            f"its daemons with `opd launch {path} --stop`",
            highlight=False,
        )
    else:
        console.print(f"[green]the job ended[/green]; its output: {config.logging.run_dir}/logs")


def _rehearse(config: JobConfig, directory: Path | None, on: Literal["here", "nodes"]) -> bool:
    """launch/rehearsal.py: prepare, run, report; whether every component worked."""
    import tempfile

    from launch.rehearsal import RehearsalError, prepare
    from launch.rehearsal_report import render
    from launch.rehearsal_run import run

    if directory is None:
        default = Path(config.logging.run_dir) / "rehearsal"
        directory = default if on == "nodes" else Path(tempfile.mkdtemp(prefix="opd-rehearsal-"))
    console.print(f"rehearsing {'on the nodes' if on == 'nodes' else 'here'} in {directory}")
    try:
        rehearsal = prepare(config, directory, on)
    except RehearsalError as err:
        err_console.print(f"[red]cannot rehearse[/red] {escape(str(err))}", soft_wrap=True)
        return False
    outcome = run(rehearsal, lambda line: console.print(line, highlight=False, soft_wrap=True))
    text, ok = render(rehearsal, outcome)
    console.print(escape(text), highlight=False, soft_wrap=True)
    verdict = "[green]every component worked[/green]" if ok else "[red]rehearsal failed[/red]"
    console.print(verdict)
    return ok


@app.command("dashboard")
def dashboard_command(
    entity: Annotated[str, typer.Option(help="W&B entity (user or team).")],
    project: Annotated[str, typer.Option(help="W&B project holding the runs.")],
    kind: Annotated[DashboardKind, typer.Option(help="What to build.")] = "both",
    name: Annotated[str, typer.Option(help="Workspace name and report title.")] = DEFAULT_NAME,
    x_axis: Annotated[
        str,
        typer.Option(
            help="auto: each panel against the step its metric is logged with (train/* vs "
            "train/step, the rest vs rollout/step, as slime defines them); or one metric "
            "for every panel (e.g. _step)."
        ),
    ] = DEFAULT_X_AXIS,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Build offline and save nothing.")
    ] = False,
    out: Annotated[Path | None, typer.Option(help="Write the serialized JSON here.")] = None,
) -> None:
    """Build the OPD W&B workspace and/or report (training dynamics, rollout health,
    cost); save it to W&B unless --dry-run (saving needs WANDB_API_KEY)."""
    try:
        text = dashboard(entity, project, kind, name, dry_run, out, x_axis)
    except MissingWandbKey as err:
        err_console.print(f"[red]{err}[/red]", highlight=False)
        raise typer.Exit(code=2) from None
    console.print(text, highlight=False)


demo_models_app = typer.Typer(help="The demo's bundled teacher and student.", no_args_is_help=True)
app.add_typer(demo_models_app, name="demo-models")


@demo_models_app.command("build")
def demo_models_build(
    out: Annotated[Path, typer.Option(help="Where to write student/ and teacher/.")],
    harness: Annotated[
        DemoHarness, typer.Option(help="The models of `opd demo` (tir) or `opd demo swe`.")
    ] = DemoHarness.tir,
    student_step: Annotated[
        int | None, typer.Option(help="SFT step saved as the student (default: recorded).")
    ] = None,
    teacher_step: Annotated[
        int | None, typer.Option(help="SFT step saved as the teacher (default: recorded).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Initialization and data seed (default: the recipe's, 0).")
    ] = None,
    recipe: Annotated[
        Path | None,
        typer.Option(
            help="A JSON object of recipe fields replacing the recorded ones (the options "
            "above still apply), e.g. a learning-rate schedule and a student chosen by "
            "scored snapshots (select_every)."
        ),
    ] = None,
) -> None:
    """Train a demo's models by SFT on worked traces (the recorded recipe; swe: worked
    mini-SWE scripts run in local sandboxes first)."""
    from pydantic import ValidationError

    from slime_ext.local.demo_models import DemoModelsError, DemoModelsRecipe, build_demo_models

    changed: dict[str, Any] = {}
    try:
        if recipe is not None:
            changed = json.loads(recipe.read_text())
            if not isinstance(changed, dict):
                raise ValueError("not a JSON object of recipe fields")
        if seed is not None:
            changed["seed"] = seed
        if student_step is not None:
            changed["student_step"] = student_step
        if teacher_step is not None:
            changed["teacher_step"] = teacher_step
        chosen = DemoModelsRecipe.for_harness(harness.value, **changed)
    except (OSError, ValueError, ValidationError) as err:
        err_console.print(
            f"[red]invalid recipe[/red] {escape(str(err))}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(code=2) from None
    out.mkdir(parents=True, exist_ok=True)
    try:
        build_demo_models(out, chosen, log=lambda line: console.print(line, highlight=False))
    except DemoModelsError as err:
        err_console.print(f"[red]build failed[/red] {escape(str(err))}", highlight=False)
        raise typer.Exit(code=1) from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
