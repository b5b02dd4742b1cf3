"""The rehearsal's report: each component up or down (with the reason), each stage's
measured time, and a projected step time at full scale.

Components come from the plan's steps (the first that failed is down, the ones after it
were not reached) and, for the job itself, from its own output: slime's `perf N:` lines
(rollout and train timers, with our rollout metrics in the first) and `step N:` lines
(the train metrics), and the checkpoint slime saved.

The projection is a linear model, its assumptions printed with it: each stage's measured
rate, scaled by the work of a full step (trajectories x turns x tokens, from the config),
by model size (compute and bytes proportional to parameters) and divided over the GPUs
or sandbox slots that share it. On this machine the rates are CPU rates of tiny models
under the CPU runtime, so the figure checks the arithmetic only.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from launch.plan import Step
from launch.rehearsal import ROLLOUTS, Rehearsal
from launch.rehearsal_run import Outcome
from slime_ext.cpu_runtime import ENV_FLAG
from slime_ext.job.config import RECIPES_WITH_TEACHER, JobConfig

UP, DOWN, SKIPPED = "up", "down", "not reached"
SANDBOXES = "sandboxes (through the fleet on the sandbox hosts)"


@dataclass
class Component:
    name: str
    state: str
    why: str = ""


def components(rehearsal: Rehearsal, outcome: Outcome) -> list[Component]:
    """Every component, in the order the launch brings them up."""
    if outcome.refused:
        found = [Component(name, UP, how) for name, how in outcome.checked]
        found += [Component(name, DOWN, why) for name, why in outcome.refused]
        return [*found, Component("everything else", SKIPPED, "nothing was started")]
    names = rehearsal.names
    listed: list[Component] = []
    failed = outcome.reached if outcome.error else 0
    groups: dict[str, list[int]] = {}
    for number, step in enumerate(outcome.steps, start=1):
        groups.setdefault(_component_of(step, rehearsal), []).append(number)

    def step_names(numbers: list[int]) -> list[str]:
        return [outcome.steps[n - 1].name for n in numbers]

    for name, numbers in groups.items():
        if failed and failed in numbers:
            why = _error_text(outcome.error or "")
            if name == "the job":
                listed += _job_components(rehearsal, outcome, why)
                continue
            listed.append(Component(name, DOWN, why))
        elif failed and min(numbers) > failed:
            parts = _job_parts(rehearsal.job) if name == "the job" else [name]
            listed += [Component(part, SKIPPED) for part in parts]
        elif name == "the job":
            listed += _job_components(rehearsal, outcome, "")
        elif lost := [outcome.lost[s] for s in step_names(numbers) if s in outcome.lost]:
            listed.append(Component(name, DOWN, lost[0]))
        else:
            host = outcome.steps[numbers[0] - 1].host
            where = f" on {names.get(host, host)}" if host != "local" else ""
            if names.get(host, host) != host:
                where += f" (here {host})"
            seconds = sum(outcome.step_seconds.get(outcome.steps[n - 1].name, 0) for n in numbers)
            why = f"{seconds:.1f} s{where}"
            for step_name in step_names(numbers):
                if reasons := outcome.restarted.get(step_name):
                    times = f"{len(reasons)} time{'s' * (len(reasons) > 1)}"
                    why += f"; started again {times} (it had ended: {reasons[-1]})"
            listed.append(Component(name, UP, why))
    return listed


def _component_of(step: Step, rehearsal: Rehearsal) -> str:
    name = step.name
    if name.startswith("write") or name == "check relaunch":
        return "run directory"
    if name == "prune checkpoints":
        return "checkpoint pruning"
    if name.startswith("check shared paths"):
        return "shared paths"
    if "teacher" in name or name.startswith("snapshot"):
        node = rehearsal.hosts.teacher
        return f"teacher service ({rehearsal.names[node]})" if node else "teacher service"
    if name == "convert checkpoint":
        return "checkpoint conversion"
    if name in ("ray head", "wait ray head"):
        return f"Ray head ({rehearsal.names[rehearsal.hosts.head]})"
    if name.startswith("sandbox host"):
        return f"sandbox host {rehearsal.names.get(step.host, step.host)}"
    if name == "wait ray cluster":
        return "Ray cluster (every node joined)"
    if name == "submit":
        return "the job"
    return name


def _error_text(error: str) -> str:
    """The failure's first line and the last lines of the output it quotes."""
    lines = [line for line in error.splitlines() if line.strip()]
    if not lines:
        return ""
    head, tail = lines[0], lines[1:]
    errors = [line for line in tail if re.search(r"Error|error:|refused|Failed", line)]
    return head + (f" | {errors[-1].strip()}" if errors else "")


