"""The teacher service on 127.0.0.1 with the hf backend and factory models."""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import DynamicCache

from slime_ext.models.factory import build_checkpoint
from teacher_server.api import ScoreItem, ScoreRequest
from teacher_server.app import create_app
from teacher_server.client import (
    TeacherBadRequest,
    TeacherClient,
    TeacherOverloaded,
    TeacherUnauthorized,
)
from teacher_server.guards import default_max_body_bytes
from teacher_server.hf_backend import HFBackend
from teacher_server.metrics import ServerMetrics
from teacher_server.session_cache import SessionCache, SessionState
from tests.live_server import serve_in_thread

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@dataclass
class Teacher:
    url: str
    backend: HFBackend
    model: Any
    tokens_computed: list[int]


def _start(model_dir: Path, **options: Any) -> Iterator[Teacher]:
    metrics = ServerMetrics()
    api_key = options.pop("api_key", None)
    max_body_bytes = options.pop("max_body_bytes", None)
    backend = HFBackend(model_dir, metrics, **options)
    computed = [0]
    embed = backend.scorer.model.get_input_embeddings()
    # Counts what the model really computes: every id that enters the embedding layer.
    embed.register_forward_hook(
        lambda _m, args, _o: computed.__setitem__(0, computed[0] + args[0].numel())
    )
    with serve_in_thread(create_app(backend, metrics, api_key, max_body_bytes)) as url:
        yield Teacher(url, backend, backend.scorer.model, computed)


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("teacher") / "full", seed=1)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3_5-tiny", tmp_path_factory.mktemp("teacher") / "hybrid", seed=2)


@pytest.fixture(scope="module")
def full_teacher(full_dir: Path) -> Iterator[Teacher]:
    yield from _start(full_dir, max_top_k=20, max_context=2048, max_queue=64)


@pytest.fixture(scope="module")
def hybrid_teacher(hybrid_dir: Path) -> Iterator[Teacher]:
    yield from _start(hybrid_dir, max_top_k=20, max_context=2048, snapshot_every=16)


def _direct(
    model: Any, ids: list[int], span_start: int, temperature: float = 1.0, top_k: int = 0
) -> tuple[torch.Tensor, torch.return_types.topk | None]:
    """An independent reference: one full forward of the same model."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    rows = torch.log_softmax(logits[span_start - 1 : len(ids) - 1] / temperature, dim=-1)
    targets = torch.tensor(ids[span_start:])
    chosen = rows.gather(-1, targets[:, None])[:, 0]
    return chosen, (rows.topk(top_k) if top_k else None)


def _score(url: str, items: list[ScoreItem], **client: Any) -> list[Any]:
    async def run() -> list[Any]:
        async with TeacherClient(url, **client) as teacher:
            return await teacher.score(items)

    return asyncio.run(run())


def _ids(seed: int, length: int, vocab: int = 800) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


@pytest.mark.parametrize("which", ["full", "hybrid"])
@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 5), (1.3, 20)])
def test_scores_equal_a_direct_forward(
    request: pytest.FixtureRequest, which: str, temperature: float, top_k: int
) -> None:
    teacher: Teacher = request.getfixturevalue(f"{which}_teacher")
    ids = _ids(7, 60)
    cases = [
        ScoreItem(input_ids=ids, span_start=40, top_k=top_k, temperature=temperature),
        ScoreItem(input_ids=ids[:50], span_start=20, top_k=top_k, temperature=temperature),
    ]
    # the same contexts through a session: the second request reuses the first's prefix
    session = f"direct-{which}-{temperature}-{top_k}"
    cases += [case.model_copy(update={"session_id": session}) for case in cases]
    results = _score(teacher.url, cases)
    for case, result in zip(cases, results, strict=True):
        chosen, top = _direct(teacher.model, case.input_ids, case.span_start, temperature, top_k)
        assert torch.allclose(torch.tensor(result.logprobs), chosen, atol=1e-5)
        if top_k:
            assert top is not None
            assert result.top_k_ids == top.indices.tolist()
            assert torch.allclose(torch.tensor(result.top_k_logprobs), top.values, atol=1e-5)
        else:
            assert result.top_k_ids is None
    # reused up to span_start - 1 of the second request (the hybrid: up to its last
    # recurrent-state snapshot, taken every 16 ids here)
    assert results[3].cached_tokens == (19 if which == "full" else 16)


def _trajectory_requests(
    turns: int,
    seed: int,
    hint_at_turn: int | None = None,
) -> tuple[list[ScoreItem], int]:
    """Per-turn requests of a think-dropping trajectory: context_k + (think_k, action_k);
    context_{k+1} = context_k + action_k + observation_k. Returns them and the count of
    unique tokens (final context + last span + every dropped think)."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(800) for _ in range(n)]  # noqa: E731
    context = draw(48)
    requests, thinks = [], 0
    hint = draw(12)
    for k in range(turns):
        think, action, observation = draw(20), draw(10), draw(30)
        shown = context
        if hint_at_turn is not None and k >= hint_at_turn:
            shown = context[:30] + hint + context[30:]  # a hint inserted mid-context
        requests.append(
            ScoreItem(
                input_ids=shown + think + action, span_start=len(shown), session_id=f"traj-{seed}"
            )
        )
        if k < turns - 1:
            thinks += len(think)
        context = context + action + observation
    return requests, len(requests[-1].input_ids) + thinks


