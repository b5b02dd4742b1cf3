"""Hostile connections (issue 39): what a client can hold without making a request, or while
it makes one slowly, and what the teacher service does about it.

Each attack is run against the defence (connections.BoundedH11Protocol, the guard's body
deadline and body budget) and, as its positive control, without it: uvicorn's own h11
protocol, or a guard without that limit, where the attack still works.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from typer.testing import CliRunner
from uvicorn.protocols.http.h11_impl import H11Protocol

from teacher_server.cli import app
from teacher_server.connections import (
    ConnectionLimits,
    RepeatFilter,
    TooManyConnections,
    bounded_protocol,
    default_max_connections,
    limits_within,
)
from teacher_server.guards import RequestGuard
from teacher_server.metrics import ServerMetrics
from tests.live_server import free_port, serve_in_thread, wait_until_healthy

HEADER_TIMEOUT_S = 0.5
CAP = 20
KEYED_GET = b"GET /v1/echo HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n\r\n"
SLOW_HEADERS = b"GET /v1/echo HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 200
"""Sent a byte every 0.1 s: a request whose headers are never complete."""


def _app(
    released: threading.Event | None = None, held: list[int] | None = None, **guard: Any
) -> RequestGuard:
    """The guard (key "k", bodies up to 64 KiB) over /v1/echo, which answers the size of the
    body it was handed, and /v1/hold, which first waits for `released` (counted in `held`)."""

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"bytes": len(await request.body())})

    async def hold(request: Request) -> JSONResponse:
        size = len(await request.body())
        assert released is not None and held is not None
        held.append(size)
        while not released.is_set():
            await asyncio.sleep(0.02)
        return JSONResponse({"bytes": size})

    routes = [
        Route("/v1/echo", echo, methods=["GET", "POST"]),
        Route("/v1/hold", hold, methods=["POST"]),
    ]
    limits: dict[str, Any] = {"max_body_bytes": lambda: 2**16, **guard}
    return RequestGuard(Starlette(routes=routes), api_key="k", **limits)


def _bounded(
    metrics: ServerMetrics | None = None,
    max_connections: int = CAP,
    header_timeout_s: float = HEADER_TIMEOUT_S,
) -> type[H11Protocol]:
    limits = ConnectionLimits(max_connections=max_connections, header_timeout_s=header_timeout_s)
    return bounded_protocol(limits, metrics)


def _open(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _closed_after(sock: socket.socket, wait_s: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closed `sock`, sending `trickle` a byte every 0.1 s
    meanwhile; None if it is still open after `wait_s`."""
    started = time.monotonic()
    sock.settimeout(0.1)
    while (elapsed := time.monotonic() - started) < wait_s:
        try:
            if trickle:
                sock.sendall(trickle[:1])
                trickle = trickle[1:]
            if sock.recv(4096) == b"":
                return elapsed
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return elapsed
    return None


def _response(sock: socket.socket, timeout_s: float = 5) -> bytes:
    """One whole response (a Content-Length body) read from `sock`."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":")[1])
        for line in head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def _wait_for(condition: Callable[[], bool], timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.02)


def _still_open(sockets: list[socket.socket]) -> list[bool]:
    """Whether the server has left each socket open (no EOF, no reset waiting in it)."""
    states = []
    for sock in sockets:
        sock.setblocking(False)
        try:
            states.append(sock.recv(1) != b"")
        except BlockingIOError:
            states.append(True)
        except ConnectionResetError:
            states.append(False)
    return states


@pytest.mark.timeout(30)
def test_a_connection_that_sends_nothing_is_closed_at_the_header_deadline() -> None:
    with serve_in_thread(_app(), http=_bounded()) as url, _open(url) as idle:
        closed = _closed_after(idle, 5)
    assert closed is not None and HEADER_TIMEOUT_S * 0.8 <= closed < HEADER_TIMEOUT_S + 2
    # the positive control: uvicorn's own protocol keeps it open for ever
    with serve_in_thread(_app(), http=H11Protocol) as url, _open(url) as idle:
        assert _closed_after(idle, HEADER_TIMEOUT_S + 1.5) is None


@pytest.mark.timeout(40)
def test_headers_trickled_a_byte_at_a_time_are_cut_at_the_header_deadline() -> None:
    """On a new connection, and on a kept-alive one after an answer; between requests the
    connection stays uvicorn's keep-alive time, not the header deadline."""
    for protocol, defended in ((_bounded(), True), (H11Protocol, False)):
        with serve_in_thread(_app(), http=protocol) as url:
            with _open(url) as fresh:
                closed_fresh = _closed_after(fresh, HEADER_TIMEOUT_S + 1.5, SLOW_HEADERS)
            with _open(url) as reused:
                reused.sendall(KEYED_GET)
                assert _response(reused).startswith(b"HTTP/1.1 200")
                assert _closed_after(reused, HEADER_TIMEOUT_S * 2) is None  # kept alive
                closed_reused = _closed_after(reused, HEADER_TIMEOUT_S + 1.5, SLOW_HEADERS)
        if defended:
            assert closed_fresh is not None and closed_reused is not None
        else:  # the positive control: the trickle holds both connections
            assert closed_fresh is None and closed_reused is None