def _job_parts(job: JobConfig) -> list[str]:
    parts = ["rollout engines (generation)"]
    if job.algorithm.recipe in RECIPES_WITH_TEACHER:
        parts.append("teacher scoring")
    parts.append(SANDBOXES if job.rollout.harness == "swe" else "python tool")
    return [*parts, "training", "weight sync", "checkpoint"]


def _job_components(rehearsal: Rehearsal, outcome: Outcome, failure: str) -> list[Component]:
    """The job's parts, each up when its output shows it worked in every rollout."""
    job = rehearsal.job
    out = outcome.job
    rollouts = range(ROLLOUTS)
    checks: list[tuple[str, bool, str]] = []

    def each(table: dict[int, dict[str, float]], key: str) -> bool:
        return all(key in table.get(r, {}) for r in rollouts)

    def count(key: str) -> float:
        return sum(out.rollout.get(r, {}).get(key, 0.0) for r in rollouts)

    generated = each(out.rollout, "rollout/response_len/mean") and all(
        out.rollout[r]["rollout/response_len/mean"] > 0 for r in rollouts
    )
    checks.append(("rollout engines (generation)", generated, "tokens generated in every rollout"))
    if job.algorithm.recipe in RECIPES_WITH_TEACHER:
        errors = count("rollout/status_teacher_error")
        scored = each(out.rollout, "perf/teacher_time_per_turn") and errors == 0
        checks.append(
            (
                "teacher scoring",
                scored,
                "every turn scored" if scored else f"{errors:.0f} trajectories ended teacher_error",
            )
        )
    if any("rollout/hint_errors" in out.rollout.get(r, {}) for r in rollouts):
        errors = out.last("rollout", "rollout/hint_errors") or 0.0  # the run's so far
        critic = f" at {job.teacher.critic_url}" if job.teacher.critic_url else ""
        checks.append(
            (
                f"hints (teacher.hint {job.teacher.hint}{critic})",
                errors == 0,
                "every hint made" if errors == 0 else f"{errors:.0f} hint requests failed",
            )
        )
    if job.rollout.harness == "swe":
        errors = count("rollout/status_sandbox_error")
        acquired = out.last("rollout", "rollout/sandbox_acquired") or 0
        ok = acquired > 0 and errors == 0
        checks.append(
            (
                SANDBOXES,
                ok,
                f"{acquired:.0f} sandboxes opened"
                if ok
                else f"{acquired:.0f} opened, {errors:.0f} trajectories ended sandbox_error",
            )
        )
    else:
        checks.append(("python tool", each(out.rollout, "perf/sandbox_time_per_turn"), ""))
    checks.append(("training", each(out.train, "train/loss"), "a loss logged every rollout"))
    checks.append(("weight sync", each(out.perf, "perf/update_weights_time"), "after every step"))
    saved = _latest_checkpoint(job)
    checks.append(
        (
            "checkpoint",
            saved == ROLLOUTS - 1,
            f"saved through rollout {saved}" if saved is not None else "none saved",
        )
    )
    listed, blamed = [], False
    for name, ok, detail in checks:
        if ok:
            listed.append(Component(name, UP, detail))
        elif not blamed:
            listed.append(Component(name, DOWN, failure or detail or "no sign in the job's output"))
            blamed = True
        else:
            listed.append(Component(name, SKIPPED))
    if failure and not blamed:
        listed.append(Component("the job", DOWN, failure))
    return listed


def _latest_checkpoint(job: JobConfig) -> int | None:
    try:
        return int(Path(str(job.cluster.save_dir), "latest_checkpointed_iteration.txt").read_text())
    except (OSError, ValueError):
        return None


@dataclass
class Stage:
    name: str
    seconds: float | None
    detail: str


def stages(outcome: Outcome) -> list[Stage]:
    """Per stage, the last rollout's measured time (the first one warms up)."""
    out = outcome.job
    turns = out.last("rollout", "rollout/turns")

    def per_step(key: str) -> tuple[float | None, str]:
        per_turn = out.last("rollout", key)
        if per_turn is None or turns is None:
            return None, "not logged"
        return per_turn * turns, f"{per_turn:.3f} s per turn x {turns:.0f} turns"

    generation, generation_detail = per_step("perf/model_time_per_turn")
    teacher, teacher_detail = per_step("perf/teacher_time_per_turn")
    sandbox, sandbox_detail = per_step("perf/sandbox_time_per_turn")
    execs = out.last("rollout", "rollout/sandbox_exec_s_p50")
    if execs is not None:
        sandbox_detail += f"; a command's p50 {execs:.3f} s"
    return [
        Stage("generation", generation, generation_detail + " (trajectory-seconds)"),
        Stage("teacher scoring", teacher, teacher_detail),
        Stage("sandbox commands", sandbox, sandbox_detail),
        Stage("rollout (wall)", out.last("rollout", "perf/rollout_time"), "slime's rollout timer"),
        Stage("training", out.last("perf", "perf/train_time"), "log-probs and the train step"),
        Stage("weight sync", out.last("perf", "perf/update_weights_time"), "update_weights"),
        Stage("checkpoint", out.last("perf", "perf/save_model_time"), "save_model"),
        Stage("step (wall)", out.last("perf", "perf/step_time"), "slime's train wait + train"),
    ]