@pytest.mark.parametrize("which", ["full", "hybrid"])
def test_prefix_reuse_computes_each_token_about_once(
    request: pytest.FixtureRequest, which: str
) -> None:
    teacher: Teacher = request.getfixturevalue(f"{which}_teacher")
    requests, unique = _trajectory_requests(20, seed=11 if which == "full" else 12)
    before = teacher.tokens_computed[0]
    results = [_score(teacher.url, [item])[0] for item in requests]  # turn by turn
    with_reuse = teacher.tokens_computed[0] - before
    for item, result in zip(requests, results, strict=True):
        chosen, _ = _direct(teacher.model, item.input_ids, item.span_start)
        assert torch.allclose(torch.tensor(result.logprobs), chosen, atol=1e-5)
    stateless = sum(len(item.input_ids) for item in requests)
    assert with_reuse <= 1.2 * unique, (with_reuse, unique)
    assert stateless > 8 * unique / 1.2 / 1.2 and stateless > 5 * with_reuse


@pytest.mark.parametrize("which", ["full", "hybrid"])
def test_hint_inserted_mid_context_reuses_up_to_the_insertion(
    request: pytest.FixtureRequest, which: str
) -> None:
    teacher: Teacher = request.getfixturevalue(f"{which}_teacher")
    requests, _ = _trajectory_requests(12, seed=21 if which == "full" else 22, hint_at_turn=6)
    cached = []
    for item in requests:
        [result] = _score(teacher.url, [item])
        chosen, _ = _direct(teacher.model, item.input_ids, item.span_start)
        assert torch.allclose(torch.tensor(result.logprobs), chosen, atol=1e-5)
        cached.append(result.cached_tokens)
    # the hint sits at position 30: the full-attention cache keeps exactly 30 ids; the hybrid
    # restarts from its last recurrent-state snapshot before 30 (every 16 ids here)
    assert cached[6] == (30 if which == "full" else 16)
    assert cached[5] > 30 and cached[7] > 30  # before and after, whole contexts are reused


def test_validation_names_the_field(full_teacher: Teacher) -> None:
    good = {"input_ids": [1, 2, 3, 4], "span_start": 2}
    cases: list[tuple[Any, int, str]] = [
        (
            {"requests": [{**good, "input_ids": [1, 2, 99999, 4]}]},
            400,
            "requests[0].input_ids[2]: id 99999 is outside the vocabulary",
        ),
        ({"requests": [good, {**good, "span_start": 4}]}, 400, "requests[1].span_start: 4"),
        (
            {"requests": [{**good, "input_ids": [1] * 2049}]},
            400,
            "2049 ids exceed the max context of 2048",
        ),
        ({"requests": [{**good, "top_k": 21}]}, 400, "requests[0].top_k: 21 is over the limit"),
        ({"requests": [{**good, "span_start": 0}]}, 422, "requests.0.span_start"),
        ({"requests": [{**good, "span_start": True}]}, 422, "requests.0.span_start"),
        ({"requests": [{**good, "input_ids": ["a", 2]}]}, 422, "requests.0.input_ids.0"),
        ({"requests": [{**good, "input_ids": [-1, 2]}]}, 422, "requests.0.input_ids.0"),
        ({"requests": [{**good, "temperature": 0}]}, 422, "requests.0.temperature"),
        ({"requests": [{**good, "extra": 1}]}, 422, "requests.0.extra"),
        ({"requests": []}, 422, "requests"),
        ({"requests": [{**good, "input_ids": []}]}, 422, "requests.0.input_ids"),
        ({}, 422, "requests"),
    ]
    with httpx.Client(base_url=full_teacher.url) as http:
        for body, status, message in cases:
            response = http.post("/v1/score", json=body)
            assert response.status_code == status, (body, response.text)
            assert message in response.json()["detail"], response.text
        malformed = http.post(
            "/v1/score", content=b'{"requests": [', headers={"content-type": "application/json"}
        )
        assert malformed.status_code == 422
        assert http.get("/health").json() == {"status": "ok"}


