"""PythonWorker: the TIR python tool, one persistent interpreter per trajectory.

A trajectory calls python up to 16 times and later cells use names earlier cells
defined, so one interpreter (python_worker_child.py) lives in a LocalSandbox for the
whole trajectory, with numpy and sympy imported once at start. Each call has a
wall-clock deadline: RLIMIT_CPU would accumulate over the calls of one process, so the
deadline is the host's, and a call that passes it kills the worker and everything it
started. So does a crash (segfault, os._exit) or an output flood. The next call starts a
fresh worker and says so (`worker_restarted`), because the model's variables are gone.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sandbox.base import ExecResult, LimitName, SandboxDiedError, SandboxStartError, StartsAndCloses
from sandbox.jail import limit_from_exit
from sandbox.local import LocalSandbox, LocalSandboxConfig, warn_once
from sandbox.output import READ_CHUNK_BYTES, HeadTailBuffer, OutputBudget
from sandbox.process import SandboxProcess

CHILD_SCRIPT = Path(__file__).with_name("python_worker_child.py")
END_MARKER = b"\x00OPD-CELL-END "
"""Must match python_worker_child.END_MARKER (that file imports nothing of ours)."""
SINGLE_THREADED_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""Thousands of workers share the host's cores; BLAS thread pools would oversubscribe
them, reserve address space per thread, and count against the process cap (threads are
processes to RLIMIT_NPROC)."""

Stream = Literal["stdout", "stderr"]


class PythonWorkerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sandbox: LocalSandboxConfig = Field(default_factory=LocalSandboxConfig)
    """Isolation and limits of the sandbox the worker runs in; its `env` may override
    SINGLE_THREADED_ENV."""
    python: str | None = None
    """Interpreter to run; default: this process's (its prefix is mounted read-only)."""
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


class _Cell:
    """Output of one call, read from the worker's pipes until the call's end marker."""

    def __init__(self, head_bytes: int, tail_bytes: int, budget_bytes: int) -> None:
        self.marker: bytes | None = None
        """Set when the call is sent; output read before that came between calls."""
        self.out = HeadTailBuffer(head_bytes, tail_bytes)
        self.err = HeadTailBuffer(head_bytes, tail_bytes)
        self.budget = OutputBudget(budget_bytes)
        self.reply: dict[str, Any] | None = None
        self.ended: dict[Stream, bool] = {"stdout": False, "stderr": False}
        self.eof = False
        self.finished = asyncio.Event()
        self._next: _Cell | None = None

    def successor(self) -> _Cell:
        """Where output after this cell's end marker goes (the next call's output)."""
        if self._next is None:
            self._next = _Cell(self.out.head_bytes, self.out.tail_bytes, self.budget.limit_bytes)
        return self._next

    def feed(self, stream: Stream, data: bytes) -> None:
        (self.out if stream == "stdout" else self.err).feed(data)
        self.budget.spend(len(data))
        if self.budget.exceeded.is_set():
            self.finished.set()

    def end(self, stream: Stream) -> None:
        self.ended[stream] = True
        if all(self.ended.values()):
            self.finished.set()

    def close(self) -> None:
        self.eof = True
        self.finished.set()


async def _read_stream(stream: asyncio.StreamReader, which: Stream, cell: _Cell) -> None:
    """Split one pipe of the worker into cells at their end markers, for its lifetime."""
    pending = b""
    while chunk := await stream.read(READ_CHUNK_BYTES):
        data, pending = pending + chunk, b""
        while data:
            if cell.marker is None:
                cell.feed(which, data)
                break
            at = data.find(cell.marker)
            if at < 0:
                # Hold back what may be the start of a marker split across reads.
                keep = min(len(data), len(cell.marker) - 1)
                cell.feed(which, data[: len(data) - keep])
                pending = data[len(data) - keep :]
                break
            rest = data[at + len(cell.marker) :]
            if which == "stdout":
                newline = rest.find(b"\n")
                if newline < 0:
                    cell.feed(which, data[:at])
                    pending = data[at:]
                    break
                try:
                    cell.reply = json.loads(rest[:newline])
                except ValueError as exc:
                    cell.reply = {"protocol_error": f"unreadable reply from the worker: {exc}"}
                rest = rest[newline + 1 :]
            cell.feed(which, data[:at])
            cell.end(which)
            cell = cell.successor()
            data = rest
    if pending:
        cell.feed(which, pending)
    cell.close()


