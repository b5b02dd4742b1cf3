"""The embedded training loop: rollouts with the local policy and python worker, per-turn
teacher scores from the teacher service, one update per step; metrics to JSONL and W&B;
checkpoints and resume with the same data order (the run directory: checkpoints.py).

Resume guarantees: the tasks of step s are a function of (seed, s); a step's trajectories
are written to trajectories/step_<s>.jsonl (replaced, never appended, when a step is
redone after a crash) and its metrics line is dropped from metrics.jsonl on resume if the
checkpoint predates it, so no trajectory is lost or counted twice.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.chat import ChatRenderer
from rollout.harness.base import Harness
from rollout.harness.tir import TIRConfig, TIRHarness
from rollout.hints import HintedTeacherContext
from rollout.infra_watch import InfrastructureWatch, RolloutsFailedError
from rollout.policy import HFPolicy
from rollout.reminders import ReminderTeacherContext
from rollout.runner import Runner, TeacherContext, rollout_metrics
from rollout.trajectory import Task, Trajectory, write_jsonl
from sandbox import LocalSandboxConfig, PythonWorkerConfig
from slime_ext.job.assembly import (
    harness_for,
    hinted_teacher_context,
    reminder_teacher_context,
    runner_config,
    teacher_in_process,
)
from slime_ext.job.config import JobConfig
from slime_ext.job.sandboxes import JobSandboxes, fleet_metrics, run_owner
from slime_ext.local.checkpoints import ResumeOptions, open_run, write_checkpoint
from slime_ext.local.evaluate import accuracy_metrics, correct, evaluate
from slime_ext.local.preflight import LOCAL_RECIPES
from slime_ext.local.progress import TrainingReport
from slime_ext.local.trainer import LocalTrainer, SelfTeacher, TrainerConfig
from teacher_server.client import TeacherClient
from teacher_server.lifetime import end_with_parent
from teacher_server.snapshot_sync import refresh_steps

StepCallback = Callable[[int, dict[str, float]], None]


class TeacherStartError(RuntimeError):
    """The embedded teacher service did not come up."""


@contextlib.contextmanager
def embedded_teacher(
    model_dir: Path,
    log_path: Path,
    port: int | None = None,
    startup_timeout_s: float = 120.0,
    api_key: str | None = None,
) -> Iterator[str]:
    """Run `opd-teacher serve` (hf backend) on 127.0.0.1 for the duration of the block
    (with `api_key`, requests need it and the weights can be reloaded). Without `port` the
    service binds a free one and names it in a file beside its log (no port is probed here
    and bound there later, where something else could take it in between)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port_file = log_path.with_name(f"{log_path.name}.port")
    port_file.unlink(missing_ok=True)
    env = {**os.environ}
    env.pop("OPD_TEACHER_API_KEY", None)
    if api_key:
        env["OPD_TEACHER_API_KEY"] = api_key
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "teacher_server",
                "serve",
                "--model",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(port or 0),
                "--port-file",
                str(port_file),
                "--max-queue",
                "100000",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            # it ends with this thread: a run killed where the finally below never runs
            # leaves no teacher holding its model and port
            preexec_fn=functools.partial(end_with_parent, os.getpid(), signal.SIGTERM),
        )
        try:
            yield served_url(server, port_file, startup_timeout_s, f"see {log_path}")
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
            port_file.unlink(missing_ok=True)


def served_url(
    server: subprocess.Popen[Any], port_file: Path, timeout_s: float, log_hint: str
) -> str:
    """The base URL of `opd-teacher serve --host 127.0.0.1 --port-file port_file` running
    as `server`, once its port is named there and /health answers 200. TeacherStartError
    (with `log_hint`, where its output is) when it exits first or is not up in time."""
    deadline = time.monotonic() + timeout_s
    url = None
    while True:
        if server.poll() is not None:
            raise TeacherStartError(f"teacher exited with {server.returncode}; {log_hint}")
        if url is None and port_file.exists():
            url = f"http://127.0.0.1:{int(port_file.read_text())}"
        if url is not None:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
        if time.monotonic() > deadline:
            raise TeacherStartError(f"teacher not up after {timeout_s:.0f} s; {log_hint}")
        time.sleep(0.2)


