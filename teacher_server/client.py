"""The async client of the teacher service: the only way rollout and training code call it."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import httpx

from teacher_server.api import (
    CLIENT_KEEP_ALIVE_S,
    ReloadRequest,
    ReloadResult,
    ScoreItem,
    ScoreRequest,
    ScoreResponse,
    ScoreResult,
    ServerInfo,
    SessionDeleted,
    TrajectoryScoreRequest,
    TrajectoryScoreResponse,
)

CONTROL_CONNECTIONS = 4
"""A client's connections for session deletes and info calls, beside its scoring ones."""


class TeacherError(RuntimeError):
    """Any failure talking to the teacher service."""


class TeacherBadRequest(TeacherError):
    """The service refused the request for good (HTTP 400/404/413/422): retrying the same
    request cannot succeed; the message names the field or the limit."""


class TeacherUnauthorized(TeacherError):
    """Missing or wrong API key (HTTP 401)."""


class TeacherOverloaded(TeacherError):
    """Still 503 after every retry."""


class TeacherUnavailable(TeacherError):
    """Connection failures after every retry."""


class TeacherTimeout(TeacherError):
    """A request ran past its deadline."""


class TeacherClient:
    """`async with TeacherClient(url) as teacher: results = await teacher.score(items)`.

    At most `max_concurrency` scoring requests in flight; session deletes and info calls
    have a pool of their own (CONTROL_CONNECTIONS), so they never wait behind scoring (a
    round of 32 trajectories ending together deletes 32 sessions while their last spans
    are scored). Each request has a deadline of `timeout_s`;
    connection errors and 503 answers are retried `retries` times with jittered
    exponential backoff (honouring Retry-After); 4xx answers (a body or batch over the
    server's limits: 413) are not retried.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        max_concurrency: int = 16,
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.25,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = base_url.rstrip("/")
        """The service's address: every error names it (a job has several peers)."""

        def pool(connections: int) -> httpx.AsyncClient:
            return httpx.AsyncClient(
                base_url=self.url,
                headers=headers,
                timeout=timeout_s,
                limits=httpx.Limits(
                    max_connections=connections, keepalive_expiry=CLIENT_KEEP_ALIVE_S
                ),
                transport=transport,
            )

        self._http, self._control = pool(max_concurrency), pool(CONTROL_CONNECTIONS)
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._control_semaphore = asyncio.Semaphore(CONTROL_CONNECTIONS)
        self.retries = retries
        self.backoff_s = backoff_s

    async def __aenter__(self) -> TeacherClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()
        await self._control.aclose()

    async def score(self, items: Sequence[ScoreItem]) -> list[ScoreResult]:
        body = ScoreRequest(requests=list(items)).model_dump(mode="json")
        payload = await self._call("POST", "/v1/score", json=body)
        results = ScoreResponse.model_validate(payload).results
        for item, result in zip(items, results, strict=True):
            expected = len(item.input_ids) - item.span_start
            if len(result.logprobs) != expected:  # invariant 2: asserted, never trimmed
                raise TeacherError(
                    f"teacher returned {len(result.logprobs)} log-probs for a span of {expected}"
                )
        return results

    async def score_span(
        self,
        input_ids: Sequence[int],
        span_start: int,
        *,
        top_k: int = 0,
        session_id: str | None = None,
        temperature: float = 1.0,
    ) -> ScoreResult:
        item = ScoreItem(
            input_ids=list(input_ids),
            span_start=span_start,
            top_k=top_k,
            session_id=session_id,
            temperature=temperature,
        )
        return (await self.score([item]))[0]

    async def score_trajectory(self, request: TrajectoryScoreRequest) -> list[ScoreResult]:
        """Every turn's span of one trajectory in one request (hf backend)."""
        payload = await self._call(
            "POST", "/v1/score_trajectory", json=request.model_dump(mode="json")
        )
        results = TrajectoryScoreResponse.model_validate(payload).results
        if len(results) != len(request.turns):
            raise TeacherError(f"asked for {len(request.turns)} turns, got {len(results)}")
        for turn, result in zip(request.turns, results, strict=True):
            if len(result.logprobs) != len(turn.span_ids):  # invariant 2
                raise TeacherError(
                    f"teacher returned {len(result.logprobs)} log-probs for a span of "
                    f"{len(turn.span_ids)}"
                )
        return results

    async def reload(self, model_dir: str) -> ReloadResult:
        """Have the service serve the weights in `model_dir` (needs its API key)."""
        body = ReloadRequest(model_dir=model_dir).model_dump(mode="json")
        return ReloadResult.model_validate(await self._call("POST", "/v1/reload", json=body))

    async def drop_session(self, session_id: str) -> bool:
        # quoted whole, dots too: a trajectory id like "task#0" would end the path at '#',
        # and an id ".." would be resolved away as a dot segment
        segment = quote(session_id, safe="").replace(".", "%2E")
        payload = await self._call("DELETE", f"/v1/sessions/{segment}", control=True)
        return SessionDeleted.model_validate(payload).deleted

    async def info(self) -> ServerInfo:
        return ServerInfo.model_validate(await self._call("GET", "/v1/info", control=True))

    async def _call(self, method: str, path: str, control: bool = False, **kwargs: Any) -> Any:
        attempt, request = 0, f"{method} {self.url}{path}"
        http, semaphore = (
            (self._control, self._control_semaphore) if control else (self._http, self._semaphore)
        )
        while True:
            try:
                async with semaphore:
                    response = await http.request(method, path, **kwargs)
            except httpx.TimeoutException as err:
                raise TeacherTimeout(f"{request}: no answer in time ({err})") from err
            except httpx.TransportError as err:
                if attempt >= self.retries:
                    raise TeacherUnavailable(f"{request}: {err}") from err
                await self._sleep(attempt, None)
                attempt += 1
                continue
            if response.status_code == 200:
                return response.json()
            detail = _detail(response)
            if response.status_code in (400, 404, 413, 422):
                raise TeacherBadRequest(f"{request}: {detail}")
            if response.status_code == 401:
                raise TeacherUnauthorized(f"{request}: {detail}")
            if response.status_code == 503:
                if attempt >= self.retries:
                    raise TeacherOverloaded(
                        f"{request}: still overloaded after {self.retries} retries: {detail}"
                    )
                await self._sleep(attempt, response.headers.get("Retry-After"))
                attempt += 1
                continue
            raise TeacherError(f"{request}: {response.status_code} {detail}")

    async def _sleep(self, attempt: int, retry_after: str | None) -> None:
        delay = self.backoff_s * (2**attempt) * (0.5 + random.random())
        if retry_after is not None:
            with contextlib.suppress(ValueError):
                delay = max(delay, float(retry_after))
        await asyncio.sleep(delay)


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail", response.text))
    except ValueError:
        return response.text[:500]