@pytest.mark.timeout(40)
def test_at_the_cap_the_oldest_idle_connections_make_room_for_a_keyed_client() -> None:
    metrics = ServerMetrics()
    extra = 10
    with serve_in_thread(_app(), http=_bounded(metrics, header_timeout_s=60)) as url:
        idle = [_open(url) for _ in range(CAP + extra)]
        _wait_for(lambda: metrics.connections_closed_total.get("evicted", 0) == extra)
        started = time.monotonic()
        answer = httpx.get(f"{url}/v1/echo", headers={"Authorization": "Bearer k"}, timeout=5)
        assert answer.status_code == 200 and time.monotonic() - started < 2
        # the keyed client's connection took the place of the oldest idle one left
        _wait_for(lambda: _still_open(idle).count(True) == CAP - 1)
        assert _still_open(idle) == [False] * (extra + 1) + [True] * (CAP - 1)
        assert metrics.connections <= CAP
        for sock in idle:
            sock.close()
    # the positive control: uvicorn's own protocol keeps every idle connection ...
    with serve_in_thread(_app(), http=H11Protocol) as url:
        idle = [_open(url) for _ in range(CAP + extra)]
        time.sleep(0.5)
        assert all(_still_open(idle))
        for sock in idle:
            sock.close()
    # ... and uvicorn's limit_concurrency refuses the keyed client, not the idle ones
    with serve_in_thread(_app(), http=H11Protocol, limit_concurrency=CAP) as url:
        idle = [_open(url) for _ in range(CAP + extra)]
        time.sleep(0.5)
        answer = httpx.get(f"{url}/v1/echo", headers={"Authorization": "Bearer k"}, timeout=5)
        assert answer.status_code == 503 and all(_still_open(idle))
        for sock in idle:
            sock.close()


@pytest.mark.timeout(30)
def test_at_the_cap_with_every_connection_in_a_request_a_new_one_is_closed() -> None:
    """Requests in progress are never cut for room: the newcomer is."""
    metrics = ServerMetrics()
    released = threading.Event()
    held: list[int] = []
    app = _app(released, held)
    cap = 3
    with serve_in_thread(app, http=_bounded(metrics, max_connections=cap)) as url:
        holders = [_open(url) for _ in range(cap)]
        for sock in holders:
            sock.sendall(
                b"POST /v1/hold HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n"
                b"Content-Length: 3\r\n\r\nabc"
            )
        _wait_for(lambda: len(held) == cap)
        with _open(url) as newcomer:
            closed = _closed_after(newcomer, 3)
        assert closed is not None and closed < 1
        assert metrics.connections_closed_total == {"over_cap": 1}
        released.set()
        for sock in holders:
            assert _response(sock).startswith(b"HTTP/1.1 200")
        # answered, the holders are idle: a new connection makes room again
        answer = httpx.get(f"{url}/v1/echo", headers={"Authorization": "Bearer k"}, timeout=5)
        assert answer.status_code == 200
        for sock in holders:
            sock.close()


def _big_answer_app() -> Starlette:
    """GET /v1/big: a 32 MiB answer."""

    async def big(_: Request) -> Response:
        return Response(b"x" * BIG_ANSWER, media_type="application/octet-stream")

    return Starlette(routes=[Route("/v1/big", big)])


BIG_ANSWER = 32 * 2**20


def _received(sock: socket.socket) -> int:
    """Bytes read from `sock` until the server ends the connection (EOF or reset)."""
    sock.settimeout(5)
    total = 0
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        while chunk := sock.recv(2**20):
            total += len(chunk)
            if total > BIG_ANSWER:
                break
    return total


@pytest.mark.timeout(60)
def test_an_answer_the_client_never_reads_is_dropped_at_the_write_deadline() -> None:
    """A client that asks and never reads leaves the answer in the server's buffer for as
    long as it likes (uvicorn's close waits for the buffer): the write deadline drops it."""
    for defended in (True, False):
        metrics = ServerMetrics()
        limits = ConnectionLimits(max_connections=CAP, write_timeout_s=0.5)
        protocol = bounded_protocol(limits, metrics) if defended else H11Protocol
        with serve_in_thread(_big_answer_app(), http=protocol) as url, socket.socket() as sock:
            host, port = url.removeprefix("http://").split(":")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            sock.sendall(b"GET /v1/big HTTP/1.1\r\nHost: t\r\n\r\n")
            time.sleep(3)  # never read
            received = _received(sock)
        if defended:
            assert received < BIG_ANSWER
            assert metrics.connections_closed_total.get("write_timeout") == 1
        else:  # the control: the server still held the whole answer for this client
            assert received > BIG_ANSWER


