"""The service's door: requests refused from their headers, before the body is read.

A plain ASGI middleware, because FastAPI reads and parses a whole body before any route
dependency runs: an unauthenticated or oversized body would otherwise cost its full size
in memory and parse time before being refused.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from teacher_server.api import ServerInfo

PROTECTED_PREFIX = "/v1/"
"""Paths that need the API key; /health, /metrics and the API docs do not."""
BYTES_PER_ID = 10
"""JSON bytes of one token id at most: up to 8 digits and a separator."""
MIN_BODY_BYTES = 2**20


def default_max_body_bytes(info: ServerInfo) -> int:
    """Room for a full batch of max-context items: BYTES_PER_ID x max_context x
    max_batch_size, at least MIN_BODY_BYTES."""
    return max(MIN_BODY_BYTES, BYTES_PER_ID * info.max_context * info.max_batch_size)


class RequestGuard:
    """401 for a missing or wrong bearer token under PROTECTED_PREFIX, then 413 for a body
    over `max_body_bytes()`: from Content-Length before reading, else counted while the
    body streams in (chunked), never read past the limit. The body then reaches the app
    whole, as one message."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: Callable[[], int],
        count_error: Callable[[int], None] = lambda status: None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.count_error = count_error  # each refusal's status: errors_total counts them

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not self._authorized(scope["path"], headers):
            refusal = JSONResponse(
                {"detail": "missing or wrong bearer token"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            self.count_error(401)
            await refusal(scope, receive, send)
            return
        limit = self.max_body_bytes()
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            self.count_error(413)
            await _too_large(declared, limit)(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                self.count_error(413)
                await _too_large(f"over {limit}", limit)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks)}
        chunks.clear()

        async def replay() -> Message:
            nonlocal body
            if body is None:
                return await receive()
            message, body = body, None
            return message

        await self.app(scope, replay, send)

    def _authorized(self, path: str, headers: Headers) -> bool:
        if self.api_key is None or not path.startswith(PROTECTED_PREFIX):
            return True
        scheme, token = get_authorization_scheme_param(headers.get("authorization"))
        return scheme.lower() == "bearer" and secrets.compare_digest(
            token.encode(), self.api_key.encode()
        )


def _too_large(size: str, limit: int) -> JSONResponse:
    return JSONResponse(
        {
            "detail": f"request body: {size} bytes, at most {limit} are accepted "
            "(the server's --max-body-mb)"
        },
        status_code=413,
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
