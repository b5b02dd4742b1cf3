"""A sandboxed process whose pipes we own, so its exit and its output are separate events.

asyncio's own subprocess pipes tie the two together: on Python 3.11 `Process.wait()`
returns only once every pipe is closed, so one background process that kept stdout open
(`setsid cmd &`) would hold an exec past its deadline. Here the child gets the write ends
of pipes we create, `wait()` tracks only the process, and the read ends are ours to close.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sandbox.jail import kill_process_group
from sandbox.output import READ_CHUNK_BYTES


@dataclass(eq=False)
class SandboxProcess:
    proc: asyncio.subprocess.Process
    stdout: asyncio.StreamReader
    stderr: asyncio.StreamReader
    stdin: asyncio.WriteTransport | None = None
    """Requests to a long-lived process; writes are buffered by the transport."""
    transports: list[asyncio.BaseTransport] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def exit_code(self) -> int:
        """Its exit status as a shell reports it: 128 + N when killed by signal N."""
        code = await self.proc.wait()
        return 128 - code if code < 0 else code

    def kill(self) -> None:
        kill_process_group(self.proc.pid)

    def close_pipes(self) -> None:
        """Stop reading: writers still holding the pipes get EPIPE from now on."""
        for transport in self.transports:
            transport.close()


async def _reader(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    loop = asyncio.get_running_loop()
    # The limit is how much the reader buffers before it stops reading the pipe.
    reader = asyncio.StreamReader(limit=4 * READ_CHUNK_BYTES)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader),
        open(fd, "rb", buffering=0),  # noqa: SIM115 - the transport owns and closes it
    )
    return reader, transport


async def start_process(
    argv: Sequence[str],
    env: dict[str, str],
    with_stdin: bool,
    pass_fds: Sequence[int] = (),
    **spawn_kwargs: Any,
) -> SandboxProcess:
    """Start `argv` with fresh pipes for stdout and stderr (and stdin when asked; else
    /dev/null). Raises OSError as create_subprocess_exec does."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    in_r, in_w = os.pipe() if with_stdin else (None, None)
    child_ends = [out_w, err_w] + ([in_r] if in_r is not None else [])
    parent_ends = [out_r, err_r] + ([in_w] if in_w is not None else [])
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=in_r if in_r is not None else asyncio.subprocess.DEVNULL,
            stdout=out_w,
            stderr=err_w,
            env=env,
            pass_fds=tuple(pass_fds),
            **spawn_kwargs,
        )
    except BaseException:
        for fd in parent_ends:
            os.close(fd)
        raise
    finally:
        for fd in child_ends:
            os.close(fd)
    stdout, out_transport = await _reader(out_r)
    stderr, err_transport = await _reader(err_r)
    transports = [out_transport, err_transport]
    stdin = None
    if in_w is not None:
        loop = asyncio.get_running_loop()
        pipe = open(in_w, "wb", buffering=0)  # noqa: SIM115 - the transport owns and closes it
        stdin, _ = await loop.connect_write_pipe(asyncio.Protocol, pipe)
        transports.append(stdin)
    return SandboxProcess(proc, stdout, stderr, stdin, transports)
