"""The HTTP service: FastAPI over a scoring backend."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.security import HTTPBearer

from teacher_server import docs_page
from teacher_server.api import (
    ErrorBody,
    Health,
    ReloadRequest,
    ReloadResult,
    ScoreRequest,
    ScoreResponse,
    ServerInfo,
    SessionDeleted,
    TrajectoryScoreRequest,
    TrajectoryScoreResponse,
)
from teacher_server.backend import (
    BackendFailure,
    BadScoreRequest,
    Overloaded,
    RequestTooLarge,
    ScoringBackend,
)
from teacher_server.body_route import RETRY_AFTER_S, BodyChecker, TokenBudget, json_body_route
from teacher_server.guards import (
    DEFAULT_BODY_TIMEOUT_S,
    RequestGuard,
    RequestLog,
    default_max_body_bytes,
)
from teacher_server.metrics import ServerMetrics

BEARER = Depends(HTTPBearer(auto_error=False))
"""Declares the bearer scheme in /openapi.json; RequestGuard checks the key, before the
body is read (a route dependency would run after FastAPI read and parsed it)."""


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    meaning = {
        400: "Bad input; the message names the field",
        401: "Missing or wrong API key",
        403: "Not allowed on this server (reload needs a server with an API key)",
        413: "Body over the server's --max-body-mb, more items than its queue holds, or "
        "costing more tokens than --max-request-tokens (or --max-inflight-tokens)",
        422: "Malformed request body, or a value out of its range",
        500: "The backend failed",
        503: "Queue or in-flight token budget full; retry after the Retry-After header",
    }
    return {code: {"model": ErrorBody, "description": meaning[code]} for code in codes}


def create_app(
    backend: ScoringBackend,
    metrics: ServerMetrics,
    api_key: str | None = None,
    max_body_bytes: int | None = None,
    request_log: bool = False,
    max_inflight_tokens: int | None = None,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    max_inflight_body_bytes: int | None = None,
) -> FastAPI:
    """`max_body_bytes`: larger bodies are answered 413 unread; None derives it from the
    backend's limits (guards.default_max_body_bytes). `request_log`: one line per request
    on the `opd-teacher.requests` logger (guards.RequestLog). `max_inflight_tokens`: the
    tokens (backend.request_tokens) of the requests served at once (body_route); None:
    body_route.INFLIGHT_REQUESTS x the backend's max_request_tokens. `body_timeout_s`,
    `max_inflight_body_bytes`: the guard's body deadline and budget (guards.RequestGuard)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        try:
            yield
        finally:
            checker.stop()
            await backend.stop()

    app = FastAPI(
        title="opd-teacher",
        version="1",
        description="Teacher log-probs of given token spans, with per-session prefix reuse.",
        lifespan=lifespan,
        docs_url=None,  # Swagger UI and ReDoc load their assets from a CDN: /docs below
        redoc_url=None,
    )

    def body_limit() -> int:
        # read per request: the sglang backend learns its context length in start()
        return max_body_bytes or default_max_body_bytes(backend.info())

    budget = TokenBudget(backend.info, max_inflight_tokens)
    checker = BodyChecker()
    body_route = json_body_route(budget, metrics.count_error, checker)

    app.add_middleware(
        RequestGuard,
        api_key=api_key,
        max_body_bytes=body_limit,
        count_error=metrics.count_error,
        body_timeout_s=body_timeout_s,
        max_inflight_body_bytes=max_inflight_body_bytes,
    )
    if request_log:  # outermost: the guard's refusals are logged too
        app.add_middleware(RequestLog)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        problems = []
        for error in err.errors()[:5]:  # path and query parameters: bodies are body_route's
            where = ".".join(str(part) for part in error["loc"] if part != "body") or "body"
            problems.append(f"{where}: {error['msg']}"[:300])
        return JSONResponse({"detail": "; ".join(problems)}, status_code=422)

    def post(path: str, endpoint: Any, response_model: Any, *codes: int) -> None:
        """A POST route with a JSON body (body_route.JSONBodyRoute)."""
        app.router.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            response_model=response_model,
            dependencies=[BEARER],
            responses=_errors(*codes),
            route_class_override=body_route,
        )

    async def score(request: ScoreRequest) -> Any:
        started = time.perf_counter()
        status = 200
        try:
            results = await backend.score(request.requests)
            return ScoreResponse(results=results)
        except BadScoreRequest as err:
            status = 400
            return JSONResponse({"detail": str(err)}, status_code=400)
        except RequestTooLarge as err:
            status = 413
            return JSONResponse({"detail": str(err)}, status_code=413)
        except Overloaded as err:
            status = 503
            return JSONResponse(
                {"detail": str(err)}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)}
            )
        except BackendFailure as err:
            status = 500
            return JSONResponse({"detail": str(err)}, status_code=500)
        finally:
            metrics.observe_request(len(request.requests), time.perf_counter() - started, status)

    async def score_trajectory(request: TrajectoryScoreRequest) -> Any:
        started = time.perf_counter()
        status = 200
        try:
            return TrajectoryScoreResponse(results=await backend.score_trajectory(request))
        except BadScoreRequest as err:
            status = 400
            return JSONResponse({"detail": str(err)}, status_code=400)
        except Exception as err:  # the model failed: a server error, reported as such
            status = 500
            return JSONResponse(
                {"detail": f"scoring failed: {type(err).__name__}: {err}"}, status_code=500
            )
        finally:
            metrics.observe_request(len(request.turns), time.perf_counter() - started, status)

    async def reload(request: ReloadRequest) -> Any:
        """Swap the served weights (a self-teacher refreshed from the student). Only on a
        server started with an API key: whoever can reload chooses what the teacher says."""
        if api_key is None:
            return JSONResponse(
                {"detail": "reloading weights needs a server started with --api-key"},
                status_code=403,
            )
        try:
            return await backend.reload(request.model_dir)
        except BadScoreRequest as err:
            return JSONResponse({"detail": str(err)}, status_code=400)
        except BackendFailure as err:
            return JSONResponse({"detail": str(err)}, status_code=500)

    post("/v1/score", score, ScoreResponse, 400, 401, 413, 422, 500, 503)
    post(
        "/v1/score_trajectory",
        score_trajectory,
        TrajectoryScoreResponse,
        400,
        401,
        413,
        422,
        500,
        503,
    )
    post("/v1/reload", reload, ReloadResult, 400, 401, 403, 413, 422, 500, 503)

    @app.delete(
        "/v1/sessions/{session_id:path}",  # session ids may hold '/'
        response_model=SessionDeleted,
        dependencies=[BEARER],
        responses=_errors(401, 422),
    )
    async def delete_session(session_id: str) -> SessionDeleted:
        return SessionDeleted(session_id=session_id, deleted=await backend.drop_session(session_id))

    @app.get(
        "/v1/info",
        response_model=ServerInfo,
        dependencies=[BEARER],
        responses=_errors(401),
    )
    async def info() -> ServerInfo:
        return backend.info().model_copy(update={"max_inflight_tokens": budget.limit()})

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    async def docs() -> str:
        return docs_page.render(app.openapi())

    @app.get("/health", response_model=Health)
    async def health() -> Health:
        return Health(status="ok")

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> str:
        return metrics.render(backend.metrics_text())

    return app
