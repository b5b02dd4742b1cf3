"""One evaluation run from its settings: load the benchmarks, open the policy and the
sandboxes, run what the run directory does not hold yet, score, write the reports.

`opd eval swe|math` and `opd sweep temperature` (launch/eval_cli.py) are thin shells
around `run_evaluation`; so are the tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from launch.eval_report import (
    WandbMode,
    instances_markdown,
    instances_summary,
    log_to_wandb,
    markdown_table,
    math_table,
    nothing_graded,
    scores_plot,
    settings_markdown,
    swe_table,
    write_report,
)
from launch.policies import (
    PolicySpecError,
    is_scripted,
    open_policy,
    replay_path,
    resolve_policy,
    scripted_policy_factory,
)
from rollout.chat import ChatRenderer
from rollout.evaluation.datasets import (
    MINI_SWE_PREFIX,
    SWEDatasetKind,
    load_math_dataset,
    load_swe_dataset,
    named,
)
from rollout.evaluation.records import EvalRecord, ResultStore, latest_records
from rollout.evaluation.run import EvalJob, evaluate, pending_jobs, write_predictions
from rollout.evaluation.scores import ALL_BENCHMARKS, BenchmarkScore, reason_category, score
from rollout.harness.base import Harness
from rollout.harness.swe import SWEHarness, SWEHarnessConfig
from rollout.harness.tir import TIRConfig, TIRHarness
from rollout.policy import Policy, SamplingParams
from rollout.runner import Runner, RunnerConfig
from rollout.trajectory import Task
from sandbox.base import SandboxError
from slime_ext.job.config import SandboxConfig
from slime_ext.job.sandboxes import JobSandboxes, run_owner

EvalKind = Literal["swe", "math"]
SCRIPTED_TOKEN_LIMIT = 1 << 30
"""Context and generation limit of scripted policies (gold, empty, replay): none."""


class EvalSettings(BaseModel):
    """What decides an evaluation's results (kept in run.json; a run directory resumes only
    with equal settings). How many instances run (`limit`), how many at once and where the
    reports go are not settings: they do not change a result."""

    model_config = ConfigDict(extra="forbid")

    kind: EvalKind
    policy: str
    """An SGLang URL, a local HF directory, factory:<preset> or bundled:student; SWE: also
    a scripted agent, gold, empty or replay:FILE (rollout.harness.swe_scripts)."""
    tokenizer: str | None = None
    datasets: list[str] = Field(min_length=1)
    """`name=path` or a path (named by its stem); `mini_swe:N` for synthetic SWE tasks."""
    dataset_digests: dict[str, str] = Field(default_factory=dict)
    """sha256 of each dataset file, and of a replay policy's file under its --policy
    (filled by `run_evaluation`)."""
    swe_kind: SWEDatasetKind = "auto"
    samples: int = Field(default=1, ge=1)
    """k: trajectories per instance."""
    temperature: float = Field(default=1.0, ge=0.0)
    top_k: int = Field(default=-1, ge=-1)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_turns: int = Field(default=100, ge=1)
    """SWE: the step limit; math: python calls (plus one turn for the answer)."""
    tools: bool = True
    """Math: the python tool (TIR); False: reasoning only."""
    max_new_tokens: int = Field(default=4096, ge=1)
    max_context_tokens: int = Field(default=32768, ge=16)
    trajectory_timeout_s: float = Field(default=3600.0, gt=0)
    command_timeout_s: float = Field(default=60.0, gt=0)
    eval_timeout_s: float = Field(default=1800.0, gt=0)
    think_policy: Literal["drop", "keep"] = "drop"
    tool_call_format: Literal["hermes", "qwen3_coder"] = "hermes"
    seed: int = 0


class RunOptions(BaseModel):
    """How an evaluation runs, without changing its results."""

    model_config = ConfigDict(extra="forbid")

    out_dir: Path
    limit: int | None = Field(default=None, ge=1)
    """The first N instances of each benchmark."""
    concurrency: int = Field(default=8, ge=1)
    sandbox: Literal["local", "docker"] | None = None
    """SWE sandboxes on this machine: local (no images; mini-SWE) or docker (each
    instance's image); None: docker when any instance names an image."""
    max_sandboxes: int = Field(default=16, ge=1)
    fleet_file: Path | None = None
    """A YAML fleet: {config: FleetConfig fields, hosts: [HostConfig fields, ...]}."""
    models_dir: Path | None = None
    model_name: str | None = None
    """model_name_or_path in the predictions; default: the policy."""
    show_progress: bool = True
    wandb_mode: WandbMode = "offline"
    wandb_project: str = "opd-eval"
    wandb_entity: str | None = None


class EvalOutcome(BaseModel):
    settings: EvalSettings
    scores: list[BenchmarkScore]
    ran: int
    """Trajectories run this time (the rest were already in the run directory)."""
    resumed: int
    reports: list[Path]
    ungraded: dict[str, list[str]] = Field(default_factory=dict)
    """Benchmarks where nothing could be graded (every trajectory aborted; their rates
    are n/a), with why: '<count> <reason category>, e.g. <one reason>'."""


def load_benchmarks(settings: EvalSettings, limit: int | None) -> dict[str, list[Task]]:
    benchmarks: dict[str, list[Task]] = {}
    for spec in settings.datasets:
        name, source = named(spec)
        if name in benchmarks:
            raise ValueError(f"two datasets are named {name!r}: name them (name=path)")
        if settings.kind == "math":
            tasks = load_math_dataset(Path(source))
        else:
            tasks = load_swe_dataset(source, settings.swe_kind, seed=settings.seed)
        benchmarks[name] = tasks[:limit] if limit is not None else tasks
    return benchmarks


def check_gradable(harness: SWEHarness, benchmarks: dict[str, list[Task]]) -> None:
    """Refuse, before anything runs, instances their family cannot grade (SWE-bench Pro
    rows without run scripts, rows without an eval script or log parser): each would
    only count as an infrastructure abort."""
    problems: list[str] = []
    for name, tasks in benchmarks.items():
        for task in tasks:
            check = getattr(harness.family(task), "check", None)
            if check is None:
                continue
            try:
                check(task)
            except SandboxError as err:
                problems.append(f"{name}: {err}")
    if problems:
        shown = "\n  ".join(problems[:5])
        more = f"\n  and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise ValueError(f"{len(problems)} instances cannot be graded:\n  {shown}{more}")


def dataset_digests(datasets: Sequence[str], policy: str | None = None) -> dict[str, str]:
    digests: dict[str, str] = {}
    for spec in datasets:
        name, source = named(spec)
        if source.startswith(MINI_SWE_PREFIX):
            continue
        digests[name] = hashlib.sha256(Path(source).read_bytes()).hexdigest()
    if policy is not None and (replay := replay_path(policy)) is not None:
        digests[policy] = hashlib.sha256(replay.read_bytes()).hexdigest()  # an edited script
    return digests


def harness_of(settings: EvalSettings) -> Harness:
    if settings.kind == "math":
        return TIRHarness(TIRConfig(max_tool_calls=settings.max_turns, use_tools=settings.tools))
    return SWEHarness(
        SWEHarnessConfig(
            step_limit=settings.max_turns,
            command_timeout_s=settings.command_timeout_s,
            eval_timeout_s=settings.eval_timeout_s,
            grade_empty_submissions=settings.policy == "empty",
            keep_grade_files=True,
        )
    )


def runner_config_of(settings: EvalSettings, concurrency: int) -> RunnerConfig:
    # TIR: every python call is a turn, and the answer one more
    turns = settings.max_turns + 1 if settings.kind == "math" else settings.max_turns
    max_new_tokens, max_context_tokens = settings.max_new_tokens, settings.max_context_tokens
    if is_scripted(settings.policy):  # no model: a script's turns are as long as they are
        max_new_tokens = max_context_tokens = SCRIPTED_TOKEN_LIMIT
    return RunnerConfig(
        concurrency=concurrency,
        max_turns=turns,
        max_new_tokens=max_new_tokens,
        max_context_tokens=max_context_tokens,
        trajectory_timeout_s=settings.trajectory_timeout_s,
        sampling=SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
        ),
    )


