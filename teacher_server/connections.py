"""Connection limits of the teacher service: what a client can hold before it sends a request.

uvicorn's h11 protocol arms no timer until it has sent a response: a connection that
never sends a byte, or trickles its headers a byte at a time, stays open for ever, and
enough of them use up the process's descriptors: accept() then fails for every client
(the keyed ones too), and asyncio logs a traceback and schedules a retry for each failed
accept(), up to a backlog of them each time the socket is ready, so the log grows faster
every second (issue 39 saw hundreds of MB a minute).

What h11 and uvicorn already bound stays theirs: a request's headers at most 16 KiB (h11's
incomplete-event limit, answered 400) and the idle time between requests
(`timeout_keep_alive`). `uvicorn.Config(limit_concurrency=)` is no cap for this: it
answers 503 to the requests of every client, keyed ones included, while idle connections
fill it. Added here:

- a header deadline, from the moment a connection waits for a request (opened, or its
  first byte after a response) until the request's headers are complete; past it the
  connection is closed, unanswered (no request was made);
- a cap on open connections, below the descriptor limit: at the cap a new connection
  closes the one idle longest (waiting for headers or between requests), so clients that
  send requests keep being served while idle ones are dropped; with none idle the
  newcomer is closed;
- a log filter that lets a message through once per window and counts the rest.

serve runs uvicorn with this protocol even where httptools is installed (SGLang's image):
httptools' protocol has no such limits either.

Invariant: a connection in a request (headers complete, answer not yet sent) is never
closed by these limits; guards.RequestGuard bounds that phase (body deadline, body budget).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field
from uvicorn.protocols.http.h11_impl import H11Protocol

from teacher_server.metrics import ServerMetrics

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_WRITE_TIMEOUT_S = 60.0
SEND_BUFFER_BYTES = 256 * 1024
"""SO_SNDBUF of a connection (the kernel doubles it): a finished answer the client has not
read holds at most this in the kernel, instead of autotuning's up to 4 MiB."""
DESCRIPTOR_RESERVE = 1024
"""Descriptors the default cap leaves to the rest of the service: model files, logs, the
backend's sockets, and sockets accepted but not yet counted (see accept_backlog)."""
MIN_DESCRIPTORS_LEFT = 128
"""The fewest descriptors a --max-connections given may leave beside it."""
MAX_DEFAULT_CONNECTIONS = 16_384
"""The default cap's ceiling whatever the descriptor limit: each connection may buffer up to
16 KiB of headers, so this bounds that memory at 256 MiB."""
MAX_ACCEPT_BACKLOG = 512
"""A burst of new clients beyond it waits for a SYN retry (a second); the kernel caps it at
net.core.somaxconn anyway."""
MIN_ACCEPT_BACKLOG = 8
LOG_WINDOW_S = 10.0
RATE_LIMITED_LOGGERS = ("asyncio", "uvicorn.error")


class TooManyConnections(ValueError):
    """A connection cap that leaves too few descriptors for the rest of the service."""


