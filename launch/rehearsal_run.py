"""Runs a rehearsal (launch/rehearsal.py) through the launch's own plan and executor, and
collects what the report reads: the step that failed, if one did, and the job's output."""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launch.plan import Step, build_plan, hosts_from_config, slug
from launch.rehearsal import Rehearsal, place_here, port_problems, wanted_ports

STEP_LINE = re.compile(r"^\[(\d+)/(\d+)\] ")
PERF_LINE = re.compile(r"perf (\d+): (\{.*\})")
TRAIN_LINE = re.compile(r"step (\d+): (\{.*\})")
LOST_LINE = re.compile(r"^    the daemon '([^']+)' on \S+ ended .*; the job goes on without it$")
RESTART_LINE = re.compile(
    r"^    the daemon '([^']+)' on \S+ ended before the job started \((.*)\); starting it again"
)
RAY_TOKEN = Path.home() / ".ray/auth_token"


@dataclass
class JobOutput:
    """What the job logged, per rollout id."""

    rollout: dict[int, dict[str, float]] = field(default_factory=dict)
    perf: dict[int, dict[str, float]] = field(default_factory=dict)
    train: dict[int, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> JobOutput:
        out = cls()
        for pattern, kind in ((PERF_LINE, "perf"), (TRAIN_LINE, "step")):
            for match in pattern.finditer(text):
                try:
                    values = ast.literal_eval(match.group(2))
                except (ValueError, SyntaxError):
                    continue
                if not isinstance(values, dict):
                    continue
                rollout_id = int(match.group(1))
                numbers = {k: float(v) for k, v in values.items() if _number(v)}
                if kind == "step":
                    out.train.setdefault(rollout_id, {}).update(numbers)
                elif any(key.startswith("rollout/") for key in numbers):
                    out.rollout.setdefault(rollout_id, {}).update(numbers)
                else:
                    out.perf.setdefault(rollout_id, {}).update(numbers)
        return out

    def last(self, table: str, key: str) -> float | None:
        """`key` in the latest rollout that logged it (the warm one)."""
        rows: dict[int, dict[str, float]] = getattr(self, table)
        for rollout_id in sorted(rows, reverse=True):
            if key in rows[rollout_id]:
                return rows[rollout_id][key]
        return None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class Outcome:
    """What a rehearsal's run left for its report."""

    steps: list[Step]
    reached: int = 0
    """How many steps started (the last of them failed when `error` is set)."""
    error: str | None = None
    refused: list[tuple[str, str]] = field(default_factory=list)
    """(component, why) found before anything started: nothing ran."""
    checked: list[tuple[str, str]] = field(default_factory=list)
    """(component, how) that passed those checks (the nodes reached)."""
    step_seconds: dict[str, float] = field(default_factory=dict)
    lost: dict[str, str] = field(default_factory=dict)
    """A daemon the job went on without (a sandbox host) -> the launch's line about it."""
    restarted: dict[str, list[str]] = field(default_factory=dict)
    """A daemon started again before the job (a node's `ray start` that timed out on a
    loaded node) -> why it had ended, each time: up, if it then stayed up."""
    job_output: str = ""

    def read(self, line: str) -> None:
        """Take in one line of the launch's report."""
        if STEP_LINE.match(line):
            self.reached += 1
        elif lost := LOST_LINE.match(line):
            self.lost[lost[1]] = line.strip()
        elif again := RESTART_LINE.match(line):
            self.restarted.setdefault(again[1], []).append(again[2])
        elif line.startswith("    done in ") and self.reached:
            self.step_seconds[self.steps[self.reached - 1].name] = float(line.split()[2])

    @functools.cached_property
    def job(self) -> JobOutput:
        """`job_output` parsed (once)."""
        return JobOutput.parse(self.job_output)


def run(rehearsal: Rehearsal, report: Callable[[str], None], timeout_s: float = 1800.0) -> Outcome:
    """The plan of the rehearsal's job, run to its end (its daemons stopped after)."""
    from launch.executor import Executor, LaunchError

    steps = build_plan(rehearsal.job, rehearsal.hosts, wait_for_job=True)
    if rehearsal.on == "here":
        steps = place_here(steps, rehearsal)
    outcome = Outcome(steps)
    if rehearsal.on == "here":
        outcome.refused = port_problems(rehearsal)
    else:
        outcome.refused = node_problems(rehearsal, outcome.checked)
    if outcome.refused:
        return outcome

    def follow(line: str) -> None:
        report(line)
        outcome.read(line)
        if STEP_LINE.match(line) and steps[outcome.reached - 1].name == "submit":
            report(f"    the job's output: {rehearsal.log_dir / 'submit.log'}")

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
    submit = rehearsal.log_dir / f"{slug('submit')}.log"
    if submit.is_file():
        outcome.job_output = submit.read_text(errors="replace")
    return outcome


PROBE_TIMEOUT_S = 60
PORT_PROBE = (
    "import socket, sys; s = socket.socket(); "
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('', int(sys.argv[1])))"
)


def node_problems(
    rehearsal: Rehearsal, checked: list[tuple[str, str]] | None = None
) -> list[tuple[str, str]]:
    """(component, why) for each node of the config this machine cannot reach through the
    job's executor, then (all reached) each port a daemon needs that is taken there; the
    nodes reached go to `checked`."""
    from launch.executor import Executor

    user = rehearsal.user
    hosts = hosts_from_config(user)
    roles = {hosts.head: f"training node {hosts.head} (the head)"}
    roles |= {worker: f"training node {worker}" for worker in hosts.workers}
    if rehearsal.hosts.teacher:
        roles.setdefault(rehearsal.hosts.teacher, f"teacher node {rehearsal.hosts.teacher}")
    roles |= {host: f"sandbox host {host}" for host in hosts.sandbox}
    cluster = rehearsal.job.cluster
    ssh = list(cluster.ssh_command)
    if ssh and Path(ssh[0]).name == "ssh":  # a dead node fails in seconds, not minutes
        ssh += ["-o", "ConnectTimeout=10"]
    probe = Executor(
        rehearsal.job.model_copy(
            update={"cluster": cluster.model_copy(update={"ssh_command": ssh})}
        )
    )

    def answer(host: str, command: str) -> str | None:
        """None when `command` ends 0 on `host`, else what went wrong."""
        try:
            done = subprocess.run(
                probe.command_for(host, command),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return f"no answer within {PROBE_TIMEOUT_S} s"
        except OSError as err:
            return str(err)
        if done.returncode == 0:
            return None
        lines = (done.stderr or done.stdout).strip().splitlines()
        return f"exit {done.returncode}" + (f": {lines[-1]}" if lines else "")

    with ThreadPoolExecutor(max_workers=8) as pool:
        reached = dict(zip(roles, pool.map(lambda h: answer(h, "true"), roles), strict=True))
    problems = [
        (roles[host], f"unreachable through cluster.executor {cluster.executor} ({why})")
        for host, why in reached.items()
        if why is not None
    ]
    if checked is not None:
        checked += [(roles[host], "reachable") for host, why in reached.items() if why is None]
    if problems:
        return problems
    for component, host, port in wanted_ports(rehearsal):
        why = answer(host, f"python3 -c {shlex.quote(PORT_PROBE)} {port}")
        if why is not None:
            problems.append(
                (
                    component,
                    f"port {port} on {host} cannot be bound ({why}): stop what holds "
                    "it, or set another port in the config",
                )
            )
    return problems


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