@contextlib.asynccontextmanager
async def sandboxes_for(
    benchmarks: dict[str, list[Task]], options: RunOptions, harness: SWEHarness, owner: str
) -> AsyncIterator[JobSandboxes]:
    """The sandboxes SWE instances run in: the fleet file's hosts, or one host here."""
    backend = options.sandbox
    if backend is None and options.fleet_file is None:
        any_image = any(
            harness.family(task).image(task) is not None
            for tasks in benchmarks.values()
            for task in tasks
        )
        backend = "docker" if any_image else "local"
    section = SandboxConfig(
        backend=backend or "auto",
        hosts="here",
        fleet_file=None if options.fleet_file is None else str(options.fleet_file),
        command_timeout_s=harness.config.command_timeout_s,
        max_sandboxes=options.max_sandboxes,
    )
    async with JobSandboxes(section, owner) as sandboxes:
        yield sandboxes


async def _run(
    settings: EvalSettings,
    options: RunOptions,
    harness: Harness,
    benchmarks: dict[str, list[Task]],
    jobs: list[EvalJob],
    store: ResultStore,
    policy_factory: Callable[[], contextlib.AbstractAsyncContextManager[tuple[Policy, Any]]],
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        policy, tokenizer = await stack.enter_async_context(policy_factory())
        if isinstance(harness, SWEHarness):
            owner = run_owner(options.out_dir, prefix="opd-eval")
            sandboxes = await stack.enter_async_context(
                sandboxes_for(benchmarks, options, harness, owner)
            )
            harness.sandbox_factory = sandboxes.sandbox
        renderer = ChatRenderer(
            tokenizer,
            harness.tools,
            think_policy=settings.think_policy,
            tool_call_format=settings.tool_call_format,
        )
        runner = Runner(harness, policy, renderer, runner_config_of(settings, options.concurrency))
        await evaluate(runner, jobs, store, show_progress=options.show_progress)


def run_evaluation(
    settings: EvalSettings,
    options: RunOptions,
    policy_factory: Callable[[], contextlib.AbstractAsyncContextManager[tuple[Policy, Any]]]
    | None = None,
) -> EvalOutcome:
    """Run (or resume) the evaluation into options.out_dir and write its reports.
    `policy_factory`: opens (policy, tokenizer); default: from settings.policy."""
    benchmarks = load_benchmarks(settings, options.limit)
    harness = harness_of(settings)
    models_dir = options.models_dir or options.out_dir / "models"
    if isinstance(harness, SWEHarness):
        check_gradable(harness, benchmarks)
    elif is_scripted(settings.policy):
        raise PolicySpecError(f"--policy {settings.policy}: a scripted policy is for SWE only")
    if policy_factory is None and isinstance(harness, SWEHarness) and is_scripted(settings.policy):
        swe_harness = harness  # scripts made (a replay file read) before the run directory
        policy_factory = scripted_policy_factory(
            settings.policy,
            [task for tasks in benchmarks.values() for task in tasks],
            lambda task: swe_harness.family(task).reference_patch(task),
            settings.tokenizer,
            models_dir,
            settings.seed,
            settings.tool_call_format,
        )
    digests = dataset_digests(settings.datasets, settings.policy)
    settings = settings.model_copy(update={"dataset_digests": digests})
    store = ResultStore(options.out_dir)
    done = store.open(settings.model_dump(mode="json"))
    jobs = pending_jobs(benchmarks, settings.samples, done)
    if policy_factory is None:
        source = resolve_policy(settings.policy, settings.tokenizer, models_dir, settings.seed)

        def policy_factory() -> contextlib.AbstractAsyncContextManager[tuple[Policy, Any]]:
            return open_policy(source, settings.seed + len(done), options.concurrency)

    if jobs:
        asyncio.run(_run(settings, options, harness, benchmarks, jobs, store, policy_factory))
    wanted = _keys(benchmarks, settings.samples)
    records = [r for r in latest_records(store.read()) if r.key in wanted]
    scores = score(records)
    reports = write_eval_report(settings, options, records, scores)
    return EvalOutcome(
        settings=settings,
        scores=scores,
        ran=len(jobs),
        resumed=len(wanted) - len(jobs),
        reports=reports,
        ungraded=ungraded_reasons(records, scores),
    )


def ungraded_reasons(
    records: Sequence[EvalRecord], scores: Sequence[BenchmarkScore]
) -> dict[str, list[str]]:
    """Why nothing was graded, per benchmark where nothing was: each reason category's
    count with one of its reasons."""
    why: dict[str, list[str]] = {}
    for s in scores:
        if s.benchmark == ALL_BENCHMARKS or not nothing_graded(s):
            continue
        reasons = [r.reason for r in records if r.benchmark == s.benchmark]
        counts = Counter(reason_category(reason) for reason in reasons)
        example = {reason_category(reason): reason for reason in reversed(reasons)}
        why[s.benchmark] = [
            f"{count} {category}, e.g. {example[category][:300]}"
            for category, count in counts.most_common()
        ]
    return why


def _keys(benchmarks: dict[str, list[Task]], samples: int) -> set[tuple[str, str, int]]:
    return {
        (name, task.task_id, sample)
        for name, tasks in benchmarks.items()
        for task in tasks
        for sample in range(samples)
    }


def write_eval_report(
    settings: EvalSettings,
    options: RunOptions,
    records: Sequence[EvalRecord],
    scores: Sequence[BenchmarkScore],
) -> list[Path]:
    out_dir = options.out_dir
    table = swe_table(scores) if settings.kind == "swe" else math_table(scores)
    title = f"opd eval {settings.kind}: {settings.policy}"
    metric = "pass@1" if settings.kind == "swe" else f"avg@{settings.samples}"
    sections = [
        ("Scores", markdown_table(table)),
        ("Why not solved", _reasons_markdown(scores)),
    ]
    data: dict[str, Any] = {
        "settings": settings.model_dump(mode="json"),
        "scores": [s.model_dump(mode="json") for s in scores],
    }
    if settings.kind == "swe":
        sections.append(("Instances", instances_markdown(records)))
        data["instances"] = instances_summary(records)
    sections.append(("Settings", settings_markdown(settings.model_dump(mode="json"))))
    paths = write_report(
        out_dir,
        title,
        sections,
        data,
        plot=scores_plot(scores, title, metric) if scores else None,
    )
    if settings.kind == "swe":
        paths += write_predictions(records, out_dir, options.model_name or settings.policy)
    log_to_wandb(
        options.wandb_mode,
        options.wandb_project,
        f"eval-{settings.kind}-{out_dir.name}",
        out_dir,
        {f"eval/{settings.kind}_scores": table},
        settings.model_dump(mode="json"),
        image=out_dir / "report.png",
        entity=options.wandb_entity,
    )
    return paths


def _reasons_markdown(scores: Sequence[BenchmarkScore]) -> str:
    lines = []
    for s in scores:
        top = list(s.reasons.items())[:5]
        shown = "; ".join(f"{reason} ({count})" for reason, count in top) or "none"
        lines.append(f"- {s.benchmark}: {shown}")
    return "\n".join(lines)