class PythonWorker(StartsAndCloses):
    """Runs python cells in one persistent interpreter inside a LocalSandbox."""

    def __init__(self, config: PythonWorkerConfig | None = None) -> None:
        self.config = config or PythonWorkerConfig()
        self.sandbox = LocalSandbox(self.config.sandbox)
        self._proc: SandboxProcess | None = None
        self._readers: list[asyncio.Task[None]] = []
        self._cell: _Cell | None = None
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
        nonce = secrets.token_hex(16)
        cell = self._new_cell()
        cell.marker = END_MARKER + nonce.encode() + b"\x00"
        options = json.dumps(
            {
                "echo_last_expression": self.config.echo_last_expression,
                "preload_modules": self.config.preload_modules,
            }
        )
        python = self.config.python or sys.executable
        command = [python, "-I", str(CHILD_SCRIPT), nonce, options]
        env = {k: v for k, v in SINGLE_THREADED_ENV.items() if k not in self.config.sandbox.env}
        proc = await self.sandbox.spawn(command, env=env, ro_files=[CHILD_SCRIPT])
        self._readers = [
            asyncio.create_task(_read_stream(proc.stdout, "stdout", cell)),
            asyncio.create_task(_read_stream(proc.stderr, "stderr", cell)),
        ]
        try:
            await asyncio.wait_for(cell.finished.wait(), self.config.start_timeout_s)
        except asyncio.TimeoutError:
            await self._discard(proc)
            raise SandboxStartError(
                f"the python worker did not start within {self.config.start_timeout_s} s: "
                f"{cell.err.text()[-2000:]}"
            ) from None
        if cell.reply is None or not cell.reply.get("ready"):
            exit_code = await self._discard(proc)
            raise SandboxStartError(
                f"the python worker exited while starting (exit code {exit_code}): "
                f"{cell.err.text()[-2000:]}"
            )
        if errors := cell.reply.get("preload_errors"):
            warn_once(f"python worker could not preload {errors}")
        self._proc = proc
        self._cell = cell.successor()

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
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        async with self._lock:
            await self.sandbox.start()
            restart_reason = None
            if self._proc is not None and self._proc.returncode is not None:
                code = await self._discard(self._proc)
                self._restart_reason = f"the worker exited between calls (exit code {code})"
            if self._proc is None:
                restart_reason, self._restart_reason = self._restart_reason, None
                await self._launch()
            return await self._call(cmd, timeout_s, cwd, env, restart_reason)

    async def _call(
        self,
        code: str,
        timeout_s: float,
        cwd: str | None,
        env: dict[str, str] | None,
        restart_reason: str | None,
    ) -> WorkerExecResult:
        proc, cell = self._proc, self._cell
        assert proc is not None and proc.stdin is not None and cell is not None
        started = time.monotonic()
        nonce = secrets.token_hex(16)
        cell.marker = END_MARKER + nonce.encode() + b"\x00"
        request = {"nonce": nonce, "code": code, "cwd": cwd, "env": env or {}}
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
        died = killed_for is not None or cell.reply is None
        if died:
            exit_code = await self._discard(proc)
            self._restart_reason = _death_reason(killed_for, exit_code, timeout_s)
        else:
            assert cell.reply is not None
            if "protocol_error" in cell.reply:
                await self._discard(proc)
                self._restart_reason = "the worker broke its protocol"
                raise SandboxDiedError(cell.reply["protocol_error"])
            exit_code = int(cell.reply["exit_code"])
            self._cell = cell.successor()
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
            worker_died=died,
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
