"""A local run's directory: a checkpoint per save step (the newest few kept), the settings
the run was started with, and how a run resumes, starts over, or refuses to resume.

    run_dir/config.yaml               the resolved job config (as `opd config show` prints
                                      it); comments on top record changes accepted on resume
    run_dir/checkpoints/step_00004/   model, tokenizer, trainer.pt (optimizer, LR schedule,
                                      sampler RNG, next step): the newest
                                      logging.keep_checkpoints of them
    run_dir/checkpoint                a link to the newest, for readers (`--policy run_dir/
                                      checkpoint`)
    run_dir/previous-<time>/          what --fresh, or resuming from an earlier step, moved
                                      out of the way (nothing is deleted)
"""

from __future__ import annotations

import difflib
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from slime_ext.job.config import ConfigError, JobConfig, config_from_dict, config_to_yaml

CHECKPOINTS = "checkpoints"
LATEST = "checkpoint"
"""The link to the newest checkpoint; before per-step checkpoints, the only checkpoint."""
CONFIG_FILE = "config.yaml"
PREVIOUS = "previous-"
CACHES = ("models",)
"""Not the run's output (factory models built from the config): stays on --fresh."""

SAFE_CHANGES: dict[str, str] = {
    "logging.run_dir": "where the run lives: a moved run directory is the same run",
    "logging.wandb_mode": "where metrics are mirrored, not what is trained",
    "logging.wandb_project": "where metrics are mirrored, not what is trained",
    "logging.wandb_group": "where metrics are mirrored, not what is trained",
    "logging.wandb_entity": "where metrics are mirrored, not what is trained",
    "logging.log_every_steps": "how often metrics are logged",
    "logging.save_every_steps": "how often checkpoints are written",
    "logging.keep_checkpoints": "how many checkpoints are kept",
    "logging.save_trajectories": "what is written to disk, not what is trained",
    "logging.eval_every_steps": "when the student is evaluated, not what it is trained on",
    "rollout.concurrency": "how many trajectories run at once, not which ones",
    "algorithm.steps": "where the run ends, with a constant LR schedule and no teacher "
    "refreshes (else refused: the steps left would train otherwise)",
    "cluster": "the cluster job's nodes and launch: `opd train` does not use them",
}
"""Settings a run may resume with changed, and why; any other change is refused unless
named with --allow-changed. A key or a whole section."""


class RunDirError(ValueError):
    """The run directory cannot be used as asked. The first line says what was refused, the
    others list the problems and what to do."""


@dataclass(frozen=True)
class ResumeOptions:
    """How a run starts in a directory that may hold an earlier one."""

    fresh: bool = False
    """Move the directory's earlier run aside and start at step 0."""
    from_step: int | None = None
    """Resume from this kept checkpoint; None: the newest."""
    allow_changed: tuple[str, ...] = ()
    """Settings (section.key) that may differ from the recorded ones on resume."""


@dataclass(frozen=True)
class Start:
    """Where a run starts: a checkpoint (None: the initial model), and what to tell the
    user about it (changes accepted, files moved aside)."""

    checkpoint: Path | None
    notes: tuple[str, ...]


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step_{step:05d}"


