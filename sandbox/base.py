"""What every sandbox backend promises: the result of a command, the errors, the protocol.

Two kinds of failure must never be confused, because the fleet retries one and the
trainer learns from the other (DESIGN.md invariant 5):

- the command's own failure (non-zero exit, a traceback, a limit it ran into, a timeout)
  comes back as an `ExecResult`; the model caused it and sees it as its observation;
- an infrastructure failure (the sandbox could not start, died under the command, or the
  host refused a resource before the command ran) raises a `SandboxError`; the trajectory
  ends with status `sandbox_error`, or the fleet retries it elsewhere.
"""

from __future__ import annotations

from types import TracebackType
from typing import Literal, Protocol, Self, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

STEADY_PYTHON_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}
"""In every backend's environment (a config's `env` may override it): Python writes no
.pyc. A .pyc is trusted while its source keeps the size and the whole-second mtime it was
compiled from, so an edit that keeps a file's size, made within the second after an
import, would run the stale bytecode, and a command's result would depend on timing.
Found rebuilding the bundled SWE models: two builds of their 800 worked-script traces
differed in 7, where a script re-ran its fix and printed the unfixed code's output."""

LimitName = Literal["wall_time", "cpu_time", "memory", "processes", "file_size", "output"]
"""A resource limit that stopped or crippled a command."""


class ExecResult(BaseModel):
    """How one command ended, with its captured output (head and tail kept when long)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    exit_code: int
    """Shell convention: 0 is success, 128 + N means killed by signal N (137 at a deadline)."""
    stdout: str = ""
    """Decoded as UTF-8 (invalid bytes replaced); when truncated, the head and the tail
    joined by a line that says how many bytes were left out."""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_bytes: int = Field(default=0, ge=0)
    """Bytes the command wrote to stdout, including any left out of `stdout`."""
    stderr_bytes: int = Field(default=0, ge=0)
    timed_out: bool = False
    """The wall-clock deadline passed and the command's processes were killed."""
    limit_hit: LimitName | None = None
    """The limit that stopped the command, when one did. wall_time, cpu_time, file_size
    and output are certain (a signal or our own kill); memory and processes are read from
    the error the program printed, because the kernel counts no per-uid refusals."""
    duration_s: float = Field(ge=0.0)
    """Wall time from start to the end of output collection."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class SandboxError(Exception):
    """Infrastructure failure: not the command's fault, safe to retry elsewhere."""


class SandboxStartError(SandboxError):
    """The sandbox could not be created or its first process could not start."""


class SandboxUnavailableError(SandboxStartError):
    """The requested isolation cannot be provided on this host (e.g. no bubblewrap)."""


class SandboxDiedError(SandboxError):
    """The sandbox itself (not the command) failed while running a command."""


class SandboxResourceError(SandboxError):
    """The host refused a resource before the command could run (uids, processes)."""


class SandboxCleanupError(SandboxError):
    """Closing could not remove everything the sandbox left (e.g. a file the host may not
    delete); its uid, processes and lock were released all the same."""


class SandboxClosedError(SandboxError):
    """The sandbox was used after `close()`."""


class SandboxFileError(SandboxError):
    """A file operation was refused: outside the working directory, through a symlink,
    not a regular file, or larger than the configured limit."""


class StartsAndCloses:
    """`async with` for sandbox backends: start() on entry (closed again at once if the
    start fails, since __aexit__ will not run: the uid, directory or container is freed
    now), close() on exit."""

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


@runtime_checkable
class Sandbox(Protocol):
    """The async interface every backend implements (local, docker, e2b, fleet)."""

    async def start(self) -> None:
        """Acquire resources; raises SandboxStartError. Idempotent."""

    async def exec(
        self,
        cmd: str,
        timeout_s: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        """Run `cmd` to completion or until `timeout_s` passes; never raises for the
        command's own failure."""
        ...

    async def write_file(self, path: str, data: bytes) -> None:
        """Write `data` to `path` (relative paths are inside the working directory)."""

    async def read_file(self, path: str) -> bytes:
        """Read `path` (relative paths are inside the working directory)."""
        ...

    async def is_alive(self) -> bool:
        """Whether the next `exec` can run without an infrastructure error."""
        ...

    async def close(self) -> None:
        """Kill everything the sandbox started and release its resources. Idempotent."""

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
