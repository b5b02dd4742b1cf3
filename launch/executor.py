"""Runs a launch plan (launch/plan.py) step by step on its hosts, stopping at the first
step that fails with the step, the host, the exit code and the end of its output.

Hosts are reached by ssh (`cluster.ssh_command` + host + command), by srun inside a Slurm
allocation, or locally. Background steps (Ray on every node, the teacher service) are
started with nohup, their output in run_dir/logs/<step>.log and their process in
run_dir/logs/<step>.pid ("PID START", START as `ps -o lstart=` prints it) on their host.

`stop` ends the background steps of a plan, all at once, each only if the process in its
pid file is still the one it started (a reused pid is left alone): SIGTERM, up to
STOP_GRACE_S for it to exit (`ray start --block` stops the node's Ray on SIGTERM), then
SIGKILL. `run` stops what an earlier launch of the same run left before it starts, and
what it started itself when a step fails or is interrupted (Ctrl-C), or, with
`until_done`, when the last step (the job, submitted and followed) ends.

While a step runs, the daemons started before it are checked every `watch_s` seconds: one
that ended (its host lost, its process killed) fails the step at once, instead of leaving
it to time out on a dead service; one the job goes on without (a sandbox host:
`Step.needed` False) is reported once and the step goes on. Before the job itself (the
plan's last step) runs, a daemon with `Step.restarts` left is started again instead, the
end of its log reported as the reason (its earlier log kept beside it as <step>.log.<n>).
A foreground step's output goes to run_dir/logs/<step>.log here, where the launch runs.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from launch.check_teacher import check as check_teacher
from launch.plan import Step, context_budget, slug
from slime_ext.job.config import ConfigError, JobConfig

Report = Callable[[str], None]
STOP_GRACE_S = 30
"""How long a daemon gets to exit on SIGTERM before SIGKILL."""
STOP_AT_ONCE = 16
"""Daemons stopped at the same time (each over its own ssh or srun)."""
WATCH_S = 15.0
"""How often the daemons are checked while a step runs."""
FORGET_SSH = "unset SSH_CLIENT SSH2_CLIENT"
"""Run before a daemon starts: with these set, every `bash -c` the daemon's processes run
(Ray starts each worker through one) takes itself for an ssh session and reads ~/.bashrc,
and a ~/.bashrc that activates an environment (pyenv, conda) puts its python3 before the
one `ray start` ran with: the Ray job then runs without this package."""
LEFT_GRACE_S = 10
"""How long a stopped daemon's descendants get to exit after it before SIGKILL."""
STOP_TREE = (
    # "PID START" of each descendant of $pid, from one `ps` (procps', as on any Linux node)
    'kids=$(ps -e -o pid= -o ppid= -o lstart= | awk -v root="$pid" '
    '\'{ up[$1] = $2; at[$1] = $3 " " $4 " " $5 " " $6 " " $7 } END { for (k in up) '
    "{ q = up[k]; while (q in up && q != root) q = up[q]; if (q == root) print k, at[k] } }'); "
    # those of them still the same process (pid and start) and not a zombie
    'alive() { ps -e -o pid= -o stat= -o lstart= | KIDS="$kids" awk '
    '\'function at(f, i) { return f[i] " " f[i+1] " " f[i+2] " " f[i+3] " " f[i+4] } '
    'BEGIN { n = split(ENVIRON["KIDS"], line, "\\n"); for (i = 1; i <= n; i++) '
    'if (split(line[i], a, " ") == 6) want[a[1] " " at(a, 2)] = 1 } '
    '{ split($0, b, " "); key = b[1] " " at(b, 3) } '
    "b[2] !~ /^Z/ && key in want { print b[1] }'; }; "
    'kill -TERM "$pid"; '
    f'for i in $(seq {STOP_GRACE_S * 5}); do kill -0 "$pid" 2>/dev/null || break; '
    'sleep 0.2; done; kill -KILL "$pid" 2>/dev/null; '
    f'for i in $(seq {LEFT_GRACE_S * 2}); do [ -z "$(alive)" ] && break; sleep 0.5; done; '
    'for k in $(alive); do kill -KILL "$k" 2>/dev/null; done; rm -f "$f"; exit 0'
)
"""The stop of a daemon whose pid file is still its own (`_pid_script`'s `then`)."""
GONE = 3
"""The exit status of the remote pid-file scripts when the process is not (any longer) the
one started."""


