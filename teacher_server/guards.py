"""The service's door: requests refused from their headers, before the body is read, and
bodies read within a deadline and a budget of bytes buffered at once.

A plain ASGI middleware, because FastAPI reads and parses a whole body before any route
dependency runs: an unauthenticated or oversized body would otherwise cost its full size
in memory and parse time before being refused.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from teacher_server.api import ServerInfo
from teacher_server.body_route import RETRY_AFTER_S

PROTECTED_PREFIX = "/v1/"
"""Paths that need the API key; /health, /metrics and the API docs do not."""
BYTES_PER_ID = 10
"""JSON bytes of one token id at most: up to 8 digits and a separator."""
MIN_BODY_BYTES = 2**20
DEFAULT_BODY_TIMEOUT_S = 60.0
INFLIGHT_BODIES = 4
"""The default budget of bodies buffered at once, all requests together: this many of the
per-request body limit."""


def default_max_body_bytes(info: ServerInfo) -> int:
    """Room for a full batch of max-context items: BYTES_PER_ID x max_context x
    max_batch_size, at least MIN_BODY_BYTES."""
    return max(MIN_BODY_BYTES, BYTES_PER_ID * info.max_context * info.max_batch_size)


class Refusal(Exception):
    """A request the guard answers itself, with `response`, and counts (count_error). The
    answer closes the connection: the body behind it is left unread, and a client that
    went on sending it would otherwise have it read and dropped."""

    def __init__(self, status_code: int, detail: str, headers: dict[str, str] | None = None):
        super().__init__(detail)
        self.status_code = status_code
        self.response = JSONResponse(
            {"detail": detail},
            status_code=status_code,
            headers={**(headers or {}), "Connection": "close"},
        )


@dataclass
class BodyReservation:
    """One request's bytes in RequestGuard.inflight_body_bytes."""

    size: int = 0


class RequestGuard:
    """Refuses from the headers, before the body is read: 401 for a missing or wrong bearer
    token under PROTECTED_PREFIX, 413 for a body on a request that takes none (takes_body)
    or a Content-Length over `max_body_bytes()`. A body is reserved in
    `max_inflight_body_bytes` (default INFLIGHT_BODIES x the body limit, never less than
    one body) as its bytes arrive, so that a declared length nobody sends holds nothing;
    503 (Retry-After) once the bodies of other requests leave no room, 413 past the body
    limit, never read past either. A body not complete within `body_timeout_s` of its
    headers is answered 408 and its connection closed.

    The body then reaches the app whole, as one message; its bytes stay reserved until the
    app returned (its answer was sent), so buffered bodies stay within the budget."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: Callable[[], int],
        count_error: Callable[[int], None] = lambda status: None,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        max_inflight_body_bytes: int | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.count_error = count_error  # each refusal's status: errors_total counts them
        self.body_timeout_s = body_timeout_s
        self.max_inflight_body_bytes = max_inflight_body_bytes
        self.inflight_body_bytes = 0
        """Body bytes reserved by the requests in the guard now (one event loop: no lock)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        reservation = BodyReservation()
        try:
            try:
                self._refuse_from_headers(scope, headers)
                if not takes_body(scope):
                    body = None
                elif (body := await self._read_body(headers, receive, reservation)) is None:
                    return  # the client left: nothing to answer
            except Refusal as refusal:
                self.count_error(refusal.status_code)
                await refusal.response(scope, receive, send)
                return
            if body is None:  # nothing was read: the app reads as it would
                await self.app(scope, receive, send)
                return

            async def replay() -> Message:
                nonlocal body
                if body is None:
                    return await receive()
                message, body = body, None
                return message

            await self.app(scope, replay, send)
        finally:
            self.inflight_body_bytes -= reservation.size

    def _refuse_from_headers(self, scope: Scope, headers: Headers) -> None:
        """Refusal for a missing or wrong key, or a body on a request that takes none."""
        if not self._authorized(scope["path"], headers):
            raise Refusal(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
        declared = headers.get("content-length") or "0"
        if not takes_body(scope) and (declared != "0" or "transfer-encoding" in headers):
            raise Refusal(413, f"{scope['method']} {scope['path']} takes no body")

    async def _read_body(
        self, headers: Headers, receive: Receive, reservation: BodyReservation
    ) -> Message | None:
        """The whole body as one message, None if the client left first; raises Refusal."""
        declared = headers.get("content-length")
        limit = self.max_body_bytes()
        budget = max(limit, self.max_inflight_body_bytes or INFLIGHT_BODIES * limit)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(declared, limit)
        try:
            return await asyncio.wait_for(
                self._receive_body(receive, limit, budget, reservation), self.body_timeout_s
            )
        except asyncio.TimeoutError:
            raise Refusal(
                408,
                f"request body: not complete {self.body_timeout_s:g} s after its headers "
                "(the server's --body-timeout-s)",
            ) from None

    async def _receive_body(
        self, receive: Receive, limit: int, budget: int, reservation: BodyReservation
    ) -> Message | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(f"over {limit}", limit)
            self._reserve(reservation, size, budget)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks)}

    def _reserve(self, reservation: BodyReservation, size: int, budget: int) -> None:
        """Grow `reservation` to `size` bytes, or refuse (503) when the bodies of other
        requests leave no room for it in `budget`."""
        if size <= reservation.size:
            return
        others = self.inflight_body_bytes - reservation.size
        if others + size > budget:
            raise Refusal(
                503,
                f"requests in progress hold {others} bytes of bodies (bound {budget}, the "
                "server's --max-inflight-body-mb); retry later",
                {"Retry-After": str(RETRY_AFTER_S)},
            )
        self.inflight_body_bytes += size - reservation.size
        reservation.size = size

    def _authorized(self, path: str, headers: Headers) -> bool:
        if self.api_key is None or not path.startswith(PROTECTED_PREFIX):
            return True
        scheme, token = get_authorization_scheme_param(headers.get("authorization"))
        return scheme.lower() == "bearer" and secrets.compare_digest(
            token.encode(), self.api_key.encode()
        )


def takes_body(scope: Scope) -> bool:
    """Only POSTs under PROTECTED_PREFIX take a body: no other request can make the guard
    wait for, or hold, body bytes (a keyless GET /health declaring a body would otherwise
    hold a connection and the body budget until the body deadline)."""
    return scope["method"] == "POST" and scope["path"].startswith(PROTECTED_PREFIX)


def _too_large(size: str, limit: int) -> Refusal:
    return Refusal(
        413,
        f"request body: {size} bytes, at most {limit} are accepted (the server's --max-body-mb)",
    )


REQUEST_LOG = logging.getLogger("opd-teacher.requests")


class RequestLog:
    """One line per request once its answer is sent: client, method, path, status, body
    bytes in and out, milliseconds; a request the client left before its answer is logged
    with status '-'. Health checks are left out (load balancers ask every few seconds)."""

    QUIET_PATHS = ("/health",)

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.QUIET_PATHS:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status: int | None = None
        sent = received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            return message

        async def counting_send(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counting_receive, counting_send)
        finally:
            client = scope.get("client") or ("-", 0)
            REQUEST_LOG.info(
                "%s %s %s %s %d B in, %d B out, %.0f ms",
                client[0],
                scope["method"],
                scope["path"],
                "-" if status is None else status,
                received,
                sent,
                (time.perf_counter() - started) * 1000,
            )