def parameters(path: str | Path) -> int | None:
    """A checkpoint's parameter count from its safetensors headers; None if unreadable."""
    total = 0
    files = sorted(Path(path).glob("*.safetensors"))
    for file in files:
        try:
            with open(file, "rb") as handle:
                (size,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(size))
        except (OSError, ValueError, struct.error):
            return None
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total or None


def active_parameters(path: str) -> tuple[float | None, str]:
    """The parameters one token's compute runs through, and where the figure comes from:
    the checkpoint's when readable here, else the size its name carries (`35B-A3B`: 3B
    active, `9B`)."""
    counted = parameters(path)
    if counted:
        return float(counted), "counted in its checkpoint"
    name = Path(path).name
    active = re.search(r"A(\d+(?:\.\d+)?)B", name)
    size = re.search(r"(\d+(?:\.\d+)?)B", name)
    if active:
        return float(active.group(1)) * 1e9, f"{active.group(1)}B active, from its name"
    if size:
        return float(size.group(1)) * 1e9, f"{size.group(1)}B, from its name"
    return None, "its size is unknown (not readable here, no size in its name)"


@dataclass
class Projection:
    seconds: float | None
    lines: list[str]


def project(rehearsal: Rehearsal, outcome: Outcome) -> Projection:
    """A full-scale step from the rehearsal's rates (module doc), each term with its
    assumption; None when a size it needs is unknown."""
    user, job = rehearsal.user, rehearsal.job
    out = outcome.job
    measured = {s.name: s.seconds for s in stages(outcome)}
    student_full, student_source = active_parameters(user.model.student)
    student_small = parameters(job.model.student)
    teacher_full, teacher_source = (
        active_parameters(user.teacher.model or user.model.student)
        if user.algorithm.recipe in RECIPES_WITH_TEACHER
        else (None, "")
    )
    teacher_small = parameters(job.teacher.model) if job.teacher.model else None
    trajectories = user.rollout.tasks_per_step * user.rollout.samples_per_task
    small_trajectories = job.rollout.tasks_per_step * job.rollout.samples_per_task
    turns = user.rollout.max_turns
    tokens_per_turn = user.rollout.max_new_tokens
    generated = min(turns * tokens_per_turn, user.rollout.max_context_tokens)
    small_generated = (out.last("rollout", "perf/loss_tokens") or 0) / small_trajectories
    lines = [
        f"a full step: {trajectories} trajectories (tasks_per_step x samples_per_task), "
        f"each up to {turns} turns of up to {tokens_per_turn} tokens, at most "
        f"{generated} generated tokens within max_context_tokens (a bound: every "
        "trajectory uses its whole budget)",
        f"student {user.model.student}: {_size(student_full)} ({student_source}); "
        f"rehearsal student {_size(student_small)}",
    ]
    if teacher_source:
        lines.append(
            f"teacher {user.teacher.model}: {_size(teacher_full)} ({teacher_source}); "
            f"rehearsal teacher {_size(teacher_small)}"
        )
    if not student_full or not student_small or not small_generated:
        lines.append(
            "no projection: "
            + (
                "the student's size is unknown"
                if not student_full
                else "the rehearsal measured no generated tokens"
            )
        )
        return Projection(None, lines)
    work = trajectories * generated / (small_trajectories * small_generated)
    student_scale = student_full / student_small
    gpus = user.parallel.world_size
    engine_gpus = gpus if user.parallel.colocate else (user.parallel.rollout_gpus or 1)
    terms: list[tuple[str, float | None, str]] = [
        (
            "generation",
            _scaled(measured.get("generation"), work * student_scale / engine_gpus),
            f"x {work:.3g} (tokens) x {student_scale:.3g} (parameters) / {engine_gpus} "
            "engine GPUs: throughput-bound",
        )
    ]
    if teacher_source:
        if teacher_full and teacher_small:
            teacher_scale = teacher_full / teacher_small
            tp = max(user.teacher.tp, 1)
            terms.append(
                (
                    "teacher scoring",
                    _scaled(measured.get("teacher scoring"), work * teacher_scale / tp),
                    f"x {work:.3g} (tokens) x {teacher_scale:.3g} (parameters) / teacher TP "
                    f"{tp}: throughput-bound",
                )
            )
        else:
            terms.append(("teacher scoring", None, "the teacher's size is unknown"))
    if user.rollout.harness == "swe":
        slots = min(user.rollout.concurrency, trajectories)
        if user.sandbox.hosts == "ray" and user.cluster.sandbox_hosts:
            slots = min(slots, len(user.cluster.sandbox_hosts) * user.sandbox.max_sandboxes)
        waves = math.ceil(trajectories / slots)
        command = out.last("rollout", "rollout/sandbox_exec_s_p50")
        terms.append(
            (
                "sandbox commands",
                _scaled(command, turns * waves),
                f"a command's p50 as measured, one per turn, {turns} turns, {trajectories} "
                f"trajectories {slots} at a time ({waves} wave(s))",
            )
        )
    # processed tokens per loss token: a trajectory's whole context once (packed), or
    # each turn's context again (per turn: about turns / 2 times that)
    layout = job.algorithm.sequence_layout
    full_ratio = user.rollout.max_context_tokens / generated
    if layout != "packed":
        full_ratio *= max(turns / 2, 1.0)
    small_ratio = out.last("rollout", "perf/processed_tokens_per_loss_token") or 1.0
    train_scale = work * student_scale / gpus * full_ratio / small_ratio
    terms.append(
        (
            "training",
            _scaled(measured.get("training"), train_scale),
            f"x {train_scale:.3g}: loss tokens x parameters / {gpus} training GPUs x "
            f"processed tokens per loss token ({layout}: {full_ratio:.3g} at full scale, "
            f"{small_ratio:.3g} here)",
        )
    )
    terms.append(
        (
            "weight sync",
            _scaled(measured.get("weight sync"), student_scale),
            f"x {student_scale:.3g}: bytes proportional to parameters, the same bandwidth",
        )
    )
    every = max(user.logging.save_every_steps, 1)
    terms.append(
        (
            "checkpoint",
            _scaled(measured.get("checkpoint"), student_scale / every),
            f"x {student_scale:.3g} / save_every_steps {every} (amortized per step)",
        )
    )
    known = [s for _, s, _ in terms if s is not None]
    total = sum(known) if len(known) == len(terms) else None
    for name, seconds, how in terms:
        shown = f"{seconds:,.0f} s" if seconds is not None else "unknown"
        share = f", {seconds / total:.0%} of the step" if total and seconds is not None else ""
        lines.append(f"{name}: {shown}{share} ({how})")
    lines.append(
        "assumed: the stages one after another, none overlapping (an upper bound); each "
        "rate linear in tokens and parameters"
    )
    return Projection(total, lines)