@pytest.mark.timeout(30)
def test_a_body_not_complete_at_the_body_deadline_is_408_and_its_connection_closed() -> None:
    """The header deadline (0.5 s) does not cut a request whose body is coming: the body
    deadline (1 s) does, with an answer."""
    partial_body = (
        b"POST /v1/echo HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n"
        b"Content-Length: 100\r\n\r\n" + b"x" * 10
    )
    errors: list[int] = []
    app = _app(body_timeout_s=1.0, count_error=errors.append)
    with serve_in_thread(app, http=_bounded()) as url, _open(url) as slow:
        started = time.monotonic()
        slow.sendall(partial_body)
        answer = _response(slow)
        elapsed = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout-s" in answer
        assert 0.9 <= elapsed < 3
        assert _closed_after(slow, 2) is not None
    assert errors == [408]
    # the positive control: without a body deadline the same request holds its connection
    app = _app(body_timeout_s=3600)
    with serve_in_thread(app, http=_bounded()) as url, _open(url) as slow:
        slow.sendall(partial_body)
        assert _closed_after(slow, 2.5) is None


async def _chunked(body: bytes) -> AsyncIterator[bytes]:
    yield body  # a generator: httpx sends it chunked, without Content-Length


def test_bodies_past_the_inflight_budget_are_503_until_room_is_made() -> None:
    """Two held requests of 1000 bytes fill a budget of 2000: a third body, declared or
    chunked, is refused 503 with Retry-After until they are answered."""

    async def run(budget: int) -> tuple[list[int], list[int], int]:
        released = threading.Event()
        held: list[int] = []
        errors: list[int] = []
        guard = _app(
            released,
            held,
            max_body_bytes=lambda: 1000,
            max_inflight_body_bytes=budget,
            count_error=errors.append,
        )
        key = {"Authorization": "Bearer k"}
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            holders = [
                asyncio.create_task(http.post("/v1/hold", content=b"x" * 1000, headers=key))
                for _ in range(2)
            ]
            while len(held) < 2:
                await asyncio.sleep(0.01)
            declared = await http.post("/v1/echo", content=b"x" * 10, headers=key)
            chunked = await http.post("/v1/echo", content=_chunked(b"x" * 10), headers=key)
            statuses = [declared.status_code, chunked.status_code]
            if declared.status_code == 503:
                assert declared.headers["Retry-After"] == "1"
                assert "--max-inflight-body-mb" in declared.json()["detail"]
            released.set()
            assert [(await holder).status_code for holder in holders] == [200, 200]
            assert guard.inflight_body_bytes == 0  # every reservation returned
            after = await http.post("/v1/echo", content=b"x" * 10, headers=key)
            return [*statuses, after.status_code], errors, guard.inflight_body_bytes

    statuses, errors, left = asyncio.run(run(budget=2000))
    assert statuses == [503, 503, 200] and errors == [503, 503] and left == 0
    # the positive control: with no budget in effect, every body is buffered beside the rest
    statuses, errors, _ = asyncio.run(run(budget=10**12))
    assert statuses == [200, 200, 200] and errors == []


def test_a_repeated_log_message_is_let_through_once_per_window_with_a_count() -> None:
    now = [0.0]
    repeats = RepeatFilter(window_s=10, clock=lambda: now[0])

    def record(message: str) -> logging.LogRecord:
        lines = f"{message}\nsocket: <fd={len(message)}>"  # asyncio puts the socket after
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, lines, None, None)

    passed = []
    for second in range(30):
        now[0] = float(second)
        for _ in range(100):  # a hundred failed accepts a second
            entry = record("socket.accept() out of system resource")
            if repeats.filter(entry):
                passed.append(entry.getMessage())
        if second == 5:
            assert repeats.filter(record("another message"))
    assert len(passed) == 3
    assert "not logged" not in passed[0]
    assert "[999 more like this in the last 10 s were not logged]" in passed[1]


def test_the_cap_leaves_descriptors_for_the_rest_of_the_service() -> None:
    assert default_max_connections(256) == 128
    assert default_max_connections(4096) == 4096 - 1024
    assert default_max_connections(1_048_576) == 16_384
    # sockets accepted in one turn are counted later: the backlog fits in what is left
    assert limits_within(256, None, 10).accept_backlog == 32
    assert limits_within(1_048_576, None, 10).accept_backlog == 512
    with pytest.raises(TooManyConnections, match="set at most 896, or raise the limit"):
        limits_within(1024, 1000, 10)