def tasks_for_step(tasks: Sequence[Task], step: int, per_step: int, seed: int) -> list[Task]:
    """The tasks of one step: epochs walk a seeded permutation of the pool."""
    per_epoch = max(len(tasks) // per_step, 1)
    epoch, offset = divmod(step, per_epoch)
    order = list(range(len(tasks)))
    random.Random(f"{seed}-{epoch}").shuffle(order)
    chosen = order[offset * per_step : (offset + 1) * per_step]
    return [tasks[i] for i in chosen]


def tir_harness(max_tool_calls: int = 4) -> TIRHarness:
    """The demo's harness: no numeric preloads, so each trajectory's worker starts fast."""
    worker = PythonWorkerConfig(preload_modules=[], sandbox=LocalSandboxConfig())
    return TIRHarness(TIRConfig(max_tool_calls=max_tool_calls, call_timeout_s=5.0, worker=worker))


def trainer_config(job: JobConfig) -> TrainerConfig:
    """The local trainer's settings of `job` (its algorithm and rollout sections)."""
    algorithm, rollout = job.algorithm, job.rollout
    return TrainerConfig(
        lr=algorithm.lr,
        lr_schedule=algorithm.lr_schedule,
        lr_warmup_steps=algorithm.lr_warmup_steps,
        min_lr=algorithm.min_lr,
        lr_decay_steps=algorithm.steps,
        weight_decay=algorithm.weight_decay,
        grad_clip=algorithm.grad_clip,
        temperature=rollout.temperature,
        kl_coef=algorithm.kl_coef,
        reward_weight=algorithm.reward_weight,
        kl_discount=algorithm.kl_discount,
        train_on_invalid_turns=algorithm.train_on_invalid_turns,
        opd_loss=algorithm.opd_loss,
        sequence_layout=algorithm.sequence_layout,
        oprd_success_weight=algorithm.oprd_success_weight,
        oprd_failure_weight=algorithm.oprd_failure_weight,
        oprd_failure_loss=algorithm.oprd_failure_loss,
        oprd_support_k=algorithm.oprd_support_k,
    )


class LocalRun:
    """A training run in `run_dir`, resumed from its newest checkpoint (or the one `resume`
    names, or started over); refuses a run directory that holds a run with other settings
    (checkpoints.RunDirError)."""

    def __init__(
        self,
        job: JobConfig,
        student_dir: Path,
        run_dir: Path,
        console: Console | None = None,
        resume: ResumeOptions | None = None,
    ) -> None:
        self.job = job
        self.run_dir = run_dir
        self.student_dir = student_dir
        self.console = console or Console()
        self.start = open_run(run_dir, job, resume or ResumeOptions())
        self._sandboxes: JobSandboxes | None = None
        """SWE: the job's sandboxes while `train` runs."""
        self._eval_harness: Harness = tir_harness()
        """What held-out problems run in (SWE: the training harness, its sandboxes)."""
        checkpoint = self.start.checkpoint
        source = checkpoint if checkpoint is not None else student_dir
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        self.model = AutoModelForCausalLM.from_pretrained(source).eval()
        self.trainer = LocalTrainer(self.model, trainer_config(job))
        self.step = 0
        self._infra_watch = InfrastructureWatch()
        self.hints: HintedTeacherContext | None = None
        self.reminders: ReminderTeacherContext | None = None
        self.ema: dict[str, torch.Tensor] | None = None
        self.policy = HFPolicy(self.model, self.tokenizer.eos_token_id, seed=job.model.seed)
        if checkpoint is not None:
            state = torch.load(checkpoint / "trainer.pt", weights_only=False)
            self.trainer.optimizer.load_state_dict(state["optimizer"])
            # a checkpoint from before LR schedules took one optimizer step per loop step
            schedule = state.get("lr_schedule", {"last_epoch": state["step"]})
            self.trainer.lr_schedule.load_state_dict(schedule)
            self.policy.generator.set_state(state["sampler_rng"])
            self.step = int(state["step"])
        self._truncate_metrics(self.step)  # steps after the checkpoint are trained again

    def _truncate_metrics(self, resume_step: int) -> None:
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return
        kept = [
            line
            for line in path.read_text().splitlines()
            if line and json.loads(line)["step"] < resume_step
        ]
        path.write_text("".join(line + "\n" for line in kept))

    def save(self) -> Path:
        """Write this step's checkpoint (model, optimizer, LR schedule, sampler RNG, next
        step) atomically, keeping the newest logging.keep_checkpoints; returns its path."""

        def write(directory: Path) -> None:
            self.model.save_pretrained(directory)
            self.tokenizer.save_pretrained(directory)
            torch.save(
                {
                    "optimizer": self.trainer.optimizer.state_dict(),
                    "lr_schedule": self.trainer.lr_schedule.state_dict(),
                    "step": self.step,
                    "sampler_rng": self.policy.generator.get_state(),
                },
                directory / "trainer.pt",
            )

        return write_checkpoint(self.run_dir, self.step, write, self.job.logging.keep_checkpoints)

    async def train(
        self,
        tasks: Sequence[Task],
        teacher_url: str | None,
        steps: int | None = None,
        on_step: StepCallback | None = None,
        api_key: str | None = None,
        heldout: Sequence[Task] | None = None,
    ) -> list[dict[str, float]]:
        """Train from the checkpoint's step to `steps` (default algorithm.steps), a line
        printed per step; with logging.eval_every_steps, greedy accuracy on `heldout`
        every that many steps."""
        job = self.job
        recipe = job.algorithm.recipe
        if recipe not in LOCAL_RECIPES:
            raise ValueError(
                f"the local trainer runs {', '.join(LOCAL_RECIPES)}; {recipe!r} is not yet "
                "supported here"
            )
        total = steps if steps is not None else job.algorithm.steps
        sandboxes = self._sandboxes = None
        if job.rollout.harness == "swe":  # the job's sandboxes, opened below
            sandboxes = self._sandboxes = JobSandboxes.of_job(job, run_owner(self.run_dir))
        harness = harness_for(job, sandboxes) if sandboxes else tir_harness()
        # TIR's held-out problems run in fresh workers; SWE's in the job's sandboxes
        self._eval_harness = harness if sandboxes else tir_harness()
        renderer = ChatRenderer(
            self.tokenizer, harness.tools, think_policy=job.rollout.think_policy
        )
        config = runner_config(job).model_copy(update={"rounds": job.rollout.rounds})
        (self.run_dir / "trajectories").mkdir(parents=True, exist_ok=True)
        history: list[dict[str, float]] = []
        report = self._start_report(recipe, total, heldout)
        if sandboxes is not None:
            report.line(f"SWE sandboxes: {sandboxes.describe()}")
        if not job.logging.eval_every_steps:
            heldout = None
        async with contextlib.AsyncExitStack() as stack:
            if sandboxes is not None:
                await stack.enter_async_context(sandboxes)
            teacher = None
            in_process = teacher_in_process(job)
            if recipe in ("opd", "opsd", "oprd") and not in_process:
                if teacher_url is None:
                    raise ValueError(f"recipe {recipe} needs a teacher service URL")
                teacher = await stack.enter_async_context(TeacherClient(teacher_url, api_key))
            # OPSD: the snapshot sees a hint (hint student: written by self.policy)
            self.hints = hinted_teacher_context(
                job, renderer, harness.initial_messages, self.policy
            )
            teacher_context: TeacherContext | None = self.hints
            self.reminders = reminder_teacher_context(job, renderer)  # OPRD's snapshot
            if self.reminders is not None:
                teacher_context = None if in_process else self.reminders
            if in_process:
                assert self.reminders is not None
                snapshot = AutoModelForCausalLM.from_pretrained(self.student_dir).eval()
                snapshot.requires_grad_(False)
                self.trainer.self_teacher = SelfTeacher(snapshot, self.reminders)
            runner = Runner(
                harness,
                self.policy,
                renderer,
                config,
                teacher=teacher,
                teacher_context=teacher_context,
            )
            with Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
                disable=not self.console.is_terminal,  # the step lines say it all in a log
            ) as progress:
                bar = progress.add_task(f"{recipe} steps", total=total, completed=self.step)
                self_teacher = job.teacher.kind == "self" and (teacher is not None or in_process)
                if self_teacher:
                    await self._restore_teacher_snapshot(teacher)
                while self.step < total:
                    metrics = await self._one_step(runner, tasks, recipe, report, heldout)
                    if self_teacher:
                        metrics.update(await self._update_self_teacher(teacher, total))
                    history.append(metrics)
                    if on_step is not None:
                        on_step(self.step - 1, metrics)
                    progress.update(bar, completed=self.step)
        return history

    def _start_report(
        self, recipe: str, total: int, heldout: Sequence[Task] | None
    ) -> TrainingReport:
        """The run's progress lines, opened by what it will do."""
        agent = self.job.rollout.harness == "swe"
        report = TrainingReport(self.console, recipe, self.step, total, agent=agent)
        rollout, every = self.job.rollout, self.job.logging.eval_every_steps
        if self.start.checkpoint is not None:
            report.line(
                f"resuming {recipe} at step {self.step}/{total} from {self.start.checkpoint}"
            )
        for note in self.start.notes:
            report.line(note)
        report.line(
            f"training {recipe}: {total} steps of {rollout.tasks_per_step} tasks x "
            f"{rollout.samples_per_task} samples; metrics, trajectories and checkpoints in "
            f"{self.run_dir}"
        )
        if every and heldout is None:
            report.line(
                f"logging.eval_every_steps {every}: no held-out set was given, so no periodic "
                "evaluation (pass heldout= to LocalRun.train; `opd train` and `opd demo` do)"
            )
        elif every and heldout is not None:
            report.line(f"held-out evaluation every {every} steps on {len(heldout)} problems")
        return report

    async def _evaluate(self, heldout: Sequence[Task]) -> dict[str, float]:
        """Greedy accuracy of the student as it is now (the demo's evaluation, within the
        rollout's turn and token limits; SWE: resolved tasks, in the job's sandboxes)."""
        rollout = self.job.rollout
        started = time.perf_counter()
        trajectories = await evaluate(
            HFPolicy(self.model, self.tokenizer.eos_token_id),
            self.tokenizer,
            heldout,
            self._eval_harness,
            concurrency=rollout.concurrency,
            max_turns=rollout.max_turns,
            max_new_tokens=rollout.max_new_tokens,
            max_context_tokens=rollout.max_context_tokens,
            rounds=rollout.rounds,
        )
        seconds = time.perf_counter() - started
        return {**accuracy_metrics(correct(trajectories)), "perf/eval_time": seconds}

    async def _one_step(
        self,
        runner: Runner,
        tasks: Sequence[Task],
        recipe: str,
        report: TrainingReport,
        heldout: Sequence[Task] | None,
    ) -> dict[str, float]:
        job = self.job
        started = time.perf_counter()
        batch = tasks_for_step(tasks, self.step, job.rollout.tasks_per_step, job.model.seed)
        if self.hints is not None:
            await self.hints.prepare(batch)
        # the step is part of every sampling key: a task drawn again samples afresh
        trajectories = await runner.run(batch, job.rollout.samples_per_task, rollout_step=self.step)
        rollout_s = time.perf_counter() - started
        path = self.run_dir / "trajectories" / f"step_{self.step:05d}.jsonl"
        path.unlink(missing_ok=True)
        write_jsonl(path, trajectories)
        self._check_infrastructure(trajectories, path)
        trained = self._trainable(trajectories, recipe)
        train_started = time.perf_counter()
        metrics: dict[str, float] = {}
        if trained:
            # OPSD trains like OPD: the teacher differs, not the loss
            loss_recipe = "opd" if recipe == "opsd" else recipe
            metrics = self.trainer.step(trained, loss_recipe)  # type: ignore[arg-type]
        else:
            self.trainer.skip()
        metrics.update(rollout_metrics(trajectories))
        metrics.update(
            {
                "step": float(self.step),
                "perf/rollout_time": rollout_s,
                "perf/train_time": time.perf_counter() - train_started,
                "perf/step_time": time.perf_counter() - started,
                "train/trajectories_trained": float(len(trained)),
            }
        )
        loss_tokens = metrics.get("train/loss_tokens", 0.0)
        if loss_tokens:
            # one device here: loss-carrying tokens per second of the update, and what
            # the per-turn layout costs per such token (DESIGN.md metrics)
            metrics["perf/effective_tokens_per_gpu_per_sec"] = (
                loss_tokens / metrics["perf/train_time"]
            )
            metrics["perf/processed_tokens_per_loss_token"] = (
                metrics["train/processed_tokens"] / loss_tokens
            )
        if self.hints is not None:
            metrics.update(self.hints.stats.metrics())
        if self.reminders is not None:
            metrics.update(self.reminders.stats.take())
        for key in (
            "opd_reverse_kl",
            "opd_reverse_kl_success",
            "opd_reverse_kl_failure",
            "student_gt_teacher_frac",
        ):
            if f"train/{key}" in metrics:
                metrics[f"rollout/{key}"] = metrics[f"train/{key}"]
        done = self.step + 1
        report.step(done, metrics)
        if heldout is not None and done % job.logging.eval_every_steps == 0:
            evaluation = await self._evaluate(heldout)
            report.evaluation(done, evaluation, evaluation["perf/eval_time"])
            metrics.update(evaluation)  # logged with the step after which it was taken
        if self._sandboxes is not None:  # SWE: the fleet's load, starts and failures
            metrics.update(fleet_metrics(self._sandboxes.metrics()))
        with (self.run_dir / "metrics.jsonl").open("a") as handle:
            handle.write(json.dumps({"step": self.step, **metrics}) + "\n")
        self.step = done
        if self.step % job.logging.save_every_steps == 0 or self.step == job.algorithm.steps:
            report.checkpoint(self.save(), self.step)
        return metrics

    async def _update_self_teacher(
        self, teacher: TeacherClient | None, total: int
    ) -> dict[str, float]:
        """EMA or refresh: push new weights to the self-teacher (the service, or the
        trainer's in-process copy) after this step."""
        config = self.job.teacher
        if config.snapshot == "ema":
            with torch.no_grad():
                if self.ema is None:
                    self.ema = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
                for name, value in self.model.state_dict().items():
                    if value.is_floating_point():
                        self.ema[name].mul_(config.ema_decay).add_(
                            value, alpha=1 - config.ema_decay
                        )
            if self.step % config.ema_sync_every == 0:
                return await self._push_teacher(teacher, self.ema)
        elif config.snapshot == "refresh" and self.step in refresh_steps(config.refresh_at, total):
            return await self._push_teacher(teacher, self.model.state_dict())
        return {}

    async def _push_teacher(
        self, teacher: TeacherClient | None, weights: dict[str, Any]
    ) -> dict[str, float]:
        directory = self.run_dir / "teacher_snapshots" / f"step_{self.step:05d}"
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory, state_dict=weights)
        self.tokenizer.save_pretrained(directory)
        await self._load_teacher(teacher, directory)
        return {"teacher/snapshot_step": float(self.step)}

    async def _restore_teacher_snapshot(self, teacher: TeacherClient | None) -> None:
        """On resume: the teacher serves the latest snapshot taken before the checkpoint."""
        root = self.run_dir / "teacher_snapshots"
        taken = sorted(p for p in root.glob("step_*") if int(p.name[5:]) <= self.step)
        if taken:
            await self._load_teacher(teacher, taken[-1])

    async def _load_teacher(self, teacher: TeacherClient | None, directory: Path) -> None:
        if teacher is not None:
            await teacher.reload(str(directory))
        if self.trainer.self_teacher is not None:
            snapshot = AutoModelForCausalLM.from_pretrained(directory)
            self.trainer.self_teacher.model.load_state_dict(snapshot.state_dict())

    def _check_infrastructure(self, trajectories: Sequence[Trajectory], path: Path) -> None:
        """Stop the run when its peers are gone (rollout.infra_watch's rule)."""
        outcomes = [(t.status.value, t.status_reason) for t in trajectories]
        verdict = self._infra_watch.verdict(outcomes)
        if verdict is not None:
            raise RolloutsFailedError(
                f"step {self.step + 1}: {verdict}; nothing was trained on them (trajectories: "
                f"{path}). Fix the cause and run the same command again: it resumes from the "
                "last checkpoint"
            )

    def _trainable(self, trajectories: Sequence[Trajectory], recipe: str) -> list[Trajectory]:
        """Trajectories that carry a training signal, by the rule slime's samples follow
        (`Trajectory.ended_normally`); the rest are counted in metrics."""
        usable = [t for t in trajectories if t.turns and t.ended_normally]
        scored = recipe in ("opd", "opsd") or (
            recipe == "oprd" and not teacher_in_process(self.job)  # else the trainer scores
        )
        if scored:
            usable = [
                t for t in usable if all(turn.teacher_logprobs is not None for turn in t.turns)
            ]
        return usable


def load_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]