class ConnectionLimits(BaseModel):
    """The limits of one server's connections."""

    model_config = ConfigDict(frozen=True)

    max_connections: int = Field(ge=1)
    """Open connections at most; at the cap a new one closes the one idle longest."""
    accept_backlog: int = Field(default=MAX_ACCEPT_BACKLOG, ge=1)
    """uvicorn's `backlog`: the kernel's queue of connections not yet accepted, and the most
    asyncio accepts in one turn of the event loop; those are counted against the cap only a
    turn or two later, so up to a few backlogs of descriptors are open beyond the cap."""
    header_timeout_s: float = Field(default=DEFAULT_HEADER_TIMEOUT_S, gt=0)
    """Seconds from waiting for a request (opened, or a first byte after a response) until
    its headers are complete; then the connection is closed."""
    write_timeout_s: float = Field(default=DEFAULT_WRITE_TIMEOUT_S, gt=0)
    """Seconds an answer may wait for the client to take any of it (the transport's buffer
    over its high-water mark, nothing read); then the connection is dropped, so a client
    that never reads its answer does not hold the answer, and what it cost, forever."""


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline, a write deadline and a connection cap
    (ConnectionLimits).
    Use the class `bounded_protocol` makes: the idle table is shared by one server's
    connections. Assumes no websocket upgrades (serve runs uvicorn with ws="none")."""

    limits: ClassVar[ConnectionLimits]
    metrics: ClassVar[ServerMetrics | None]
    idle: ClassVar[dict[BoundedH11Protocol, None]]
    """This server's connections not in a request, in the order they became idle."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_deadline: asyncio.TimerHandle | None = None
        self.write_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # what an answer nobody reads may hold in the kernel
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        if self.metrics is not None:
            self.metrics.count_connection(+1)
        # self is counted in self.connections (uvicorn's set); so are connections closed
        # but not yet lost: their descriptors are still open
        if len(self.connections) > self.limits.max_connections:
            oldest = next(iter(self.idle), None)
            if oldest is None:
                self._close("over_cap")
                return
            oldest._close("evicted")
        self._wait_for_request()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_request():
            self._cancel_header_deadline()
            self.idle.pop(self, None)
        elif self.header_deadline is None and not self.transport.is_closing():
            # a first byte after a response: the headers of the next request are due;
            # later bytes do not push the deadline back
            self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer
        if not self._in_request() and not self.transport.is_closing():
            self.idle.pop(self, None)
            self.idle[self] = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.write_deadline is None:
            self.write_deadline = self.loop.call_later(
                self.limits.write_timeout_s, self._drop, "write_timeout"
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._cancel_write_deadline()
        self._cancel_header_deadline()
        self.idle.pop(self, None)
        if self.metrics is not None:
            self.metrics.count_connection(-1)

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _wait_for_request(self) -> None:
        self.idle[self] = None
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        self.header_deadline = self.loop.call_later(
            self.limits.header_timeout_s, self._close, "header_timeout"
        )

    def _cancel_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _cancel_write_deadline(self) -> None:
        if self.write_deadline is not None:
            self.write_deadline.cancel()
            self.write_deadline = None

    def _drop(self, reason: str) -> None:
        """Abort: close() would wait for a buffer the client never takes."""
        self.write_deadline = None
        self.transport.abort()
        if self.metrics is not None:
            self.metrics.count_closed_connection(reason)

    def _close(self, reason: str) -> None:
        self._cancel_header_deadline()
        self.idle.pop(self, None)
        if self.transport.is_closing():
            return
        self.transport.close()
        if self.metrics is not None:
            self.metrics.count_closed_connection(reason)


def bounded_protocol(
    limits: ConnectionLimits, metrics: ServerMetrics | None = None
) -> type[BoundedH11Protocol]:
    """The protocol class of one server (uvicorn.Config(http=...)), with its own idle table;
    `metrics` counts open connections and those these limits closed, by reason."""

    class ServerProtocol(BoundedH11Protocol):
        pass

    ServerProtocol.limits = limits
    ServerProtocol.metrics = metrics
    ServerProtocol.idle = {}
    return ServerProtocol


def raise_descriptor_limit() -> int:
    """The soft RLIMIT_NOFILE, first raised to the hard limit where the process may."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # not allowed here: serve within the soft limit
            pass
    return soft


def default_max_connections(descriptors: int) -> int:
    """The descriptor limit less DESCRIPTOR_RESERVE, at least half of a small limit, at most
    MAX_DEFAULT_CONNECTIONS."""
    return min(MAX_DEFAULT_CONNECTIONS, max(descriptors // 2, descriptors - DESCRIPTOR_RESERVE))


def limits_within(
    descriptors: int, max_connections: int | None, header_timeout_s: float
) -> ConnectionLimits:
    """The limits of a server with `descriptors` (its soft RLIMIT_NOFILE): the cap given, else
    default_max_connections; an accept backlog of a quarter of the descriptors left beyond
    the cap (MIN_ACCEPT_BACKLOG to MAX_ACCEPT_BACKLOG), so that sockets accepted before the
    cap counts them still find descriptors. Raises TooManyConnections for a cap given that
    leaves fewer than MIN_DESCRIPTORS_LEFT."""
    if max_connections is None:
        max_connections = default_max_connections(descriptors)
    elif descriptors - max_connections < MIN_DESCRIPTORS_LEFT:
        raise TooManyConnections(
            f"--max-connections {max_connections} leaves fewer than {MIN_DESCRIPTORS_LEFT} "
            f"of the {descriptors} descriptors this process may open to the rest of the "
            f"service: set at most {descriptors - MIN_DESCRIPTORS_LEFT}, or raise the limit "
            "(ulimit -n, docker run --ulimit nofile=...)"
        )
    left = descriptors - max_connections
    return ConnectionLimits(
        max_connections=max_connections,
        accept_backlog=min(MAX_ACCEPT_BACKLOG, max(MIN_ACCEPT_BACKLOG, left // 4)),
        header_timeout_s=header_timeout_s,
    )


class RepeatFilter(logging.Filter):
    """Lets a message through at most once per `window_s`; the next one let through says how
    many like it were not logged. Messages are told apart by logger and the first line of
    their template (asyncio's carry the socket or transport in the lines after it)."""

    MAX_KEYS = 1024

    def __init__(self, window_s: float = LOG_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}
        """key -> (when one was last let through, how many were dropped since)"""
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg).split("\n", 1)[0])
        now = self.clock()
        with self._lock:
            shown_at, dropped = self._seen.get(key, (now, 0))
            if key in self._seen and now - shown_at < self.window_s:
                self._seen[key] = (shown_at, dropped + 1)
                return False
            if len(self._seen) >= self.MAX_KEYS:  # bounded: forget, and let each through again
                self._seen.clear()
            self._seen[key] = (now, 0)
        if dropped:
            record.msg = (
                f"{record.getMessage()}\n[{dropped} more like this in the last "
                f"{now - shown_at:.0f} s were not logged]"
            )
            record.args = None
        return True


def install_log_limits(window_s: float = LOG_WINDOW_S) -> None:
    """A RepeatFilter on the loggers a flood of connections writes to (asyncio's accept
    errors, uvicorn's invalid requests); once per logger."""
    for name in RATE_LIMITED_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(existing, RepeatFilter) for existing in logger.filters):
            logger.addFilter(RepeatFilter(window_s))
