"""Runs a launch plan (launch/plan.py) step by step on its hosts, stopping at the first
step that fails with the step, the host, the exit code and the end of its output.

Hosts are reached by ssh (`cluster.ssh_command` + host + command), by srun inside a Slurm
allocation, or locally. Background steps (Ray on every node, the teacher service) are
started with nohup, their output in run_dir/logs/<step>.log and their process in
run_dir/logs/<step>.pid ("PID START", START as `ps -o lstart=` prints it) on their host.

`stop` ends the background steps of a plan in reverse order, each only if the process in
its pid file is still the one it started (a reused pid is left alone): SIGTERM, up to
STOP_GRACE_S for it to exit (`ray start --block` stops the node's Ray on SIGTERM), then
SIGKILL. `run` stops what an earlier launch of the same run left before it starts, and
what it started itself when a step fails.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from launch.checks import check_tokenizers, local_tokenizer_identity
from launch.config import ConfigError, JobConfig
from launch.plan import Step, slug

Report = Callable[[str], None]
STOP_GRACE_S = 30
"""How long a daemon gets to exit on SIGTERM before SIGKILL."""


class LaunchError(RuntimeError):
    """A step of the plan failed; the steps after it were not run."""


class Executor:
    def __init__(
        self,
        job: JobConfig,
        report: Report = print,
        step_timeout_s: float = 3600.0,
        wait_timeout_s: float = 1800.0,
    ) -> None:
        self.job = job
        self.report = report
        self.step_timeout_s = step_timeout_s
        self.wait_timeout_s = wait_timeout_s
        self.log_dir = f"{job.logging.run_dir}/logs"

    def command_for(self, host: str, command: str) -> list[str]:
        """The local argv that runs `command` in a login shell on `host`."""
        cluster = self.job.cluster
        shell = list(cluster.remote_shell)
        if cluster.executor == "local" or host == "local":
            return [*shell, command]
        if cluster.executor == "srun":
            return ["srun", "--nodes=1", "--ntasks=1", "-w", host, *shell, command]
        return [*cluster.ssh_command, host, shlex.join([*shell, command])]

    def run(self, steps: list[Step], teardown_on_failure: bool = True) -> None:
        """Every step in order; first the leftovers of an earlier launch of this run are
        stopped, and when a step fails the daemons this launch started are."""
        self.stop(steps, quiet=True)
        for number, step in enumerate(steps, start=1):
            self.report(f"[{number}/{len(steps)}] {step.name} @ {step.host}")
            started = time.monotonic()
            try:
                self._run_step(step)
            except LaunchError as err:
                stopped = ""
                if teardown_on_failure and any(s.kind == "background" for s in steps[:number]):
                    self.stop(steps[:number])
                    stopped = " The daemons it had started were stopped."
                raise LaunchError(
                    f"step {number}/{len(steps)} '{step.name}' on {step.host} failed: {err}. "
                    f"Steps {number + 1}-{len(steps)} were not run.{stopped}"
                ) from None
            self.report(f"    done in {time.monotonic() - started:.1f} s")

    def stop(self, steps: list[Step], quiet: bool = False) -> list[str]:
        """Stop the plan's background steps that are running, last started first; what
        was stopped ("name @ host")."""
        stopped = []
        for step in reversed([s for s in steps if s.kind == "background"]):
            pid_file = shlex.quote(f"{self.log_dir}/{slug(step.name)}.pid")
            script = (
                f'f={pid_file}; [ -f "$f" ] || exit 3; read -r pid start < "$f"; '
                'if [ -n "$pid" ] && [ "$(ps -o lstart= -p "$pid" 2>/dev/null)" = "$start" ]; '
                'then kill -TERM "$pid"; '
                f'for i in $(seq {STOP_GRACE_S}); do kill -0 "$pid" 2>/dev/null || break; '
                'sleep 1; done; kill -KILL "$pid" 2>/dev/null; rm -f "$f"; exit 0; fi; '
                'rm -f "$f"; exit 3'
            )
            try:
                done = subprocess.run(
                    self.command_for(step.host, script),
                    capture_output=True,
                    text=True,
                    timeout=STOP_GRACE_S + 60,
                    check=False,
                )
            except (subprocess.TimeoutExpired, OSError) as err:
                self.report(f"    could not stop {step.name} @ {step.host}: {err}")
                continue
            if done.returncode == 0:
                stopped.append(f"{step.name} @ {step.host}")
                self.report(f"stopped {step.name} @ {step.host}")
            elif done.returncode != 3 and not quiet:
                tail = (done.stderr or done.stdout).strip()[-500:]
                self.report(f"    could not stop {step.name} @ {step.host}: {tail}")
        return stopped

    def _run_step(self, step: Step) -> None:
        if step.kind == "write":
            path = Path(step.command)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(step.content)
            return
        if step.kind == "wait_http":
            self._wait(step.command)
            return
        if step.kind == "check_tokenizer":
            self._check_tokenizer(step.command)
            return
        command = step.command
        if step.kind == "background":
            log = f"{self.log_dir}/{slug(step.name)}.log"
            pid_file = shlex.quote(f"{self.log_dir}/{slug(step.name)}.pid")
            # two statements: `a && b &` would background a subshell holding our pipes
            command = (
                f"mkdir -p {shlex.quote(self.log_dir)} || exit 1; nohup {command} > "
                f"{shlex.quote(log)} 2>&1 < /dev/null & "
                f'echo "$! $(ps -o lstart= -p $!)" > {pid_file}'
            )
        try:
            done = subprocess.run(
                self.command_for(step.host, command),
                capture_output=True,
                text=True,
                timeout=self.step_timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise LaunchError(f"no exit within {self.step_timeout_s:.0f} s") from None
        except OSError as err:
            raise LaunchError(
                f"could not start {self.command_for(step.host, '')[0]}: {err}"
            ) from None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip()[-2000:]
            raise LaunchError(f"exit code {done.returncode}\n{tail}")

    def _wait(self, url: str) -> None:
        deadline = time.monotonic() + self.wait_timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            try:
                response = httpx.get(url, timeout=5.0)
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as err:
                last = f"{type(err).__name__}: {err}"
            time.sleep(1.0)
        raise LaunchError(f"{url} did not answer 200 within {self.wait_timeout_s:.0f} s ({last})")

    def _check_tokenizer(self, info_url: str) -> None:
        student = local_tokenizer_identity(self.job.model.tokenizer or self.job.model.student)
        if student is None:
            self.report("    the student's tokenizer is not readable here: not compared")
            return
        try:
            teacher = httpx.get(info_url, headers=self._auth(), timeout=30.0).json()["tokenizer"]
        except (httpx.HTTPError, KeyError, ValueError) as err:
            raise LaunchError(f"no tokenizer identity from {info_url}: {err}") from None
        try:
            check_tokenizers(student, teacher)
        except ConfigError as err:
            raise LaunchError(str(err)) from None

    def _auth(self) -> dict[str, str]:
        name = self.job.teacher.api_key_env
        key = os.environ.get(name) if name else None
        return {"Authorization": f"Bearer {key}"} if key else {}