class LaunchError(RuntimeError):
    """A step of the plan failed; the steps after it were not run."""


class Executor:
    def __init__(
        self,
        job: JobConfig,
        report: Report = print,
        step_timeout_s: float | None = None,
        wait_timeout_s: float = 1800.0,
        watch_s: float = WATCH_S,
    ) -> None:
        self.job = job
        self.report = report
        self.step_timeout_s = step_timeout_s
        """None: a step may run as long as its daemons live (the followed job)."""
        self.wait_timeout_s = wait_timeout_s
        self.watch_s = watch_s
        self.log_dir = f"{job.logging.run_dir}/logs"
        self._lost: list[Step] = []
        """The daemons the job goes on without (Step.needed False) reported ended."""
        self._restarted: dict[str, int] = {}
        """How often each daemon (by name and host) was started again."""
        self._starting = False
        """Whether the step running comes before the job (daemons may be restarted)."""

    def command_for(self, host: str, command: str) -> list[str]:
        """The local argv that runs `command` in a login shell on `host`."""
        cluster = self.job.cluster
        shell = list(cluster.remote_shell)
        if cluster.executor == "local" or host == "local":
            return [*shell, command]
        if cluster.executor == "srun":
            return ["srun", "--nodes=1", "--ntasks=1", "-w", host, *shell, command]
        return [*cluster.ssh_command, host, shlex.join([*shell, command])]

    def run(
        self, steps: list[Step], teardown_on_failure: bool = True, until_done: bool = False
    ) -> None:
        """Every step in order; first the leftovers of an earlier launch of this run are
        stopped, and when a step fails (or Ctrl-C) the daemons this launch started are.
        until_done: the last step is the job itself (followed to its end), and the daemons
        are stopped after it too."""
        self.stop(steps, quiet=True)
        for number, step in enumerate(steps, start=1):
            self.report(f"[{number}/{len(steps)}] {step.name} @ {step.host}")
            started = time.monotonic()
            daemons = [s for s in steps[: number - 1] if s.kind == "background"]
            self._starting = number < len(steps)
            try:
                self._run_step(step, [s for s in daemons if not s.ends_itself])
            except LaunchError as err:
                stopped = ""
                if teardown_on_failure and any(s.kind == "background" for s in steps[:number]):
                    self.stop(steps[:number])
                    stopped = " The daemons it had started were stopped."
                rest = (
                    f" Steps {number + 1}-{len(steps)} were not run." if number < len(steps) else ""
                )
                raise LaunchError(
                    f"step {number}/{len(steps)} '{step.name}' on {step.host} failed: {err}."
                    f"{rest}{stopped}"
                ) from None
            except KeyboardInterrupt:
                if teardown_on_failure:
                    self.report("interrupted: stopping the daemons this launch started")
                    self.stop(steps[:number])
                raise
            self.report(f"    done in {time.monotonic() - started:.1f} s")
        if until_done:
            self.report("the job ended: stopping its daemons")
            self.stop(steps)

    def stop(self, steps: list[Step], quiet: bool = False) -> list[str]:
        """Stop the plan's background steps that are running, all at once (at most
        STOP_AT_ONCE in flight: each waits up to STOP_GRACE_S for its process to exit, and
        a node's Ray takes seconds to); reported last started first. What was stopped
        ("name @ host")."""
        daemons = list(reversed([s for s in steps if s.kind == "background"]))
        if not daemons:
            return []
        with ThreadPoolExecutor(max_workers=min(len(daemons), STOP_AT_ONCE)) as pool:
            outcomes = list(pool.map(self._stop_one, daemons))
        stopped = []
        for step, outcome in zip(daemons, outcomes, strict=True):
            if isinstance(outcome, Exception):
                self.report(f"    could not stop {step.name} @ {step.host}: {outcome}")
            elif outcome.returncode == 0:
                stopped.append(f"{step.name} @ {step.host}")
                self.report(f"stopped {step.name} @ {step.host}")
            elif outcome.returncode != GONE and not quiet:
                tail = (outcome.stderr or outcome.stdout).strip()[-500:]
                self.report(f"    could not stop {step.name} @ {step.host}: {tail}")
        return stopped

    def _stop_one(self, step: Step) -> subprocess.CompletedProcess[str] | Exception:
        """SIGTERM to the daemon's process if it is still the one started, up to
        STOP_GRACE_S for it to exit (checked 5 times a second), then SIGKILL; then the
        processes it had started (its descendants when it was signalled, each still the
        same process) get up to LEFT_GRACE_S to follow it before SIGKILL: Ray's agents
        outlive a `ray start --block` that a loaded node's shutdown made us kill."""
        script = self._pid_script(step, STOP_TREE)
        try:
            return subprocess.run(
                self.command_for(step.host, script),
                capture_output=True,
                text=True,
                timeout=STOP_GRACE_S + LEFT_GRACE_S + 60,
                check=False,
            )
        except (subprocess.TimeoutExpired, OSError) as err:
            return err

    def _pid_script(self, step: Step, then: str) -> str:
        """A remote script: `then` runs when the process in the step's pid file is still
        the one started (exit GONE otherwise, the stale pid file removed)."""
        pid_file = shlex.quote(f"{self.log_dir}/{slug(step.name)}.pid")
        return (
            f'f={pid_file}; [ -f "$f" ] || exit {GONE}; read -r pid start < "$f"; '
            # an empty START: the process had ended before its pid file was written
            'if [ -n "$pid" ] && [ -n "$start" ] && '
            '[ "$(ps -o lstart= -p "$pid" 2>/dev/null)" = "$start" ]; '
            f'then {then}; fi; rm -f "$f"; exit {GONE}'
        )

    def ended_daemon(self, daemons: list[Step]) -> Step | None:
        """The first of `daemons` whose process is gone from its host, if any; a host that
        does not answer (ssh failed) does not count as gone."""
        for step in daemons:
            try:
                done = subprocess.run(
                    self.command_for(step.host, self._pid_script(step, "exit 0")),
                    capture_output=True,
                    timeout=60,
                    check=False,
                )
            except (subprocess.TimeoutExpired, OSError):
                continue
            if done.returncode == GONE:
                return step
        return None

    def _check_daemons(self, daemons: list[Step]) -> None:
        """Raise when a daemon the job needs ended; report (once) one it goes on without.
        Before the job, a daemon with restarts left is started again instead."""
        spare = [s for s in daemons if not s.needed and s not in self._lost]
        lost = self.ended_daemon(spare) if spare else None
        if lost is not None and self._restart(lost):
            lost = None
        if lost is not None:
            self._lost.append(lost)
            self.report(
                f"    the daemon '{lost.name}' on {lost.host} ended (its log: {self.log_dir}/"
                f"{slug(lost.name)}.log on {lost.host}); the job goes on without it"
            )
        ended = self.ended_daemon([s for s in daemons if s.needed])
        if ended is not None and self._restart(ended):
            ended = None
        if ended is not None:
            times = self._restarted.get(f"{ended.name}@{ended.host}", 0)
            again = f", after {times} restart{'s' * (times > 1)}" if times else ""
            raise LaunchError(
                f"the daemon '{ended.name}' on {ended.host} ended while this step ran "
                f"(its log: {self.log_dir}/{slug(ended.name)}.log on {ended.host}{again})"
            )

    def _restart(self, step: Step) -> bool:
        """Start the ended daemon `step` again if it may be (before the job, restarts
        left), reporting why it ended (its log's last lines) and keeping that log."""
        key = f"{step.name}@{step.host}"
        done = self._restarted.get(key, 0)
        if not self._starting or done >= step.restarts:
            return False
        self._restarted[key] = done + 1
        log = shlex.quote(f"{self.log_dir}/{slug(step.name)}.log")
        reason = "its log could not be read"
        try:
            tail = subprocess.run(
                self.command_for(step.host, f"tail -n 3 {log}; mv -f {log} {log}.{done + 1}"),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            lines = [line.strip() for line in tail.stdout.splitlines() if line.strip()]
            reason = " | ".join(lines)[-500:] or "its log is empty"
        except (subprocess.TimeoutExpired, OSError) as err:
            reason = f"its log could not be read: {err}"
        self.report(
            f"    the daemon '{step.name}' on {step.host} ended before the job started "
            f"({reason}); starting it again ({done + 1} of {step.restarts}; its log: "
            f"{self.log_dir}/{slug(step.name)}.log.{done + 1} on {step.host})"
        )
        self._run_step(step, [])
        return True

    def _run_step(self, step: Step, daemons: list[Step]) -> None:
        if step.kind == "write":
            path = Path(step.command)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(step.content)
            return
        if step.kind == "wait_http":
            self._wait(step.command, daemons)
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
                f"mkdir -p {shlex.quote(self.log_dir)} || exit 1; {FORGET_SSH}; nohup {command} > "
                f"{shlex.quote(log)} 2>&1 < /dev/null & "
                f'echo "$! $(ps -o lstart= -p $!)" > {pid_file}'
            )
        output = Path(self.log_dir) / f"{slug(step.name)}.log"
        if step.kind == "background":
            output = output.with_suffix(".start.log")  # the daemon's own log is on its host
        output.parent.mkdir(parents=True, exist_ok=True)
        with output.open("w") as sink:
            try:
                process = subprocess.Popen(
                    self.command_for(step.host, command),
                    stdin=subprocess.DEVNULL,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # stopped as a group: ssh or srun and its children
                )
            except OSError as err:
                raise LaunchError(
                    f"could not start {self.command_for(step.host, '')[0]}: {err}"
                ) from None
            try:
                code = self._follow(process, daemons)
            except BaseException:
                _stop_group(process)
                raise
        if code != 0:
            tail = output.read_text(errors="replace").strip()[-2000:]
            raise LaunchError(f"exit code {code} (its output: {output})\n{tail}")

    def _follow(self, process: subprocess.Popen[bytes], daemons: list[Step]) -> int:
        """The step's exit status; LaunchError when it outlives the step timeout or a
        daemon ends meanwhile."""
        started = time.monotonic()
        next_check = started + self.watch_s
        while True:
            try:
                return process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if self.step_timeout_s is not None and now - started > self.step_timeout_s:
                raise LaunchError(f"no exit within {self.step_timeout_s:.0f} s")
            if daemons and now >= next_check:
                self._check_daemons(daemons)
                next_check = time.monotonic() + self.watch_s

    def _wait(self, url: str, daemons: list[Step]) -> None:
        deadline = time.monotonic() + self.wait_timeout_s
        next_check = time.monotonic() + self.watch_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            if daemons and time.monotonic() >= next_check:
                self._check_daemons(daemons)
                next_check = time.monotonic() + self.watch_s
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
        """The running service against the job: its tokenizer is the student's, and it
        accepts the job's longest turn (launch/check_teacher.py, as the batch script)."""
        student = self.job.model.tokenizer or self.job.model.student
        key = self._auth().get("Authorization", "").removeprefix("Bearer ") or None
        try:
            self.report("    " + check_teacher(info_url, student, key, context_budget(self.job)))
        except (RuntimeError, ConfigError) as err:
            raise LaunchError(str(err)) from None

    def _auth(self) -> dict[str, str]:
        name = self.job.teacher.api_key_env
        key = os.environ.get(name) if name else None
        return {"Authorization": f"Bearer {key}"} if key else {}


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the step's process group (ssh or srun and what it started here), then
    SIGKILL after a grace period."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
