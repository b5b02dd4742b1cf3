"""LocalSandbox: commands a model wrote, run on this host, each sandbox under its own uid.

Every command runs in a new process group (a new pid namespace under bubblewrap) with a
scrubbed environment, rlimits and a wall-clock deadline after which the whole group is
SIGKILLed; its output is read incrementally and only head + tail are kept. Isolation
levels and what each one holds are described in `sandbox.jail`.

Limits of this backend, stated plainly:
- Disk: RLIMIT_FSIZE caps each file (and strict's /tmp is size-capped); the working
  directory as a whole is not capped.
- Memory: RLIMIT_AS caps each process; a sandbox may hold up to max_processes of them.
- The kernel is the boundary: no seccomp filter, and the sandbox uid may still create
  user namespaces of its own.
- basic mode hides nothing of the host file system beyond Unix permissions (world-
  readable files are readable, /proc shows host command lines) and shares the network.
- In strict mode each exec is its own pid namespace: background processes die with the
  command that started them. In basic mode they live until close(), and processes that
  left the process group are reached only by a sweep of the sandbox's uid.
- What the uid leaves outside the working directory (basic mode: files in the host's
  scratch directories, System V IPC objects; either mode: keys in its keyrings) is
  removed when the uid is given back and again when it is next taken (sandbox.leftovers).
- Commands, paths and environments no process can be given (a NUL byte, unencodable
  text, an argument over the kernel's limit) are the command's failure: exit code 126,
  or a SandboxFileError for file transfer. Nothing but SandboxErrors is raised, except
  ValueError for a timeout that is not positive and finite (the caller's bug).
- Memory and process limits are reported (`limit_hit`) from the error the program
  printed; the kernel keeps no per-uid count of RLIMIT_AS/RLIMIT_NPROC refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sandbox import files, leases
from sandbox.base import (
    ExecResult,
    LimitName,
    SandboxCleanupError,
    SandboxClosedError,
    SandboxDiedError,
    SandboxError,
    SandboxResourceError,
    SandboxStartError,
    SandboxUnavailableError,
    StartsAndCloses,
)
from sandbox.jail import Isolation, Jail, Limits, find_bwrap, limit_from_exit, probe_strict
from sandbox.output import HeadTailBuffer, OutputBudget, pump
from sandbox.process import SandboxProcess, start_process

logger = logging.getLogger(__name__)

_LAUNCHERS = ("setpriv: ", "prlimit: ")


class LocalSandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    isolation: Literal["auto", "strict", "basic"] = "auto"
    """strict: bubblewrap namespaces + own uid + rlimits (refused when unavailable);
    basic: own uid + rlimits; auto: strict when available, else basic with a warning."""
    memory_mb: int = Field(default=2048, ge=16)
    """Address-space limit of each process (RLIMIT_AS): virtual, not resident, memory;
    runtimes that reserve large arenas (JVM, some ML libraries) need more."""
    max_processes: int = Field(default=64, ge=1)
    """Processes and threads the sandbox's uid may have at once (RLIMIT_NPROC)."""
    file_size_mb: int = Field(default=256, ge=1)
    """Largest file a process may write (RLIMIT_FSIZE); beyond it, SIGXFSZ."""
    open_files: int = Field(default=256, ge=16)
    """Descriptors per process (RLIMIT_NOFILE)."""
    tmp_size_mb: int = Field(default=64, ge=1)
    """Size of the private /tmp (strict; memory-backed, lives as long as one command)."""
    output_head_kb: int = Field(default=64, ge=0)
    """Kept from the start of each output stream."""
    output_tail_kb: int = Field(default=64, ge=0)
    """Kept from the end of each output stream."""
    max_output_mb: float = Field(default=32.0, gt=0)
    """Output (stdout + stderr) after which a command is killed as a flood."""
    max_read_file_mb: float = Field(default=64.0, gt=0)
    """Largest file `read_file` returns."""
    drain_grace_s: float = Field(default=0.5, ge=0)
    """How long to keep reading output after the command exits (background writers)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Added to the scrubbed environment of every command."""
    ro_paths: list[Path] = Field(default_factory=list)
    """Extra host paths visible read-only (strict); /usr and /etc always are."""
    expose_python: bool = True
    """Make this host's Python (sys.prefix, sys.base_prefix) visible read-only (strict)."""
    root_dir: Path | None = None
    """Where working directories live; default <tmp>/opd-sandbox-<euid>."""
    uid_base: int = Field(default=1_500_000_000, ge=1000, le=2**31 - 1)
    """First uid of the range reserved for sandboxes. It must hold no real user and no
    subordinate range (/etc/subuid hands out 65,536 at a time upward from 100,000, so
    rootless containers' uids fill the low millions); a sandbox could signal them."""
    uid_count: int = Field(default=10_000, ge=1, le=1_000_000)