def kept_steps(run_dir: Path) -> list[int]:
    """The steps with a complete checkpoint, oldest first."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(
        int(path.name[5:])
        for path in root.iterdir()
        if path.name.startswith("step_")
        and path.name[5:].isdigit()
        and (path / "trainer.pt").is_file()
    )


def write_checkpoint(run_dir: Path, step: int, write: Callable[[Path], None], keep: int) -> Path:
    """`write(directory)` into a staging directory, renamed to the step's checkpoint when
    complete; the `checkpoint` link moves to it; checkpoints beyond the newest `keep` go."""
    target = step_dir(run_dir, step)
    staging = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write(staging)
    if target.exists():  # the step is redone after a resume from before it
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old)
    else:
        os.replace(staging, target)
    _link_latest(run_dir, step)
    for stale in kept_steps(run_dir)[:-keep]:
        shutil.rmtree(step_dir(run_dir, stale))
    return target


def _link_latest(run_dir: Path, step: int) -> None:
    link = run_dir / f".{LATEST}.link"
    link.unlink(missing_ok=True)
    link.symlink_to(step_dir(run_dir, step).relative_to(run_dir))
    os.replace(link, run_dir / LATEST)  # atomic: a reader sees the old or the new one


def open_run(run_dir: Path, job: JobConfig, options: ResumeOptions) -> Start:
    """Prepare `run_dir` for `job`: move an earlier run aside (fresh), pick the checkpoint
    to resume from, and record the settings, refusing changed ones (RunDirError)."""
    check_allowed_keys(job, options.allow_changed)
    run_dir.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    if options.fresh and (moved := set_aside(run_dir, None)) is not None:
        notes.append(f"--fresh: the earlier run in {run_dir} was moved to {moved}")
    _migrate_single_checkpoint(run_dir)
    steps = kept_steps(run_dir)
    step = steps[-1] if steps else None
    if options.from_step is not None:
        if options.from_step not in steps:
            kept = ", ".join(map(str, steps)) if steps else "none"
            raise RunDirError(
                f"cannot resume {run_dir} from step {options.from_step}: no checkpoint of "
                f"that step\n  kept checkpoints: {kept} (the newest logging.keep_checkpoints "
                f"are kept; in {run_dir / CHECKPOINTS})"
            )
        step = options.from_step
    if step is None:
        _write_config(run_dir, job, [], fresh=True)
        return Start(None, tuple(notes))
    notes += _check_settings(run_dir, job, step, options.allow_changed)
    if step < steps[-1] and (moved := set_aside(run_dir, step)) is not None:
        notes.append(f"the run after step {step} (checkpoints, trajectories) was moved to {moved}")
    return Start(step_dir(run_dir, step), tuple(notes))


def set_aside(run_dir: Path, after_step: int | None) -> Path | None:
    """Move the run's output into run_dir/previous-<time>/: all of it (None), or what comes
    after `after_step` (later checkpoints and teacher snapshots, the trajectories of the
    steps to redo, a copy of metrics.jsonl, the W&B run id so that W&B starts a new run).
    Returns the folder, or None when there was nothing to move."""
    if after_step is None:
        moving = [
            path
            for path in run_dir.iterdir()
            if path.name not in CACHES and not path.name.startswith(PREVIOUS)
        ]
    else:
        moving = [step_dir(run_dir, s) for s in kept_steps(run_dir) if s > after_step]
        moving += _numbered(run_dir / "teacher_snapshots", lambda s: s > after_step)
        moving += _numbered(run_dir / "trajectories", lambda s: s >= after_step)
        moving += [run_dir / "wandb_run_id"] if (run_dir / "wandb_run_id").is_file() else []
    if not moving:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder, n = run_dir / f"{PREVIOUS}{stamp}", 1
    while folder.exists():
        n += 1
        folder = run_dir / f"{PREVIOUS}{stamp}-{n}"
    for path in moving:
        destination = folder / path.relative_to(run_dir)
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, destination)
    if after_step is not None:
        if (run_dir / "metrics.jsonl").is_file():  # the run truncates it to the resumed step
            shutil.copy2(run_dir / "metrics.jsonl", folder / "metrics.jsonl")
        _link_latest(run_dir, after_step)
    return folder


def _numbered(folder: Path, moves: Callable[[int], bool]) -> list[Path]:
    """The step_<n>[.jsonl] entries of `folder` whose step `moves`."""
    if not folder.is_dir():
        return []
    entries = [(path.name[5:].split(".")[0], path) for path in folder.glob("step_*")]
    return sorted(path for step, path in entries if step.isdigit() and moves(int(step)))


def _migrate_single_checkpoint(run_dir: Path) -> None:
    """A run directory from before per-step checkpoints: its one `checkpoint/` becomes
    checkpoints/step_<its step>/ and `checkpoint` the link to it."""
    single = run_dir / LATEST
    if single.is_symlink() or not (single / "trainer.pt").is_file():
        return
    step = int(torch.load(single / "trainer.pt", weights_only=False)["step"])
    target = step_dir(run_dir, step)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(single, target)
    _link_latest(run_dir, step)


def _flat(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"algorithm.lr": 1e-4, ...}: every setting under its dotted key."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def settings_of(job: JobConfig) -> dict[str, Any]:
    """Every setting of a job under its dotted key."""
    return _flat(job.model_dump(mode="json"))


def check_allowed_keys(job: JobConfig, allowed: Sequence[str]) -> None:
    known = settings_of(job)
    unknown = [key for key in allowed if key not in known]
    if unknown:
        problems = []
        for key in unknown:
            hint = difflib.get_close_matches(key, list(known), n=1)
            problems.append(
                f"  --allow-changed {key}: no such setting"
                + (f"; did you mean {hint[0]}?" if hint else " (name it as section.key)")
            )
        raise RunDirError("unknown settings in --allow-changed\n" + "\n".join(problems))


def safe_reason(key: str, safe: Mapping[str, str] = SAFE_CHANGES) -> str | None:
    """Why changing `key` is safe (a key or its section named in `safe`), or None."""
    for name, reason in safe.items():
        if key == name or key.startswith(name + "."):
            return reason
    return None


def steps_problem(job: JobConfig, step: int) -> str | None:
    """Why changing algorithm.steps changes the steps still to train, if it does."""
    if job.algorithm.steps < step:
        return f"the checkpoint is at step {step}: nothing would be left to train"
    if job.algorithm.lr_schedule != "constant":
        return (
            f"the {job.algorithm.lr_schedule} LR schedule decays over algorithm.steps: the "
            "steps left would train at other rates"
        )
    if job.teacher.kind == "self" and job.teacher.snapshot == "refresh":
        return "teacher.snapshot refresh takes the student's weights at fractions of the steps"
    return None


def compare_settings(
    before: Mapping[str, Any],
    job: JobConfig,
    step: int,
    allowed: Sequence[str],
    safe: Mapping[str, str] = SAFE_CHANGES,
) -> tuple[list[str], dict[str, str]]:
    """The changes from `before` (settings by dotted key) to `job`'s: those accepted (named
    in `allowed`, or safe by `safe` and, for algorithm.steps, `steps_problem`), and those
    refused, by key, each a line saying what changed (and why it is not safe)."""
    now = settings_of(job)
    accepted, refused = [], {}
    for key in sorted(set(before) | set(now)):
        if before.get(key) == now.get(key):
            continue
        change = f"{key}: {before.get(key)!r} -> {now.get(key)!r}"
        problem = steps_problem(job, step) if key == "algorithm.steps" else None
        if key in allowed:
            accepted.append(f"{change} (--allow-changed)")
        elif (reason := safe_reason(key, safe)) is not None and problem is None:
            accepted.append(f"{change} (safe: {reason})")
        else:
            refused[key] = f"  {change}" + (f" ({problem})" if problem else "")
    return accepted, refused


def _check_settings(run_dir: Path, job: JobConfig, step: int, allowed: Sequence[str]) -> list[str]:
    """Compare `job` with the run's recorded settings: refuse what changed unless it is safe
    or allowed; record the new settings with a note per change; the notes to print."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        _write_config(run_dir, job, [f"step {step}: resumed a run that had recorded no settings"])
        return [
            f"{run_dir} had recorded no settings (a run from before {CONFIG_FILE}): recorded "
            f"these in {path}"
        ]
    accepted, refused = compare_settings(recorded_settings(path), job, step, allowed)
    if refused:
        flags = " ".join(f"--allow-changed {key}" for key in refused)
        raise RunDirError(
            f"cannot resume {run_dir}: it holds a run with other settings ({path})\n"
            + "\n".join(refused.values())
            + f"\nstart over in it with --fresh (the earlier run is moved to "
            f"{run_dir / PREVIOUS}<time>/), pass another logging.run_dir, or resume with "
            f"the new settings anyway: {flags}"
        )
    if accepted:
        _write_config(run_dir, job, [f"step {step}: {change}" for change in accepted])
    return [f"resuming with a changed setting: {change}" for change in accepted]


def recorded_settings(path: Path) -> dict[str, Any]:
    """The settings in config.yaml, with the defaults of keys added since filled in."""
    data = yaml.safe_load(path.read_text())
    try:
        return settings_of(config_from_dict(data, source=str(path)))
    except ConfigError:  # a key since removed or renamed: compare what was written
        return _flat(data)


def _write_config(run_dir: Path, job: JobConfig, notes: list[str], fresh: bool = False) -> None:
    """config.yaml: the settings under a header of notes (those of a run that goes on are
    kept)."""
    path = run_dir / CONFIG_FILE
    kept = []
    if not fresh and path.is_file():
        kept = [line for line in path.read_text().splitlines() if line.startswith("# step ")]
    header = [
        "# the settings of this run (`opd train`); resuming compares against them",
        *kept,
        *(f"# {note}" for note in notes),
    ]
    staging = path.with_name(f".{CONFIG_FILE}.tmp")
    staging.write_text("\n".join(header) + "\n" + config_to_yaml(job))
    os.replace(staging, path)
