"""The self-teacher's snapshot on a cluster: follow slime's checkpoints, reload the teacher.

In the local trainer an OPSD self-teacher in mode `ema` or `refresh` takes the student's
weights in process. On a cluster the student lives in slime's Megatron shards, so
`opd-teacher sync` runs on the teacher node next to `opd-teacher serve`: it watches slime's
save directory (shared storage), converts the checkpoints of the steps it needs to HF with
a converter command (slime's tools/convert_torch_dist_to_hf.py by default), and has the
service serve them through its authenticated POST /v1/reload.

- refresh: at each refresh step the teacher serves the converted checkpoint of that step.
- ema: the teacher serves a running average of the checkpoints saved every `ema_every`
  steps, starting from the initial weights: ema = decay**k * ema + (1 - decay**k) * w,
  k the steps since the previous checkpoint, kept in fp32 safetensors on the CPU. This is
  an EMA over saved checkpoints, not the local trainer's per-step EMA: with the same decay
  the weight each step's student gets is the same only when the student moves linearly
  between checkpoints.

The teacher switches while training goes on: the checkpoint of step s is written after
step s, and converting and reloading take minutes, so the first turns of the following
step(s) are scored by the previous snapshot (the local trainer swaps between steps).

Megatron names the checkpoint of iteration i `iter_{i:07d}` and writes
`latest_checkpointed_iteration.txt` once it is complete; slime saves the checkpoint after
step s (1-based) as iteration s - 1. A directory is used only when the tracker names its
iteration or a later one, so a checkpoint still being written is never read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import shutil
import string
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from teacher_server.client import TeacherClient, TeacherError, TeacherUnauthorized

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's file naming the latest complete checkpoint in a save directory."""
INDEX = "model.safetensors.index.json"
CONVERTER_FIELDS = frozenset({"input_dir", "output_dir", "origin_hf_dir", "vocab_size"})
T = TypeVar("T")


class SyncError(RuntimeError):
    """The sync cannot go on; the message says what failed and what to fix."""


def refresh_steps(refresh_at: Sequence[float], steps: int) -> list[int]:
    """The steps after which a refresh snapshot takes the student's weights: for each
    fraction f the step s with (s - 1) / steps < f <= s / steps, the first whose end
    reaches f. The local trainer and the cluster sync both refresh at these steps."""
    return sorted(
        {s for s in range(1, steps + 1) for f in refresh_at if (s - 1) / steps < f <= s / steps}
    )


def snapshot_steps(
    mode: Literal["ema", "refresh"], steps: int, refresh_at: Sequence[float], ema_every: int
) -> list[int]:
    """The steps whose checkpoints the cluster sync needs: the local trainer's snapshot
    steps but the last step of the job (no rollout is scored after it)."""
    if mode == "refresh":
        taken = refresh_steps(refresh_at, steps)
    else:
        taken = list(range(ema_every, steps + 1, ema_every))
    return [s for s in taken if s < steps]


def slime_converter(slime_dir: str, megatron_dir: str) -> str:
    """slime's Megatron torch_dist -> HF converter as a `converter` template, run from
    slime's checkout as its docs do, with slime itself on PYTHONPATH too (the script does
    not put it there; slime's image has it installed). --vocab-size cuts the rows Megatron
    padded the vocabulary with."""
    pythonpath = shlex.quote(f"{megatron_dir}:{slime_dir}")
    return (
        f"cd {shlex.quote(slime_dir)} && PYTHONPATH={pythonpath} python3 "
        "tools/convert_torch_dist_to_hf.py --input-dir {input_dir} --output-dir {output_dir} "
        "--origin-hf-dir {origin_hf_dir} --vocab-size {vocab_size}"
    )


def converter_problem(template: str) -> str | None:
    """What is wrong with a converter template, if anything."""
    try:
        fields = _template_fields(template)
    except ValueError as err:
        return f"{template!r} is not a template: {err}"
    if {"input_dir", "output_dir"} <= fields <= CONVERTER_FIELDS:
        return None
    return (
        f"{template!r} needs {{input_dir}} and {{output_dir}} and may name only "
        f"{', '.join('{' + f + '}' for f in sorted(CONVERTER_FIELDS))}"
    )


def checkpoint_dir(save_dir: Path, step: int) -> Path:
    """Where slime saves the checkpoint taken after `step` (Megatron iteration step - 1)."""
    return save_dir / f"iter_{step - 1:07d}"


def saved_iteration(save_dir: Path) -> int | None:
    """The latest complete checkpoint's iteration, None before the first."""
    tracker = save_dir / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise SyncError(
            f"{tracker} holds {text!r}, not an iteration: cluster.save_dir must be the run's "
            "own save directory (--save), not a release checkpoint"
        )
    return int(text)


