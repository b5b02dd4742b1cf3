"""Runs a rehearsal (launch/rehearsal.py) through the launch's own plan and executor, and
collects what the report reads: the step that failed, if one did, and the job's output."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from launch.plan import Step, build_plan, slug
from launch.rehearsal import Rehearsal, place_here, port_problems

STEP_LINE = re.compile(r"^\[(\d+)/(\d+)\] ")
RAY_TOKEN = Path.home() / ".ray/auth_token"


@dataclass
class Outcome:
    """What a rehearsal's run left for its report."""

    steps: list[Step]
    reached: int = 0
    """How many steps started (the last of them failed when `error` is set)."""
    error: str | None = None
    refused: list[tuple[str, str]] = field(default_factory=list)
    """(component, why) found before anything started: nothing ran."""
    step_seconds: dict[str, float] = field(default_factory=dict)
    job_output: str = ""


def run(rehearsal: Rehearsal, report: Callable[[str], None], timeout_s: float = 1800.0) -> Outcome:
    """The plan of the rehearsal's job, run to its end (its daemons stopped after)."""
    from launch.executor import Executor, LaunchError

    steps = place_here(build_plan(rehearsal.job, rehearsal.hosts, wait_for_job=True), rehearsal)
    outcome = Outcome(steps)
    outcome.refused = port_problems(rehearsal)
    if outcome.refused:
        return outcome
    started: dict[str, float] = {}

    def follow(line: str) -> None:
        report(line)
        if STEP_LINE.match(line):
            outcome.reached += 1
            if steps[outcome.reached - 1].name == "submit":
                report(f"    the job's output: {rehearsal.log_dir / 'submit.log'}")
        elif line.startswith("    done in ") and outcome.reached:
            name = steps[outcome.reached - 1].name
            started[name] = float(line.split()[2])

    executor = Executor(
        rehearsal.job, report=follow, step_timeout_s=timeout_s, wait_timeout_s=300, watch_s=5
    )
    with _environment(rehearsal):
        try:
            executor.run(steps, until_done=True)
        except LaunchError as err:
            outcome.error = str(err)
        finally:
            shutil.rmtree(f"/tmp/opd-rh-{os.getpid()}", ignore_errors=True)
    outcome.step_seconds = started
    submit = rehearsal.log_dir / f"{slug('submit')}.log"
    if submit.is_file():
        outcome.job_output = submit.read_text(errors="replace")
    return outcome


@contextmanager
def _environment(rehearsal: Rehearsal) -> Iterator[None]:
    """The teacher's key the rehearsal made (the steps and the executor read it by name)
    and Ray's token auth where this machine has a token (Ray then requires it)."""
    added = {}
    name = rehearsal.job.teacher.api_key_env
    if rehearsal.api_key and name:
        added[name] = rehearsal.api_key
    if RAY_TOKEN.exists() and "RAY_AUTH_MODE" not in os.environ:
        added |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(RAY_TOKEN)}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