def test_bad_requests_do_not_poison_a_concurrent_batch(full_teacher: Teacher) -> None:
    good = ScoreItem(input_ids=_ids(3, 30), span_start=10)
    expected, _ = _direct(full_teacher.model, good.input_ids, good.span_start)

    async def run() -> list[Any]:
        async with httpx.AsyncClient(base_url=full_teacher.url) as http:
            bad = {"requests": [{"input_ids": [1, 10**6], "span_start": 1}]}
            calls = [http.post("/v1/score", json=bad) for _ in range(8)]
            calls += [
                http.post("/v1/score", json={"requests": [good.model_dump()]}) for _ in range(8)
            ]
            return list(await asyncio.gather(*calls))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [400] * 8 + [200] * 8
    for response in responses[8:]:
        logprobs = torch.tensor(response.json()["results"][0]["logprobs"])
        assert torch.allclose(logprobs, expected, atol=1e-5)


def test_queue_bound_answers_503_with_retry_after(full_teacher: Teacher) -> None:
    """A request that fits the queue (bound 64) but not beside the items already queued."""
    batcher = full_teacher.backend.batcher
    release = threading.Event()
    run_batch = batcher.run_batch

    def held(items: list[ScoreItem]) -> list[Any]:
        release.wait(timeout=60)
        return run_batch(items)

    items = [ScoreItem(input_ids=[1, 2, 3], span_start=1).model_dump()] * 40
    batcher.run_batch = held
    try:
        with httpx.Client(base_url=full_teacher.url, timeout=60) as http:
            first: list[httpx.Response] = []
            queued = threading.Thread(
                target=lambda: first.append(http.post("/v1/score", json={"requests": items}))
            )
            queued.start()
            while batcher.pending < 40:
                assert queued.is_alive()
                time.sleep(0.01)
            response = http.post("/v1/score", json={"requests": items})
            assert response.status_code == 503
            assert response.headers["Retry-After"] == "1"
            with pytest.raises(TeacherOverloaded, match="still overloaded after 1 retries"):
                _score(
                    full_teacher.url,
                    [ScoreItem(input_ids=[1, 2, 3], span_start=1)] * 40,
                    retries=1,
                    backoff_s=0.01,
                )
            release.set()
            queued.join(timeout=60)
        assert first[0].status_code == 200  # the queued request itself is served
    finally:
        release.set()
        batcher.run_batch = run_batch