class SyncConfig(BaseModel):
    """What `opd-teacher sync` follows and where it writes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["ema", "refresh"]
    teacher_url: str
    """The teacher service's base URL (on its node: http://127.0.0.1:PORT)."""
    api_key: str = Field(min_length=1, repr=False)
    """The service's API key: /v1/reload answers only to it."""
    save_dir: Path
    """slime's --save directory (shared storage the teacher node reads)."""
    work_dir: Path
    """Converted and averaged checkpoints, the state file and the converter's logs."""
    origin_hf_dir: Path
    """The student's initial HF checkpoint: the converter's config and tokenizer, and the
    EMA's starting point (the snapshot the teacher serves first)."""
    steps: int = Field(ge=1)
    """Training steps of the job (slime's --num-rollout)."""
    refresh_at: list[float] = Field(default_factory=lambda: [0.2, 0.4, 0.6, 0.8])
    """refresh: fractions of training in (0, 1]."""
    ema_decay: float = Field(default=0.99, gt=0.0, lt=1.0)
    """ema: per-step decay; between checkpoints k steps apart it is decay**k."""
    ema_every: int = Field(default=5, ge=1)
    """ema: steps between the checkpoints averaged in (the teacher's sync interval)."""
    converter: str
    """Shell command template converting one checkpoint: {input_dir} (the iter_ dir) and
    {output_dir} (which must not exist) are required; {origin_hf_dir} and {vocab_size}
    (the initial config's) are filled in when used. Values are shell-quoted."""
    reload_attempts: int = Field(default=5, ge=1)
    """Tries of one reload before the sync gives up (and exits non-zero)."""
    reload_backoff_s: float = Field(default=10.0, ge=0.0)
    """Wait after the first failed try; doubled after each further one."""
    reload_timeout_s: float = Field(default=1800.0, gt=0.0)
    """Deadline of one reload request (the service loads the whole model)."""
    poll_interval_s: float = Field(default=30.0, gt=0.0)
    """How often the save directory is looked at."""

    @model_validator(mode="after")
    def _usable(self) -> SyncConfig:
        if problem := converter_problem(self.converter):
            raise ValueError(problem)
        wrong = [f for f in self.refresh_at if not 0 < f <= 1]
        if self.mode == "refresh" and (wrong or not self.refresh_at):
            raise ValueError(f"refresh_at {self.refresh_at}: give fractions of training in (0, 1]")
        if not self.needed_steps():
            raise ValueError(
                f"no snapshot step before the last step {self.steps} (a snapshot after it "
                "scores nothing): lower ema_every or refresh_at"
            )
        if not (self.origin_hf_dir / "config.json").is_file():
            raise ValueError(f"origin_hf_dir {self.origin_hf_dir}: no HF checkpoint (config.json)")
        if self.mode == "ema" and not _weight_files(self.origin_hf_dir):
            raise ValueError(
                f"origin_hf_dir {self.origin_hf_dir}: no *.safetensors weights, where the EMA "
                "starts (save the initial checkpoint with safetensors)"
            )
        return self

    def needed_steps(self) -> list[int]:
        return snapshot_steps(self.mode, self.steps, self.refresh_at, self.ema_every)

    def schedule(self) -> dict[str, Any]:
        """What a work directory's state belongs to: a restart must follow the same."""
        keys = {"mode", "steps", "save_dir"}
        keys |= {"refresh_at"} if self.mode == "refresh" else {"ema_decay", "ema_every"}
        return self.model_dump(mode="json", include=keys)


class SyncState(BaseModel):
    """The work directory's record (state.json): what the teacher serves and since when."""

    schedule: dict[str, Any]
    applied: list[int] = Field(default_factory=list)
    """Steps whose snapshot the teacher took, in order."""
    current: str | None = None
    """The directory the teacher serves (None: the initial weights)."""