def test_a_cap_over_the_descriptor_limit_is_one_line_before_the_model_is_looked_at() -> None:
    result = CliRunner().invoke(
        app,
        ["serve", "--model", "/nope", "--port", str(free_port()), "--max-connections", "10000000"],
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--max-connections 10000000 leaves fewer than 128" in result.output


SERVE = [sys.executable, "-m", "teacher_server", "serve"]
UNDEFENDED = [
    sys.executable,
    "-c",
    "import sys; from uvicorn.protocols.http.h11_impl import H11Protocol; "
    "from teacher_server import connections; "
    "connections.bounded_protocol = lambda limits, metrics=None: H11Protocol; "
    "connections.install_log_limits = lambda: None; "
    "from teacher_server.cli import main; main()",
    "serve",
]
"""`opd-teacher serve` with uvicorn's own protocol and no log filter: today's service."""
DESCRIPTORS = 256


def _low_descriptor_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, DESCRIPTORS))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("defended", [True, False], ids=["defended", "positive-control"])
def test_idle_connections_past_the_descriptor_limit_leave_keyed_clients_served(
    defended: bool, tmp_path: Path
) -> None:
    """The real service under a descriptor limit of 256, and up to 400 connections that
    never send a byte: keyed requests still get answers, and the log stays a few lines."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    command = SERVE if defended else UNDEFENDED
    with log.open("w") as sink:
        server = subprocess.Popen(
            [*command, "--model", "bundled:teacher", "--port", str(port), "--api-key", "k"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            preexec_fn=_low_descriptor_limit,
        )
    attackers: list[socket.socket] = []
    try:
        wait_until_healthy(url, server, log, timeout_s=100)
        started_at = len(log.read_text())
        for index in range(400):
            try:  # established once queued for accept(); a full queue drops the handshake
                attackers.append(socket.create_connection(("127.0.0.1", port), timeout=3))
            except TimeoutError:  # the service accepts no more: the attack has done its work
                break
            if index % 16 == 15:  # paced, so that a slow accept loop is not what stops it
                time.sleep(0.02)
        time.sleep(1)
        answers = []
        for _ in range(3):
            try:
                answer = httpx.get(
                    f"{url}/v1/info", headers={"Authorization": "Bearer k"}, timeout=4
                )
                answers.append(answer.status_code)
            except httpx.TransportError as err:  # timeouts included
                answers.append(type(err).__name__)
                break
        text = log.read_text()
        written = text[started_at:]
        if defended:
            assert answers == [200, 200, 200], (answers, text)
            assert f"at most {DESCRIPTORS // 2} connections" in text
            assert "out of system resource" not in written, written
            assert len(written.splitlines()) <= len(answers), written  # the request log
            metrics = httpx.get(f"{url}/metrics", timeout=4).text
            open_now = next(
                int(line.split()[1])
                for line in metrics.splitlines()
                if line.startswith("opd_teacher_connections ")
            )
            assert open_now <= DESCRIPTORS // 2
            # serve installed the log filter: uvicorn's warning for each malformed request
            # is logged once (the next one, 10 s on, would say how many were dropped)
            for _ in range(30):
                with socket.create_connection(("127.0.0.1", port), timeout=4) as bad:
                    bad.sendall(b"NOT HTTP\r\n\r\n")
                    assert bad.recv(4096).startswith(b"HTTP/1.1 400")
            time.sleep(0.5)
            assert log.read_text()[started_at:].count("Invalid HTTP request") == 1
        else:  # the positive control: descriptors run out, the keyed client times out
            assert 200 not in answers, (answers, text)
            # and asyncio logs a traceback per failed accept, a growing number a second
            assert written.count("out of system resource") >= 50, written
    finally:
        for sock in attackers:
            sock.close()
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.mark.timeout(30)
def test_a_body_on_a_request_that_takes_none_is_refused_from_the_headers() -> None:
    """Only POSTs under /v1/ take a body: a keyless GET /health declaring one is answered
    413 at once and its connection closed, so it holds neither a connection in a request
    nor the body budget until the body deadline (review of issue 39)."""
    guard = _app()
    with serve_in_thread(guard, http=_bounded()) as url:
        for request in (
            b"GET /health HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n",
            b"GET /health HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"DELETE /v1/echo HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n"
            b"Content-Length: 5\r\n\r\n",
        ):
            with _open(url) as sock:
                sock.sendall(request)
                answer = _response(sock, timeout_s=2)
                assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
                assert b"takes no body" in answer
                assert _closed_after(sock, 2) is not None
        assert guard.inflight_body_bytes == 0
        # the control: where a body is taken, the guard waits for it
        with _open(url) as sock:
            sock.sendall(
                b"POST /v1/echo HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n"
                b"Content-Length: 5\r\n\r\n"
            )
            sock.settimeout(1)
            with pytest.raises(TimeoutError):
                sock.recv(100)