@functools.cache
def warn_once(message: str) -> None:
    """Log `message` as a warning the first time only (per process)."""
    logger.warning(message)


def resolve_isolation(
    requested: Literal["auto", "strict", "basic"],
) -> tuple[Isolation, str | None]:
    """The isolation this host can give for `requested`, and bwrap's path for strict."""
    if requested == "basic":
        return "basic", None
    bwrap = find_bwrap()  # says once when it is missing
    problem = "bubblewrap (bwrap) is not installed" if bwrap is None else probe_strict(bwrap)
    if problem is None:
        return "strict", bwrap
    if requested == "strict":
        raise SandboxUnavailableError(f"isolation='strict' is unavailable: {problem}")
    if bwrap is not None:
        warn_once(f"local sandboxes fall back to isolation='basic': {problem}")
    return "basic", None


class LocalSandbox(StartsAndCloses):
    """A private working directory and uid on this host; commands run as `bash -c`."""

    def __init__(self, config: LocalSandboxConfig | None = None) -> None:
        self.config = config or LocalSandboxConfig()
        self._lease: leases.SandboxLease | None = None
        self._jail: Jail | None = None
        self._procs: set[SandboxProcess] = set()
        self._start_lock = asyncio.Lock()
        self._closed = False

    @property
    def isolation(self) -> Isolation:
        return self._started_jail().isolation

    @property
    def uid(self) -> int | None:
        return self._started_jail().uid

    @property
    def workdir(self) -> Path:
        """The working directory's host path."""
        return self._started_jail().workdir

    @property
    def visible_workdir(self) -> Path:
        """The working directory as commands see it (jail.STRICT_WORKDIR under bubblewrap)."""
        return self._started_jail().visible_workdir

    def _started_jail(self) -> Jail:
        if self._closed:
            raise SandboxClosedError("the sandbox is closed")
        if self._jail is None:
            raise SandboxStartError("the sandbox is not started: await start() first")
        return self._jail

    async def start(self) -> None:
        async with self._start_lock:
            if self._closed:
                raise SandboxClosedError("the sandbox is closed")
            if self._jail is not None:
                return
            isolation, bwrap = await asyncio.to_thread(resolve_isolation, self.config.isolation)
            ro_paths = list(self.config.ro_paths)
            if self.config.expose_python:
                ro_paths += [Path(sys.prefix), Path(sys.base_prefix)]
            if missing := [str(p) for p in ro_paths if not p.exists()]:
                raise SandboxStartError(f"ro_paths do not exist: {', '.join(missing)}")
            root_dir = self.config.root_dir or leases.default_root_dir()
            try:
                lease = await asyncio.to_thread(
                    leases.acquire,
                    root_dir,
                    self.config.uid_base,
                    self.config.uid_count,
                    isolation == "basic",
                )
            except OSError as exc:
                raise SandboxStartError(f"cannot create a sandbox under {root_dir}: {exc}") from exc
            if lease.uid is None:
                warn_once(
                    "the host is not root: sandboxes run as this user, with no process cap "
                    "and no uid separation between them"
                )
            self._lease = lease
            self._jail = Jail(
                isolation, lease.uid, lease.workdir, ro_paths, self.config.tmp_size_mb, bwrap
            )

    def limits(self, cpu_s: int | None) -> Limits:
        return Limits(
            memory_mb=self.config.memory_mb,
            max_processes=self.config.max_processes,
            file_size_mb=self.config.file_size_mb,
            open_files=self.config.open_files,
            cpu_s=cpu_s,
        )

    async def exec(
        self,
        cmd: str,
        timeout_s: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        """Run `cmd` with bash in the working directory (or `cwd`, relative to it). A
        command no process can be given (a NUL byte, text that is not encodable, more
        than the kernel takes as arguments) fails like a shell's would, with exit code
        126. `timeout_s` must be positive and finite (ValueError: a caller's bug)."""
        if not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s must be positive and finite, got {timeout_s}")
        await self.start()
        started = time.monotonic()
        if (problem := _unpassable(cmd, cwd, env)) is not None:
            return _cannot_execute(problem, started)
        command = ["/bin/bash", "-c", cmd]
        if cwd is not None:
            # Changing directory as the sandbox uid, not as root before the drop, so a
            # symlink in the working directory cannot lead root somewhere.
            command = ["env", f"--chdir={cwd}", "--", *command]
        limits = self.limits(math.ceil(timeout_s) + 1)
        try:
            return await self._run(command, timeout_s, limits, env)
        except _ArgumentsTooLongError as exc:
            return _cannot_execute(str(exc), started)

    async def spawn(
        self,
        command: Sequence[str],
        env: dict[str, str] | None = None,
        ro_files: Sequence[Path] = (),
        privileged_start: bool = False,
    ) -> SandboxProcess:
        """Start a long-lived process in this sandbox with stdin/stdout/stderr pipes
        (the python worker); no CPU limit, since it accumulates across calls.
        `privileged_start`: in basic mode on a root host the command starts as root (under
        the rlimits, no_new_privs, in its own session) and must itself drop to `uid`
        before it runs anything it did not write; ignored in strict mode, where bubblewrap
        mounts what it needs and the drop comes first."""
        await self.start()
        limits = self.limits(None)
        return await self._start_process(
            command, limits, env, ro_files, True, None, privileged_start
        )

    async def _start_process(
        self,
        command: Sequence[str],
        limits: Limits,
        env: dict[str, str] | None,
        ro_files: Sequence[Path],
        with_stdin: bool,
        status_fd: int | None,
        privileged_start: bool = False,
    ) -> SandboxProcess:
        jail = self._started_jail()
        argv = jail.argv(command, limits, ro_files=ro_files, status_fd=status_fd)
        full_env = {**jail.base_env(), **self.config.env, **(env or {})}
        try:
            process = await start_process(
                argv,
                full_env,
                with_stdin,
                pass_fds=() if status_fd is None else (status_fd,),
                **jail.spawn_kwargs(privileged_start),
            )
        except BlockingIOError as exc:
            raise SandboxResourceError(f"the host refused a process: {exc}") from exc
        except OSError as exc:
            if exc.errno == errno.E2BIG:
                raise _ArgumentsTooLongError(
                    f"the command is longer than the kernel takes ({exc.strerror})"
                ) from exc
            raise SandboxStartError(f"cannot start {argv[0]}: {exc}") from exc
        self._procs.add(process)
        return process

    async def _run(
        self, command: Sequence[str], timeout_s: float, limits: Limits, env: dict[str, str] | None
    ) -> ExecResult:
        started = time.monotonic()
        strict = self._started_jail().isolation == "strict"
        status_r, status_w = os.pipe() if strict else (None, None)
        try:
            process = await self._start_process(command, limits, env, (), False, status_w)
        except BaseException:
            if status_r is not None:
                os.close(status_r)
            raise
        finally:
            if status_w is not None:
                os.close(status_w)
        head, tail = self.config.output_head_kb * 1024, self.config.output_tail_kb * 1024
        stdout, stderr = HeadTailBuffer(head, tail), HeadTailBuffer(head, tail)
        budget = OutputBudget(int(self.config.max_output_mb * 1024 * 1024))
        pumps = [
            asyncio.create_task(pump(process.stdout, stdout, budget)),
            asyncio.create_task(pump(process.stderr, stderr, budget)),
        ]
        exited = asyncio.create_task(process.exit_code())
        flooded = asyncio.create_task(budget.exceeded.wait())
        killed_for: LimitName | None = None
        try:
            done, _ = await asyncio.wait(
                {exited, flooded}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if exited not in done:
                killed_for = "output" if flooded in done else "wall_time"
                process.kill()
            exit_code = await exited
            await self._drain(process, pumps)
        finally:
            for task in (exited, flooded, *pumps):
                task.cancel()
            if process.returncode is None:
                process.kill()
            process.close_pipes()
            self._procs.discard(process)
            status = _read_all(status_r) if status_r is not None else None
        stderr_text = stderr.text()
        if killed_for is None:
            self._raise_if_launch_failed(exit_code, stderr_text, status)
        return ExecResult(
            exit_code=exit_code,
            stdout=stdout.text(),
            stderr=stderr_text,
            stdout_truncated=stdout.truncated,
            stderr_truncated=stderr.truncated,
            stdout_bytes=stdout.total_bytes,
            stderr_bytes=stderr.total_bytes,
            timed_out=killed_for == "wall_time",
            limit_hit=killed_for or limit_from_exit(exit_code, stderr_text),
            duration_s=time.monotonic() - started,
        )

    async def _drain(self, process: SandboxProcess, pumps: list[asyncio.Task[None]]) -> None:
        """Finish reading output. Processes still holding the pipes after the grace period
        are killed: the group, and in basic mode every process of the uid (in strict
        mode they died with the command's pid namespace)."""
        grace = self.config.drain_grace_s
        _, pending = await asyncio.wait(pumps, timeout=grace)
        if pending:
            process.kill()
            jail = self._started_jail()
            if jail.uid is not None and jail.isolation == "basic":
                await leases.kill_uid_processes(jail.uid)
            await asyncio.wait(pending, timeout=grace)

    @staticmethod
    def _raise_if_launch_failed(exit_code: int, stderr: str, status: bytes | None) -> None:
        """Tell a sandbox that failed to launch the command from the command's own
        failure: bwrap reports an exit code only for a command it started, and the
        launchers' errors come first on stderr."""
        if status is not None and b'"exit-code"' not in status:
            raise SandboxDiedError(f"bubblewrap could not run the command: {stderr.strip()}")
        if exit_code in (1, 126, 127) and stderr.startswith(_LAUNCHERS):
            message = stderr.splitlines()[0]
            if "Resource temporarily unavailable" in message:
                raise SandboxResourceError(
                    f"the sandbox is at its process cap, the command could not start: {message}"
                )
            raise SandboxDiedError(f"the sandbox could not launch the command: {message}")

    async def write_file(self, path: str, data: bytes) -> None:
        await self.start()
        jail = self._started_jail()
        await asyncio.to_thread(files.write_file, jail.workdir, path, data, jail.uid)

    async def read_file(self, path: str) -> bytes:
        await self.start()
        max_bytes = int(self.config.max_read_file_mb * 1024 * 1024)
        return await asyncio.to_thread(files.read_file, self.workdir, path, max_bytes)

    async def is_alive(self) -> bool:
        return not self._closed and self._jail is not None and self._jail.workdir.is_dir()

    async def kill_all(self) -> None:
        """SIGKILL every process this sandbox runs, including any that escaped their
        process group (running commands end with exit code 137)."""
        if self._closed or self._jail is None:
            return  # a released uid may already belong to another sandbox
        for process in list(self._procs):
            if process.returncode is None:
                process.kill()
            else:
                self._procs.discard(process)
        if self._jail.uid is not None:
            dying = self._jail.isolation == "strict"  # each namespace dies with its bwrap
            await leases.kill_uid_processes(self._jail.uid, dying=dying)

    async def close(self) -> None:
        """Kill the sandbox's processes, remove its working directory and free its uid;
        the uid is freed whatever the rest raised, and only SandboxErrors are raised."""
        if self._closed:
            return
        async with self._start_lock:
            if self._closed:
                return
            try:
                try:
                    await self.kill_all()
                finally:
                    self._closed = True
                    lease, self._lease = self._lease, None
                    if lease is not None:
                        await asyncio.to_thread(leases.release, lease)
            except SandboxError:
                raise
            except Exception as exc:
                raise SandboxCleanupError(f"closing the sandbox failed: {exc!r}") from exc


class _ArgumentsTooLongError(SandboxStartError):
    """execve refused the command line (E2BIG): the command's fault, not the host's."""


def _unpassable(cmd: str, cwd: str | None, env: dict[str, str] | None) -> str | None:
    """Why `cmd`, `cwd` or `env` cannot be handed to a process, or None."""
    texts = [("the command", cmd), ("cwd", cwd or "")]
    for name, value in (env or {}).items():
        if "=" in name:
            return f"{name!r} is not a valid environment variable name"
        texts += [("an environment variable", name), ("an environment variable", value)]
    for what, text in texts:
        if "\x00" in text:
            return f"{what} contains a NUL byte"
        try:
            os.fsencode(text)
        except UnicodeEncodeError as exc:
            return f"{what} holds text that cannot be encoded ({exc.reason})"
    return None


def _cannot_execute(problem: str, started: float) -> ExecResult:
    message = f"the sandbox cannot run this command: {problem}\n"
    return ExecResult(
        exit_code=126,
        stderr=message,
        stderr_bytes=len(message.encode()),
        duration_s=time.monotonic() - started,
    )


def _read_all(fd: int) -> bytes:
    """What bwrap wrote to its status pipe (without blocking), then close it."""
    chunks = []
    with contextlib.suppress(BlockingIOError):
        os.set_blocking(fd, False)
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)
