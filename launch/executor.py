"""Runs a launch plan (launch/plan.py) step by step on its hosts, stopping at the first
step that fails with the step, the host, the exit code and the end of its output.

Hosts are reached by ssh (`cluster.ssh_command` + host + command), by srun inside a Slurm
allocation, or locally. Background steps (the teacher service) are started with nohup,
their output in run_dir/logs/<step>.log on their host.
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

    def run(self, steps: list[Step]) -> None:
        for number, step in enumerate(steps, start=1):
            self.report(f"[{number}/{len(steps)}] {step.name} @ {step.host}")
            started = time.monotonic()
            try:
                self._run_step(step)
            except LaunchError as err:
                raise LaunchError(
                    f"step {number}/{len(steps)} '{step.name}' on {step.host} failed: {err}. "
                    f"Steps {number + 1}-{len(steps)} were not run."
                ) from None
            self.report(f"    done in {time.monotonic() - started:.1f} s")

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
            # two statements: `a && b &` would background a subshell holding our pipes
            command = (
                f"mkdir -p {shlex.quote(self.log_dir)} || exit 1; nohup {command} > "
                f"{shlex.quote(log)} 2>&1 < /dev/null &"
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
