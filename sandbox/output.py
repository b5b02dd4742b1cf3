"""Bounded capture of a command's output: keep the head and the tail, count the rest.

A command may print 100 MB; the host must never hold it. Output is read incrementally in
chunks, the first `head_bytes` and the last `tail_bytes` are kept, and the middle is only
counted. A shared `OutputBudget` over all of a command's streams says when it has written
more than anyone will read, so the caller can stop it instead of draining a flood until
the deadline.
"""

from __future__ import annotations

import asyncio

READ_CHUNK_BYTES = 64 * 1024


class HeadTailBuffer:
    """The first `head_bytes` and last `tail_bytes` of a byte stream, and its length."""

    def __init__(self, head_bytes: int, tail_bytes: int) -> None:
        if head_bytes < 0 or tail_bytes < 0:
            raise ValueError("head_bytes and tail_bytes must be >= 0")
        self.head_bytes = head_bytes
        self.tail_bytes = tail_bytes
        self._head = bytearray()
        self._tail = bytearray()
        self.total_bytes = 0

    def feed(self, data: bytes) -> None:
        self.total_bytes += len(data)
        room = self.head_bytes - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if not data or self.tail_bytes == 0:
            return
        if len(data) >= self.tail_bytes:
            self._tail[:] = data[-self.tail_bytes :]
            return
        self._tail += data
        excess = len(self._tail) - self.tail_bytes
        if excess > 0:
            del self._tail[:excess]

    @property
    def kept_bytes(self) -> int:
        return len(self._head) + len(self._tail)

    @property
    def truncated(self) -> bool:
        return self.total_bytes > self.kept_bytes

    def text(self) -> str:
        """Head and tail as UTF-8 (invalid bytes replaced), with a line saying how much of
        the middle was left out, so the model reading it knows the output is incomplete."""
        head = self._head.decode("utf-8", errors="replace")
        tail = self._tail.decode("utf-8", errors="replace")
        if not self.truncated:
            return head + tail
        omitted = self.total_bytes - self.kept_bytes
        return f"{head}\n[... {omitted:,} bytes of output omitted ...]\n{tail}"


class OutputBudget:
    """Bytes a command may write over all its streams before it is stopped."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.spent_bytes = 0
        self.exceeded = asyncio.Event()

    def spend(self, n_bytes: int) -> None:
        self.spent_bytes += n_bytes
        if self.spent_bytes > self.limit_bytes:
            self.exceeded.set()


async def pump(stream: asyncio.StreamReader, sink: HeadTailBuffer, budget: OutputBudget) -> None:
    """Copy `stream` into `sink` until EOF, charging `budget` for every byte."""
    while chunk := await stream.read(READ_CHUNK_BYTES):
        sink.feed(chunk)
        budget.spend(len(chunk))