class CountingTransport(httpx.AsyncHTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.requests = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        return await super().handle_async_request(request)


def test_more_items_than_the_queue_holds_is_413_and_never_retried(full_teacher: Teacher) -> None:
    """It used to be a 503 that clients retried forever: no wait makes 65 items fit in 64."""
    item = ScoreItem(input_ids=[1, 2, 3], span_start=1)
    with httpx.Client(base_url=full_teacher.url) as http:
        response = http.post("/v1/score", json={"requests": [item.model_dump()] * 65})
    assert response.status_code == 413
    assert "65 items in one request, at most 64" in response.json()["detail"]
    transport = CountingTransport()
    with pytest.raises(TeacherBadRequest, match="at most 64"):
        _score(full_teacher.url, [item] * 65, transport=transport, backoff_s=0.01)
    assert transport.requests == 1
    assert len(_score(full_teacher.url, [item] * 64)) == 64  # at the bound: served


def test_temperature_is_bounded_to_finite_answers(full_teacher: Teacher) -> None:
    """A tiny temperature gave NaN (sent as null against a float schema), a huge integer a
    500: both are 422 now, and the bounds themselves are served with finite log-probs."""
    ids = _ids(13, 24)
    good = {"input_ids": ids, "span_start": 16, "top_k": 3}
    with httpx.Client(base_url=full_teacher.url) as http:
        for temperature in (1e-3, 1e-300, 100.5, 10**400):
            response = http.post(
                "/v1/score", json={"requests": [{**good, "temperature": temperature}]}
            )
            assert response.status_code == 422, (temperature, response.text)
            assert "requests.0.temperature" in response.json()["detail"]
        for literal in ("NaN", "Infinity", "-Infinity"):
            body = json.dumps({"requests": [good]})[:-2] + f', "temperature": {literal}}}]}}'
            response = http.post(
                "/v1/score", content=body, headers={"content-type": "application/json"}
            )
            assert response.status_code == 422, (literal, response.text)
        trajectory = {"trunk_ids": ids, "turns": [{"context_len": 8, "span_ids": [1, 2]}]}
        response = http.post("/v1/score_trajectory", json={**trajectory, "temperature": 1e-3})
        assert response.status_code == 422 and "temperature" in response.json()["detail"]
        for temperature in (0.01, 100):
            response = http.post(
                "/v1/score", json={"requests": [{**good, "temperature": temperature}]}
            )
            assert response.status_code == 200, response.text
            [result] = response.json()["results"]
            chosen, _ = _direct(full_teacher.model, ids, 16, temperature)
            assert all(math.isfinite(value) for value in result["logprobs"])
            assert torch.allclose(torch.tensor(result["logprobs"]), chosen, atol=1e-3)
            assert all(math.isfinite(v) for row in result["top_k_logprobs"] for v in row)


def test_sessions_are_dropped_and_info_reports_the_model(
    full_teacher: Teacher, full_dir: Path
) -> None:
    item = ScoreItem(input_ids=_ids(5, 40), span_start=30, session_id="to-drop")

    async def run() -> tuple[Any, ...]:
        async with TeacherClient(full_teacher.url) as teacher:
            first = await teacher.score([item])
            second = await teacher.score([item])
            dropped = await teacher.drop_session("to-drop")
            again = await teacher.drop_session("to-drop")
            third = await teacher.score([item])
            return first[0], second[0], dropped, again, third[0], await teacher.info()

    first, second, dropped, again, third, info = asyncio.run(run())
    assert (first.cached_tokens, second.cached_tokens, third.cached_tokens) == (0, 29, 0)
    assert (dropped, again) == (True, False)
    assert info.backend == "hf" and info.model == str(full_dir)
    assert info.vocab_size == full_teacher.model.config.vocab_size
    assert info.max_context == 2048 and "@" in info.tokenizer


def test_metrics_count_requests_and_tokens(full_teacher: Teacher) -> None:
    _score(full_teacher.url, [ScoreItem(input_ids=_ids(9, 20), span_start=15)])
    text = httpx.get(f"{full_teacher.url}/metrics").text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["opd_teacher_requests_total"] >= 1
    assert values["opd_teacher_tokens_scored_total"] >= 5
    assert values["opd_teacher_tokens_computed_total"] >= 20
    assert "opd_teacher_queue_depth" in values
    assert values['opd_teacher_request_latency_seconds_bucket{le="+Inf"}'] >= 1


def test_lru_eviction_keeps_the_cache_within_budget(full_dir: Path) -> None:
    for teacher in _start(full_dir, cache_budget_mb=0.05):
        for session in range(6):
            _score(
                teacher.url,
                [ScoreItem(input_ids=_ids(session, 60), span_start=50, session_id=f"s{session}")],
            )
        sessions = teacher.backend.scorer.sessions
        assert sessions.total_bytes <= sessions.budget_bytes
        assert sessions.evictions >= 1 and 0 < len(sessions) < 6


def test_api_key_is_required_when_configured(full_dir: Path) -> None:
    for teacher in _start(full_dir, api_key="s3cret"):
        item = ScoreItem(input_ids=[1, 2, 3], span_start=1)
        with pytest.raises(TeacherUnauthorized):
            _score(teacher.url, [item])
        with pytest.raises(TeacherUnauthorized):
            _score(teacher.url, [item], api_key="wrong")
        assert len(_score(teacher.url, [item], api_key="s3cret")[0].logprobs) == 2
        assert httpx.get(f"{teacher.url}/health").status_code == 200
        # the refusals are counted where an operator looks for them
        metrics = httpx.get(f"{teacher.url}/metrics").text
        assert 'opd_teacher_errors_total{code="401"} 2' in metrics.splitlines(), metrics


def test_client_raises_typed_errors(full_teacher: Teacher) -> None:
    with pytest.raises(TeacherBadRequest, match="outside the vocabulary"):
        _score(full_teacher.url, [ScoreItem(input_ids=[1, 10**6], span_start=1)])


def _headers_only(url: str, path: str, headers: dict[str, str], timeout_s: float = 10) -> bytes:
    """Send a POST's headers, none of its body, and read the status line: an answer can
    only come from a server that decided without the body."""
    host, port = url.removeprefix("http://").split(":")
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items())]
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        return sock.recv(4096).split(b"\r\n", 1)[0]