class SnapshotSync:
    """Applies the needed steps in order; `run` until the last is applied."""

    def __init__(self, config: SyncConfig) -> None:
        self.config = config
        self.work_dir = config.work_dir.resolve()
        self.state_path = self.work_dir / "state.json"
        self.state = self._load_state()
        self._waiting_for: tuple[int, int | None] | None = None

    def pending(self) -> list[int]:
        return [s for s in self.config.needed_steps() if s not in self.state.applied]

    def run(self) -> None:
        """Restore the teacher's snapshot after a restart, then follow the checkpoints."""
        logger.info(
            "%s sync of %s: steps %s, %d to go",
            self.config.mode,
            self.config.save_dir,
            self.config.needed_steps(),
            len(self.pending()),
        )
        self.restore()
        while not self.apply_ready():
            time.sleep(self.config.poll_interval_s)
        logger.info("done: the teacher serves %s", self.state.current)

    def restore(self) -> None:
        """A restarted service serves its initial weights: give it the current snapshot."""
        current = self.state.current
        if current is None:
            return
        info = self._call_teacher("info", lambda client: client.info())
        if info.model != current:
            logger.info("the teacher serves %s; reloading %s", info.model, current)
            self._call_teacher("reload", lambda client: client.reload(current))

    def apply_ready(self) -> bool:
        """Apply every pending step whose checkpoint is complete; True once none is left."""
        for step in self.pending():
            if not self._ready(step):
                return False
            self._apply(step)
        return True

    def _ready(self, step: int) -> bool:
        directory = checkpoint_dir(self.config.save_dir, step)
        latest = saved_iteration(self.config.save_dir)
        if latest is None or latest < step - 1:
            if self._waiting_for != (step, latest):
                logger.info("waiting for step %d (%s); latest saved: %s", step, directory, latest)
                self._waiting_for = (step, latest)
            return False
        if not directory.is_dir():
            raise SyncError(
                f"the checkpoint of step {step} ({directory}) was never saved (the latest is "
                f"iteration {latest}): slime's --save-interval must divide every step the "
                f"sync needs ({self.config.needed_steps()}), and checkpoints must stay until used"
            )
        return True

    def _apply(self, step: int) -> None:
        started = time.monotonic()
        converted = self._convert(step)
        served = converted if self.config.mode == "refresh" else self._average(step, converted)
        self._call_teacher("reload", lambda client: client.reload(str(served)))
        self.state.applied.append(step)
        self.state.current = str(served)
        self._save_state()
        for kind in ("converted", "ema"):
            for old in (self.work_dir / kind).glob("step_*"):
                if old != served:
                    shutil.rmtree(old)
        logger.info(
            "step %d: the teacher serves %s (%.0f s)", step, served, time.monotonic() - started
        )

    def _convert(self, step: int) -> Path:
        """The step's checkpoint as HF, from an earlier run when it got that far."""
        target = self.work_dir / "converted" / f"step_{step:05d}"
        if target.is_dir():
            return target
        scratch = self._scratch(target.name)
        values = {
            "input_dir": checkpoint_dir(self.config.save_dir, step),
            "output_dir": scratch,
            "origin_hf_dir": self.config.origin_hf_dir,
        }
        quoted = {k: shlex.quote(str(v)) for k, v in values.items()}
        if "vocab_size" in _template_fields(self.config.converter):
            quoted["vocab_size"] = str(self._vocab_size())
        command = self.config.converter.format(**quoted)
        log_path = self.work_dir / "logs" / f"convert_step_{step:05d}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("step %d: converting %s", step, values["input_dir"])
        with log_path.open("w") as log:
            done = subprocess.run(["bash", "-c", command], stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            tail = log_path.read_text()[-2000:]
            raise SyncError(
                f"converting step {step} failed (exit {done.returncode}; {log_path}):\n{tail}"
            )
        if not (scratch / "config.json").is_file() or not _weight_files(scratch):
            raise SyncError(
                f"the converter exited 0 but {scratch} holds no HF checkpoint (config.json and "
                f"*.safetensors); its output is in {log_path}"
            )
        return self._publish(scratch, target)

    def _average(self, step: int, converted: Path) -> Path:
        """The EMA after this step's checkpoint, from an earlier run when it got that far."""
        target = self.work_dir / "ema" / f"step_{step:05d}"
        if target.is_dir():
            return target
        previous_step = self.state.applied[-1] if self.state.applied else 0
        previous = Path(self.state.current or self.config.origin_hf_dir)
        decay = self.config.ema_decay ** (step - previous_step)
        logger.info("step %d: averaging into %s with decay %.6g", step, previous, decay)
        scratch = self._scratch(target.name)
        fresh = average_checkpoints(previous, converted, scratch, decay)
        if fresh:
            logger.warning(
                "step %d: %d tensors absent from %s start at the checkpoint's values: %s",
                step,
                len(fresh),
                previous,
                fresh[:5],
            )
        return self._publish(scratch, target)

    def _scratch(self, name: str) -> Path:
        """An empty directory to write into; published by a rename once complete."""
        scratch = self.work_dir / "tmp" / name
        shutil.rmtree(scratch, ignore_errors=True)  # left by a run that was killed
        scratch.parent.mkdir(parents=True, exist_ok=True)
        return scratch

    def _publish(self, scratch: Path, target: Path) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch.rename(target)
        return target

    def _vocab_size(self) -> int:
        config = json.loads((self.config.origin_hf_dir / "config.json").read_text())
        size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
        if not isinstance(size, int):
            raise SyncError(
                f"{self.config.origin_hf_dir}/config.json names no vocab_size for the "
                "converter's {vocab_size}: drop it from the converter command"
            )
        return size

    def _call_teacher(self, what: str, call: Callable[[TeacherClient], Awaitable[T]]) -> T:
        """One teacher call, retried with backoff; a wrong key is not retried."""

        async def once() -> T:
            config = self.config
            async with TeacherClient(
                config.teacher_url, config.api_key, timeout_s=config.reload_timeout_s
            ) as client:
                return await call(client)

        attempts, attempt = self.config.reload_attempts, 1
        while True:
            try:
                return asyncio.run(once())
            except TeacherUnauthorized as err:
                raise SyncError(
                    f"the teacher refused the API key ({err}): start the sync with the key "
                    "the service was started with (OPD_TEACHER_API_KEY)"
                ) from err
            except TeacherError as err:
                if attempt >= attempts:
                    raise SyncError(
                        f"teacher {what} at {self.config.teacher_url} failed {attempts} times; "
                        f"last: {err}"
                    ) from err
                delay = self.config.reload_backoff_s * 2 ** (attempt - 1)
                logger.warning(
                    "teacher %s failed (try %d/%d): %s; again in %.0f s",
                    what,
                    attempt,
                    attempts,
                    err,
                    delay,
                )
                time.sleep(delay)
                attempt += 1

    def _load_state(self) -> SyncState:
        schedule = self.config.schedule()
        if not self.state_path.is_file():
            return SyncState(schedule=schedule)
        state = SyncState.model_validate_json(self.state_path.read_text())
        if state.schedule != schedule:
            raise SyncError(
                f"{self.work_dir} belongs to another sync ({state.schedule}), not {schedule}: "
                "give this one its own work directory"
            )
        return state

    def _save_state(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        partial = self.state_path.with_suffix(".json.tmp")
        partial.write_text(self.state.model_dump_json(indent=2))
        os.replace(partial, self.state_path)


def _template_fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def _weight_files(directory: Path) -> list[str]:
    """The safetensors files of an HF checkpoint, per its index when it has one."""
    index = directory / INDEX
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return sorted(p.name for p in directory.glob("*.safetensors"))


def _copy_assets(source: Path, target: Path) -> None:
    """Config, tokenizer and the rest of an HF directory, without its weights."""
    target.mkdir(parents=True)
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != INDEX:
            shutil.copy2(path, target / path.name)


def average_checkpoints(previous: Path, checkpoint: Path, out: Path, decay: float) -> list[str]:
    """Write the HF directory `out` = decay * previous + (1 - decay) * checkpoint, tensor by
    tensor in fp32, one safetensors file at a time (a 35B model never sits in memory
    whole), with the checkpoint's files, config and tokenizer. Integer tensors are taken
    from the checkpoint; returns the tensors absent from `previous` (taken as they are)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    _copy_assets(checkpoint, out)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    fresh: list[str] = []
    with ExitStack() as stack:
        earlier: dict[str, Any] = {}
        for name in _weight_files(previous):
            handle = stack.enter_context(safe_open(previous / name, "pt", device="cpu"))
            earlier.update(dict.fromkeys(handle.keys(), handle))
        for name in _weight_files(checkpoint):
            averaged: dict[str, torch.Tensor] = {}
            with safe_open(checkpoint / name, "pt", device="cpu") as handle:
                for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    weight = handle.get_tensor(key)
                    if not weight.is_floating_point():
                        averaged[key] = weight
                        continue
                    if key not in earlier:
                        fresh.append(key)
                        averaged[key] = weight.float()
                        continue
                    before = earlier[key].get_tensor(key)
                    if before.shape != weight.shape:
                        raise SyncError(
                            f"{key}: {tuple(weight.shape)} in {checkpoint}, "
                            f"{tuple(before.shape)} in {previous}; a vocabulary Megatron "
                            "padded needs the converter's --vocab-size"
                        )
                    averaged[key] = before.float() * decay + weight.float() * (1 - decay)
            weight_map.update(dict.fromkeys(averaged, name))
            total_bytes += sum(t.numel() * t.element_size() for t in averaged.values())
            save_file(averaged, str(out / name), metadata={"format": "pt"})
    if (checkpoint / INDEX).is_file():
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2))
    return fresh
