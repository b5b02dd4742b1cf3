"""PythonWorker: the TIR python tool, one persistent interpreter per trajectory.

A trajectory calls python up to 16 times and later cells use names earlier cells
defined, so one worker (python_worker_child.py) lives in a LocalSandbox for the whole
trajectory, with numpy and sympy imported once at start. Inside it a supervisor talks to
this host and a separate process runs each cell. User code never holds the reply channel;
a call ends when the process that ran its cell has exited (the supervisor waits for it,
it does not take that process's word), with that process's exit status as the call's exit
code, and its output is what was written to that call's own pipes. So no cell can end its
call while the process running it lives, keep anything running between calls (the cells'
process is stopped then and every other process it left is killed), or forge or
desynchronize a reply. The replies are still checked here (a malformed frame ends the
worker with a SandboxDiedError; the next call starts afresh).

What one interpreter cannot prevent, as in any notebook kernel: a cell can rewrite the
interpreter its own later cells run in (builtins, the worker's own functions, the process
it hands its state to), so a trajectory can sabotage its own later calls: their code not
run, their output made up, exit code 0. That reaches no other trajectory, the host, or
the protocol: each of those calls still ends only when its process has.

Each call has a wall-clock deadline: RLIMIT_CPU would accumulate over the calls of one
process, so the deadline is the host's, and a call that passes it kills the worker and
everything it started. So does an output flood. Work a call leaves behind is stopped when
it ends: its child processes are killed, its threads die with the process that ran it
(the namespace lives on in a single-threaded fork), and between calls the cells' process
is stopped (SIGSTOP). A crash (segfault, os._exit) loses the names defined so far. The
next call runs in a fresh worker and says so (`worker_restarted`); so does a call that the
cells' process could no longer take (a cell broke what receives requests), which runs in a
fresh one.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sandbox.base import ExecResult, LimitName, SandboxDiedError, SandboxStartError, StartsAndCloses
from sandbox.jail import limit_from_exit
from sandbox.local import LocalSandbox, LocalSandboxConfig, warn_once
from sandbox.output import HeadTailBuffer, OutputBudget, pump
from sandbox.process import SandboxProcess

CHILD_SCRIPT = Path(__file__).with_name("python_worker_child.py")
FRAME_HEADER = struct.Struct("!cI")
"""Must match python_worker_child.FRAME_HEADER (that file imports nothing of ours)."""
FRAME_KINDS = (b"o", b"e", b"r")
MAX_FRAME_BYTES = 1 << 20
SINGLE_THREADED_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""Thousands of workers share the host's cores; BLAS thread pools would oversubscribe
them, reserve address space per thread, and count against the process cap (threads are
processes to RLIMIT_NPROC)."""


class PythonWorkerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sandbox: LocalSandboxConfig = Field(default_factory=LocalSandboxConfig)
    """Isolation and limits of the sandbox the worker runs in; its `env` may override
    SINGLE_THREADED_ENV."""
    python: str | None = None
    """Interpreter to run; default: this process's. Strict isolation mounts its prefixes
    read-only; basic isolation starts it as root, which mounts the import paths the
    sandbox uid cannot reach (a venv under /root), and nothing beside them, in a private
    mount namespace and drops to the uid before anything else runs (a host that refuses
    the namespace refuses such an interpreter, saying why)."""
    preload_modules: list[str] = Field(default_factory=lambda: ["numpy", "sympy"])
    """Imported once per worker start, so cells that import them pay nothing."""
    echo_last_expression: bool = True
    """Print a cell's trailing expression like a notebook does (sys.displayhook)."""
    start_timeout_s: float = Field(default=60.0, gt=0)
    """Deadline for a worker to start and import preload_modules."""


class WorkerExecResult(ExecResult):
    worker_restarted: bool = False
    """A fresh worker ran this call: names defined by earlier calls are gone."""
    restart_reason: str | None = None
    """Why the previous worker ended (deadline, crash, flood), when worker_restarted."""
    worker_died: bool = False
    """This call ended the worker; the next call runs in a fresh one."""


