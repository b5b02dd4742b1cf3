"""Routes with a JSON body, served so that no request can stall or exhaust the service.

FastAPI parses a body with json.loads and validates it on the event loop, collecting an
error per bad value, then serializes the answer on the event loop too: a body of a few MB
of bad values held the loop for seconds (health checks stalled), allocated hundreds of
times its size and was answered with tens of MB of errors. Here, per request:

1. the body is validated off the event loop, in one pass over its bytes (pydantic's own
   JSON parser, lists stopping at their first bad value: api.RequestBody), a large one
   first in a process of its own (BodyChecker); the 422 names at most MAX_PROBLEMS problems
   of at most MAX_PROBLEM_CHARS characters each;
2. it is admitted by its cost in tokens (backend.request_tokens: ids, and the top-k rows
   of its answer) against the TokenBudget of everything being served: 413 past the
   budget's whole, 503 with Retry-After while others hold it;
3. the endpoint runs until it answers or the client leaves: a client that disconnects
   has its work cancelled (queued items are then never computed);
4. the answer is serialized in a worker thread and sent a chunk at a time, each once the
   client took the one before (send_in_chunks); the reservation is returned once the last
   is handed over: what a finished answer still holds is its last chunk and the kernel's
   send buffer (connections.SEND_BUFFER_BYTES), per connection.

Path parameters and dependencies are not resolved (the guard checked the key before the
body was read): an endpoint takes exactly its body model.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from teacher_server.api import ServerInfo
from teacher_server.backend import (
    Overloaded,
    RequestTooLarge,
    check_request_tokens,
    request_tokens,
)
from teacher_server.lifetime import end_with_parent

MAX_PROBLEMS = 5
PROCESS_CHECK_BYTES = 256 * 1024
"""Bodies at least this large are checked in another process first (BodyChecker)."""
CHECKER_NICENESS = 10
ANSWER_CHUNK = 256 * 1024
"""Bytes of an answer handed to the server at a time (send_in_chunks)."""
MAX_PROBLEM_CHARS = 300
RETRY_AFTER_S = 1
JSON = "application/json"
INFLIGHT_REQUESTS = 2
"""The default max_inflight_tokens: this many requests of max_request_tokens at once."""
BYTES_PER_TOKEN = 256
"""The documented bound of what one token of a request (backend.request_tokens) costs the
server while it is served: its id parsed, its log-prob and top-k rows as Python lists and
as the serialized answer (bench/teacher_memory.py --part bounds measures the slope)."""
BYTES_PER_BODY_BYTE = 24
"""The documented bound of what one byte of an invalid body costs the server while it is
validated: pydantic parses the whole JSON before validating it (bench/teacher_memory.py
--part bounds measures it: about 20 for a list of small bad objects, 11 for bad ids)."""
T = TypeVar("T")


class InvalidBody(ValueError):
    """A body that is not valid JSON of the route's model (HTTP 422); the message is
    bounded (MAX_PROBLEMS x MAX_PROBLEM_CHARS)."""


class ClientLeft(Exception):
    """The client disconnected before its answer was ready."""


class TokenBudget:
    """Tokens (backend.request_tokens) of the requests being served at once: one request
    at most the backend's max_request_tokens, all together at most `max_inflight_tokens`
    (None: INFLIGHT_REQUESTS x max_request_tokens). Used from the event loop only."""

    def __init__(self, info: Callable[[], ServerInfo], max_inflight_tokens: int | None) -> None:
        self.info = info  # read per request: a backend may learn its limits in start()
        self.max_inflight_tokens = max_inflight_tokens
        self.used = 0

    def limit(self, info: ServerInfo | None = None) -> int | None:
        per_request = (info or self.info()).max_request_tokens
        default = None if per_request is None else INFLIGHT_REQUESTS * per_request
        return self.max_inflight_tokens or default

    def admit(self, tokens: int) -> None:
        """Holds `tokens` until release(); RequestTooLarge when they could never fit,
        Overloaded while others hold too much."""
        info = self.info()
        check_request_tokens(tokens, info)
        limit = self.limit(info)
        if limit is not None:
            if tokens > limit:
                raise RequestTooLarge(
                    f"request: costs {tokens} tokens, more than the {limit} the server serves "
                    "at once (its max_inflight_tokens); split it into several requests or ask "
                    "a smaller top_k"
                )
            if self.used + tokens > limit:
                raise Overloaded(
                    f"{self.used} tokens in flight (bound {limit}), this request costs "
                    f"{tokens}; retry later"
                )
        self.used += tokens

    def release(self, tokens: int) -> None:
        self.used -= tokens


def parse_body(model: type[BaseModel], body: bytes) -> BaseModel:
    """`model` from JSON `body`, or InvalidBody naming the first few problems."""
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        count = err.error_count()
        problems = []
        for error in err.errors(include_url=False, include_context=False, include_input=False)[
            :MAX_PROBLEMS
        ]:
            where = ".".join(str(part) for part in error["loc"]) or "body"
            problem = f"{where}: {error['msg'].removeprefix('Value error, ')}"
            problems.append(problem[:MAX_PROBLEM_CHARS])
        more = f"; and {count - len(problems)} more" if count > len(problems) else ""
        raise InvalidBody("; ".join(problems) + more) from None


def check_body(model: type[BaseModel], body: bytes) -> str | None:
    """What is wrong with `body` (InvalidBody's message), or None: run in the checker
    process, whose parse holds no lock of the service's."""
    try:
        parse_body(model, body)
    except InvalidBody as err:
        return str(err)
    return None


class BodyChecker:
    """One process that validates large bodies before the service parses them: pydantic
    parses the whole JSON before it validates, holding the interpreter's lock (about 25 ms
    per MB of ids), so a bad large body would stall every other request; checked here
    first, it costs the service its bytes only, and a good one is parsed as any request is.
    A body at a time, so the process's memory is one body's. Started at the first large
    body (spawned: the service's threads make a fork unsafe), at a lower priority than the
    service, it dies with the service (PR_SET_PDEATHSIG; a killed service leaves no
    orphan), and stop() ends it."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    def pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_checker_init,
                initargs=(os.getpid(),),
            )
        return self._pool

    async def validate(self, model: type[BaseModel], body: bytes) -> BaseModel:
        """`model` from `body`, or InvalidBody."""
        if len(body) >= PROCESS_CHECK_BYTES:
            loop = asyncio.get_running_loop()
            try:
                problem = await loop.run_in_executor(self.pool(), check_body, model, body)
            except BrokenProcessPool:  # the checker died (killed, out of memory)
                self.stop()  # a new one for the next body
                problem = None  # this one is parsed here, as a small body is
            if problem is not None:
                raise InvalidBody(problem)
        return await asyncio.to_thread(parse_body, model, body)

    def stop(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            processes = list((pool._processes or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for process in processes:  # a check in progress is not waited for
                process.kill()


def _checker_init(parent: int) -> None:
    """The checker's initializer: SIGKILL when the thread that started it ends, and a lower
    priority than the service (where they share a core, serving comes first)."""
    end_with_parent(parent, signal.SIGKILL)
    os.nice(CHECKER_NICENESS)


class JSONBodyRoute(APIRoute):
    """A POST route served as the module docstring says. Subclass it with `budget`,
    `count_error` and `checker` set (json_body_route)."""

    budget: TokenBudget
    count_error: Callable[[int], None]
    checker: BodyChecker

    def __init__(self, path: str, endpoint: Callable[..., Any], **options: Any) -> None:
        super().__init__(path, endpoint, **options)
        if self.body_field is None:
            raise TypeError(f"{path}: a JSONBodyRoute's endpoint takes its body model")
        self.body_model: type[BaseModel] = self.body_field.field_info.annotation  # type: ignore[assignment]
        self.app = self.serve

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await Request(scope, receive).body()
        try:
            parsed = await self.checker.validate(self.body_model, body)
        except InvalidBody as err:
            await self._refuse(422, str(err), scope, receive, send)
            return
        finally:
            del body
        tokens = request_tokens(parsed)
        try:
            self.budget.admit(tokens)
        except RequestTooLarge as err:
            await self._refuse(413, str(err), scope, receive, send)
            return
        except Overloaded as err:
            await self._refuse(503, str(err), scope, receive, send)
            return
        try:
            answer = await until_disconnect(self.endpoint(parsed), receive)
            if isinstance(answer, Response):  # an error's short answer
                await answer(scope, receive, send)
            else:
                serialize = type(answer).__pydantic_serializer__.to_json
                await send_in_chunks(await asyncio.to_thread(serialize, answer), send)
        except ClientLeft:
            return
        finally:
            self.budget.release(tokens)

    async def _refuse(
        self, status: int, detail: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        self.count_error(status)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
        await JSONResponse({"detail": detail}, status_code=status, headers=headers)(
            scope, receive, send
        )


def json_body_route(
    budget: TokenBudget, count_error: Callable[[int], None], checker: BodyChecker
) -> type[APIRoute]:
    """The route class of one app: JSONBodyRoute bound to its budget, error counter and
    body checker."""
    return type(
        "JSONBodyRoute",
        (JSONBodyRoute,),
        {"budget": budget, "count_error": staticmethod(count_error), "checker": checker},
    )


async def send_in_chunks(content: bytes, send: Send) -> None:
    """A 200 JSON answer, ANSWER_CHUNK bytes per message: the server's send waits while the
    client has not taken the previous ones, so an answer still being sent stays in the
    token budget instead of sitting whole in the connection's buffer."""
    headers = [(b"content-type", JSON.encode()), (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    view = memoryview(content)
    for start in range(0, max(len(content), 1), ANSWER_CHUNK):
        end = start + ANSWER_CHUNK
        await send(
            {
                "type": "http.response.body",
                "body": bytes(view[start:end]),
                "more_body": end < len(content),
            }
        )


async def until_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """`work`'s result, or ClientLeft once the client disconnects first (then `work` is
    cancelled). Call after the body was read: `receive` then only reports the end."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientLeft
    finally:
        watcher.cancel()
        task.cancel()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