def _scaled(seconds: float | None, factor: float) -> float | None:
    return None if seconds is None else seconds * factor


def _size(count: float | None) -> str:
    if not count:
        return "unknown size"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit} parameters"
    return f"{count:.0f} parameters"


def render(rehearsal: Rehearsal, outcome: Outcome) -> tuple[str, bool]:
    """The report's text, and whether every component worked."""
    listed = components(rehearsal, outcome)
    ok = all(c.state == UP for c in listed)
    width = max(len(c.name) for c in listed)
    lines = ["", "components:"]
    for c in listed:
        lines.append(f"  {c.name.ljust(width)}  {c.state}" + (f": {c.why}" if c.why else ""))
    lines += ["", "what differs from your job here:"]
    lines += [f"  - {note}" for note in rehearsal.notes] or ["  - nothing"]
    if outcome.job_output:
        lines += ["", "stages (the last rollout):"]
        for stage in stages(outcome):
            shown = f"{stage.seconds:8.2f} s" if stage.seconds is not None else "       -  "
            lines.append(f"  {stage.name.ljust(18)} {shown}  {stage.detail}")
        projection = project(rehearsal, outcome)
        cpu = rehearsal.job.cluster.env.get(ENV_FLAG) == "1"
        rates = (
            "CPU rates of tiny models: the arithmetic and the shares only"
            if cpu
            else "tiny models run far below a large one's throughput: read the shares"
        )
        lines += ["", f"projected step at full scale ({rates}):"]
        lines += [f"  {line}" for line in projection.lines]
        total = f"{projection.seconds:,.0f} s" if projection.seconds is not None else "unknown"
        lines.append(f"  projected step time: {total}")
    lines += ["", f"the rehearsal's files: {rehearsal.directory}"]
    return "\n".join(lines) + "\n", ok