class _Ready(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    ready: Literal[True]
    preload_errors: dict[str, str]


class _CallEnd(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    exit_code: int = Field(ge=0, le=255)
    state_lost: bool
    """The cells' process did not survive the call; the supervisor forked a fresh one."""
    reason: str | None
    restarted: str | None = None
    """Why the call ran in a fresh cells' process: the one holding the state could not
    take it."""


class _Cell:
    """One call's output and its end, as the worker's frames deliver them."""

    def __init__(self, head_bytes: int, tail_bytes: int, budget_bytes: int) -> None:
        self.out = HeadTailBuffer(head_bytes, tail_bytes)
        self.err = HeadTailBuffer(head_bytes, tail_bytes)
        self.budget = OutputBudget(budget_bytes)
        self.reply: bytes | None = None
        self.protocol_error: str | None = None
        self.finished = asyncio.Event()

    def feed(self, kind: bytes, payload: bytes) -> None:
        if kind == b"r":
            self.reply = payload
            self.finished.set()
            return
        (self.out if kind == b"o" else self.err).feed(payload)
        self.budget.spend(len(payload))
        if self.budget.exceeded.is_set():
            self.finished.set()


class _Route:
    """Delivers the worker's frames to the call in progress; a frame with no call to take
    it breaks the protocol."""

    def __init__(self) -> None:
        self.cell: _Cell | None = None
        self.protocol_error: str | None = None

    def deliver(self, kind: bytes, payload: bytes) -> None:
        if self.cell is None or self.cell.reply is not None:
            self.fail(f"a {kind!r} frame came between calls")
        else:
            self.cell.feed(kind, payload)

    def fail(self, error: str) -> None:
        self.protocol_error = self.protocol_error or error
        if self.cell is not None and self.cell.reply is None:
            self.cell.protocol_error = self.protocol_error
            self.cell.finished.set()

    def end(self) -> None:
        if self.cell is not None:
            self.cell.finished.set()


async def _read_frames(stream: asyncio.StreamReader, route: _Route) -> None:
    """Read the worker's frames for its lifetime."""
    try:
        while True:
            kind, size = FRAME_HEADER.unpack(await stream.readexactly(FRAME_HEADER.size))
            if kind not in FRAME_KINDS or size > MAX_FRAME_BYTES:
                route.fail(f"a frame of kind {kind!r} and {size:,} bytes")
                return
            route.deliver(kind, await stream.readexactly(size))
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            route.fail(f"a frame cut off after {len(exc.partial)} bytes")
    finally:
        route.end()


def _interpreter_path(python: str) -> Path:
    """`python` as the sandbox must name it: absolute, its directory with no `..` or
    symlink in it (a launch as `../.venv/bin/python` names a directory the sandbox does not
    mount), the binary itself kept (a venv's python is a link whose target is outside the
    venv)."""
    executable = Path(shutil.which(python) or python).absolute()
    return Path(os.path.realpath(executable.parent)) / executable.name


def _interpreter_roots(python: str) -> list[Path]:
    """Directories `python` needs (its venv, the prefix its binary belongs to), which
    strict isolation mounts read-only."""
    executable = _interpreter_path(python)
    roots = {executable.parent.parent, Path(os.path.realpath(executable)).parent.parent}
    venv_config = executable.parent.parent / "pyvenv.cfg"
    try:
        for line in venv_config.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home":
                roots.add(Path(value.strip()).parent)
    except OSError:
        pass  # not a venv
    return sorted(root for root in roots if root != Path("/") and root.is_dir())


class PythonWorker(StartsAndCloses):
    """Runs python cells in one persistent namespace inside a LocalSandbox."""

    def __init__(self, config: PythonWorkerConfig | None = None) -> None:
        self.config = config or PythonWorkerConfig()
        self.sandbox = LocalSandbox(self.config.sandbox)
        self._proc: SandboxProcess | None = None
        self._route = _Route()
        self._log = HeadTailBuffer(2048, 2048)
        self._readers: list[asyncio.Task[None]] = []
        self._restart_reason: str | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    async def start(self) -> None:
        async with self._lock:
            await self.sandbox.start()
            if self._proc is None:
                await self._launch()

    def _new_cell(self) -> _Cell:
        keep_head = self.config.sandbox.output_head_kb * 1024
        keep_tail = self.config.sandbox.output_tail_kb * 1024
        return _Cell(keep_head, keep_tail, int(self.config.sandbox.max_output_mb * 1024 * 1024))

    async def _launch(self) -> None:
        sandbox = self.sandbox
        options = {
            "echo_last_expression": self.config.echo_last_expression,
            "preload_modules": self.config.preload_modules,
            "drop_to_uid": sandbox.uid if sandbox.isolation == "basic" else None,
        }
        python = str(_interpreter_path(self.config.python or sys.executable))
        command = [python, "-I", str(CHILD_SCRIPT), json.dumps(options)]
        env = {k: v for k, v in SINGLE_THREADED_ENV.items() if k not in self.config.sandbox.env}
        ro_files = [CHILD_SCRIPT, *_interpreter_roots(python)]
        proc = await sandbox.spawn(command, env=env, ro_files=ro_files, privileged_start=True)
        self._route = _Route()
        self._log = HeadTailBuffer(2048, 2048)
        cell = self._route.cell = self._new_cell()
        self._readers = [
            asyncio.create_task(_read_frames(proc.stdout, self._route)),
            asyncio.create_task(pump(proc.stderr, self._log, OutputBudget(sys.maxsize))),
        ]
        try:
            await asyncio.wait_for(cell.finished.wait(), self.config.start_timeout_s)
        except asyncio.TimeoutError:
            await self._discard(proc)
            raise SandboxStartError(
                f"the python worker did not start within {self.config.start_timeout_s} s: "
                f"{self._log.text()}"
            ) from None
        try:
            ready = _Ready.model_validate_json(cell.reply or b"")
        except ValidationError:
            exit_code = await self._discard(proc)
            raise SandboxStartError(
                f"the python worker exited while starting (exit code {exit_code}): "
                f"{cell.protocol_error or ''}{self._log.text()}"
            ) from None
        if ready.preload_errors:
            warn_once(f"python worker could not preload {ready.preload_errors}")
        self._proc = proc

    async def _discard(self, proc: SandboxProcess) -> int:
        """Kill the worker and all it started, collect its last output; its exit code."""
        await self.sandbox.kill_all()
        exit_code = await proc.exit_code()
        _, pending = await asyncio.wait(self._readers, timeout=2.0)
        for task in pending:
            task.cancel()
        proc.close_pipes()
        self._proc = None
        return exit_code

    async def exec(
        self,
        cmd: str,
        timeout_s: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> WorkerExecResult:
        """Run the python cell `cmd`. `cwd` and `env` are applied in the worker before
        the cell and persist, like %cd and %env in a notebook."""
        if not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s must be positive and finite, got {timeout_s}")
        async with self._lock:
            await self.sandbox.start()
            proc = self._proc
            if proc is not None and (proc.returncode is not None or self._route.protocol_error):
                broken = self._route.protocol_error
                code = await self._discard(proc)
                self._restart_reason = (
                    f"the worker broke its protocol between calls ({broken})"
                    if broken
                    else f"the worker exited between calls (exit code {code})"
                )
            if self._proc is None:
                await self._launch()
            restart_reason, self._restart_reason = self._restart_reason, None
            return await self._call(cmd, timeout_s, cwd, env, restart_reason)

    async def _call(
        self,
        code: str,
        timeout_s: float,
        cwd: str | None,
        env: dict[str, str] | None,
        restart_reason: str | None,
    ) -> WorkerExecResult:
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        started = time.monotonic()
        cell = self._route.cell = self._new_cell()
        request = {"code": code, "cwd": cwd, "env": env or {}}
        # A dead worker's closed stdin drops the write; its stdout EOF ends the call.
        proc.stdin.write(json.dumps(request).encode() + b"\n")
        killed_for: LimitName | None = None
        try:
            await asyncio.wait_for(cell.finished.wait(), timeout_s)
        except asyncio.TimeoutError:
            killed_for = "wall_time"
        except BaseException:
            await self._discard(proc)  # cancelled mid-call: no half-run worker survives
            self._restart_reason = "a call was cancelled while running"
            raise
        if killed_for is None and cell.budget.exceeded.is_set():
            killed_for = "output"
        end = None
        if killed_for is None and cell.protocol_error is None and cell.reply is not None:
            try:
                end = _CallEnd.model_validate_json(cell.reply)
            except ValidationError as exc:
                cell.protocol_error = f"a malformed reply: {exc.errors()[0]['msg']}"
        if killed_for is None and cell.protocol_error is not None:
            await self._discard(proc)
            self._restart_reason = "the worker broke its protocol"
            raise SandboxDiedError(
                f"the python worker broke its protocol ({cell.protocol_error}); the next "
                f"call starts a fresh one. Worker log: {self._log.text()}"
            )
        if end is None:
            exit_code = await self._discard(proc)
            self._restart_reason = _death_reason(killed_for, exit_code, timeout_s)
        else:
            exit_code = end.exit_code
            restart_reason = restart_reason or end.restarted
            if end.state_lost:
                self._restart_reason = end.reason or _death_reason(None, exit_code, timeout_s)
        stderr = cell.err.text()
        return WorkerExecResult(
            exit_code=exit_code,
            stdout=cell.out.text(),
            stderr=stderr,
            stdout_truncated=cell.out.truncated,
            stderr_truncated=cell.err.truncated,
            stdout_bytes=cell.out.total_bytes,
            stderr_bytes=cell.err.total_bytes,
            timed_out=killed_for == "wall_time",
            limit_hit=killed_for or limit_from_exit(exit_code, stderr),
            duration_s=time.monotonic() - started,
            worker_restarted=restart_reason is not None,
            restart_reason=restart_reason,
            worker_died=end is None or end.state_lost,
        )

    async def write_file(self, path: str, data: bytes) -> None:
        await self.sandbox.write_file(path, data)

    async def read_file(self, path: str) -> bytes:
        return await self.sandbox.read_file(path)

    async def is_alive(self) -> bool:
        """Whether calls can run; a dead worker is restarted by the next call."""
        return not self._closed and await self.sandbox.is_alive()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.sandbox.close()
        finally:
            for task in self._readers:
                task.cancel()
            self._proc = None


def _death_reason(killed_for: LimitName | None, exit_code: int, timeout_s: float) -> str:
    if killed_for == "wall_time":
        return f"the previous call passed its {timeout_s:g} s deadline and was killed"
    if killed_for == "output":
        return "the previous call flooded its output and was killed"
    if exit_code > 128:
        return f"the worker died from signal {exit_code - 128} in the previous call"
    return f"the worker exited with code {exit_code} in the previous call"