class StreamedBody:
    """A request body in 64 KiB chunks that records how many bytes the server pulled."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.consumed = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while self.consumed < self.total_bytes:
            self.consumed += 2**16
            yield b" " * 2**16


def _asgi_post(app: Any, body: StreamedBody, headers: dict[str, str]) -> httpx.Response:
    """In process: httpx's ASGI transport hands the app each chunk only when it asks."""

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://teacher") as http:
            return await http.post("/v1/score", content=body, headers=headers)

    return asyncio.run(run())


def test_unauthenticated_requests_are_refused_before_the_body_is_read(
    full_teacher: Teacher, full_dir: Path
) -> None:
    """The key used to be checked after the whole body was read and parsed: 50 MB from
    anyone held the event loop and hundreds of MB of memory."""
    declared = {"Content-Type": "application/json", "Content-Length": str(50 * 2**20)}
    for teacher in _start(full_dir, api_key="s3cret"):
        status = _headers_only(teacher.url, "/v1/score", declared)
        assert status.startswith(b"HTTP/1.1 401"), status
        wrong = {**declared, "Authorization": "Bearer wrong"}
        assert _headers_only(teacher.url, "/v1/score", wrong).startswith(b"HTTP/1.1 401")
        # the positive control: the key opens the door, and nothing else changed
        item = ScoreItem(input_ids=[1, 2, 3], span_start=1)
        assert len(_score(teacher.url, [item], api_key="s3cret")[0].logprobs) == 2
        assert httpx.get(f"{teacher.url}/metrics").status_code == 200
    app = create_app(full_teacher.backend, ServerMetrics(), api_key="s3cret")
    body = StreamedBody(50 * 2**20)
    response = _asgi_post(app, body, {"Content-Type": "application/json"})
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert body.consumed == 0


def test_bodies_over_the_limit_are_413_without_reading_past_it(
    full_teacher: Teacher, full_dir: Path
) -> None:
    limit = 2**16
    for teacher in _start(full_dir, api_key="s3cret", max_body_bytes=limit):
        declared = {
            "Authorization": "Bearer s3cret",
            "Content-Type": "application/json",
            "Content-Length": str(limit + 1),
        }
        status = _headers_only(teacher.url, "/v1/score", declared)
        assert status.startswith(b"HTTP/1.1 413"), status
        # the positive control: a body just under the limit is read and scored
        item = ScoreItem(input_ids=_ids(17, 30), span_start=20)
        items = [item] * 200
        size = len(json.dumps({"requests": [i.model_dump() for i in items]}))
        assert limit / 2 < size < limit
        assert len(_score(teacher.url, items, api_key="s3cret")) == 200
    # chunked (no Content-Length): counted while it streams, refused once past the limit
    app = create_app(full_teacher.backend, ServerMetrics(), max_body_bytes=limit)
    body = StreamedBody(50 * 2**20)
    response = _asgi_post(app, body, {"Content-Type": "application/json"})
    assert response.status_code == 413
    assert f"at most {limit}" in response.json()["detail"]
    assert body.consumed <= limit + 2**16


def test_the_default_body_limit_fits_a_full_batch_of_max_context_items(
    full_teacher: Teacher,
) -> None:
    for info in (
        full_teacher.backend.info(),
        full_teacher.backend.info().model_copy(
            update={"vocab_size": 151_936, "max_context": 65_536, "max_batch_size": 64}
        ),
    ):
        item = ScoreItem(
            input_ids=[info.vocab_size - 1] * info.max_context,
            span_start=1,
            top_k=info.max_top_k,
            session_id="s" * 256,
            temperature=0.123456789,
        )
        batch = ScoreRequest(requests=[item] * info.max_batch_size).model_dump(mode="json")
        assert len(json.dumps(batch).encode()) <= default_max_body_bytes(info)
    assert default_max_body_bytes(full_teacher.backend.info()) < 50 * 2**20


def store(sessions: SessionCache, session_id: str, state: SessionState) -> None:
    """What one session request does to the table: admitted, its state kept, released."""
    ticket = sessions.admit(session_id)
    try:
        with sessions.checkout(ticket) as lease:
            lease.keep(state)
    finally:
        sessions.release(ticket)


def _churn(sessions: SessionCache, config: Any, stop: threading.Event) -> None:
    """What the scoring thread and DELETE /v1/sessions do to the table, as fast as it goes."""
    index = 0
    while not stop.is_set():
        store(sessions, f"churn-{index}", SessionState(ids=[], cache=DynamicCache(config=config)))
        sessions.drop(f"churn-{index - 50}")
        index += 1


def test_metrics_answer_while_sessions_come_and_go(full_dir: Path) -> None:
    """/metrics summed the session table while the scoring thread changed it: a 500
    ("dictionary changed size during iteration") under session churn."""
    for teacher in _start(full_dir):
        sessions, config = teacher.backend.scorer.sessions, teacher.model.config
        for index in range(5000):
            store(
                sessions,
                f"resident-{index}",
                SessionState(ids=[], cache=DynamicCache(config=config)),
            )
        stop = threading.Event()
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # hand the GIL over often: races show up in a second
        worker = threading.Thread(target=_churn, args=(sessions, config, stop))
        worker.start()
        try:
            with httpx.Client(base_url=teacher.url) as http:
                statuses = [http.get("/metrics").status_code for _ in range(100)]
                item = ScoreItem(input_ids=_ids(19, 20), span_start=10, session_id="live")
                assert len(_score(teacher.url, [item])[0].logprobs) == 10  # scoring still works
                assert http.delete("/v1/sessions/live").json()["deleted"] is True
        finally:
            stop.set()
            worker.join()
            sys.setswitchinterval(switch)
        assert statuses == [200] * 100, Counter(statuses)
        text = httpx.get(f"{teacher.url}/metrics").text
        assert f"opd_teacher_sessions {len(sessions)}" in text


def test_a_session_delete_does_not_wait_behind_scoring_requests() -> None:
    """Every scoring connection of a client is taken by requests the server holds (a round
    of trajectories scored at once on a loaded teacher): deleting a session still answers
    at once, on the client's control connections, and the held requests finish."""
    import fastapi

    release = threading.Event()
    app = fastapi.FastAPI()

    @app.post("/v1/score")
    def score(body: dict[str, Any]) -> dict[str, Any]:  # a worker thread, held
        release.wait(30)
        return {"results": [{"logprobs": [0.0], "cached_tokens": 0}]}

    @app.delete("/v1/sessions/{session_id:path}")
    async def delete(session_id: str) -> dict[str, Any]:
        return {"session_id": session_id, "deleted": True}

    item = ScoreItem(input_ids=[1, 2, 3], span_start=2)

    async def run(url: str) -> float:
        async with TeacherClient(url, max_concurrency=2) as teacher:
            held = [asyncio.create_task(teacher.score([item])) for _ in range(3)]
            await asyncio.sleep(0.5)  # two on the wire, one waiting for them
            started = time.monotonic()
            assert await asyncio.wait_for(teacher.drop_session("t#0"), 5)
            waited = time.monotonic() - started
            release.set()
            assert len(await asyncio.wait_for(asyncio.gather(*held), 10)) == 3
            return waited

    with serve_in_thread(app) as url:
        assert asyncio.run(run(url)) < 2
