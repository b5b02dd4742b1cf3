"""The session cache: a DELETE (or a reload's clear) wins over the requests in flight for
that session, nothing of a session outlives it, and 20k sessions coming and going leave
memory and put latency flat."""

from __future__ import annotations

import asyncio
import gc
import random
import statistics
import threading
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
from transformers import AutoConfig, DynamicCache

from slime_ext.models.factory import build_checkpoint
from teacher_server.api import ScoreItem
from teacher_server.app import create_app
from teacher_server.client import TeacherClient
from teacher_server.hf_backend import HFBackend
from teacher_server.metrics import ServerMetrics
from teacher_server.session_cache import SessionCache, SessionState
from tests.live_server import serve_in_thread
from tests.test_teacher_server import store

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.timeout(120)]


class Gate:
    """Once armed, holds the next forward (in the scoring thread) until released."""

    def __init__(self, model: Any) -> None:
        self.armed = False
        self.started = threading.Event()
        self.released = threading.Event()
        model.get_input_embeddings().register_forward_pre_hook(self._hold)

    def arm(self) -> None:
        self.started.clear()
        self.released.clear()
        self.armed = True

    def _hold(self, _module: Any, _args: Any) -> None:
        if self.armed:
            self.armed = False
            self.started.set()
            self.released.wait(timeout=60)


@dataclass
class Teacher:
    url: str
    backend: HFBackend
    gate: Gate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("sessions") / "m", seed=9)


@pytest.fixture(scope="module")
def teacher(model_dir: Path) -> Iterator[Teacher]:
    metrics = ServerMetrics()
    # room for a few small sessions: most of the churn below ends by eviction
    backend = HFBackend(model_dir, metrics, max_context=512, cache_budget_mb=0.05)
    with serve_in_thread(create_app(backend, metrics)) as url:
        yield Teacher(url, backend, Gate(backend.scorer.model))


def _ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(800) for _ in range(length)]


def _score(url: str, item: ScoreItem) -> Any:
    async def run() -> Any:
        async with TeacherClient(url) as client:
            return (await client.score([item]))[0]

    return asyncio.run(run())


def _post_in_thread(url: str, item: ScoreItem) -> tuple[threading.Thread, list[httpx.Response]]:
    answers: list[httpx.Response] = []

    def post() -> None:
        body = {"requests": [item.model_dump()]}
        answers.append(httpx.post(f"{url}/v1/score", json=body, timeout=60))

    thread = threading.Thread(target=post)
    thread.start()
    return thread, answers


def _direct(model: Any, item: ScoreItem) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([item.input_ids])).logits[0].float()
    rows = torch.log_softmax(logits[item.span_start - 1 : -1], dim=-1)
    return rows.gather(-1, torch.tensor(item.input_ids[item.span_start :])[:, None])[:, 0]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def test_a_delete_while_the_session_is_scored_wins(teacher: Teacher) -> None:
    """The request computing on the session used to put its state back after the DELETE:
    the session outlived its trajectory until evicted."""
    item = ScoreItem(input_ids=_ids(1, 40), span_start=30, session_id="held")
    assert _score(teacher.url, item).cached_tokens == 0
    teacher.gate.arm()
    thread, answers = _post_in_thread(teacher.url, item)
    try:
        assert teacher.gate.started.wait(timeout=60)  # the request is in its forward
        deleted = httpx.delete(f"{teacher.url}/v1/sessions/held").json()["deleted"]
    finally:
        teacher.gate.released.set()
        thread.join(timeout=60)
    assert deleted is True
    [answer] = answers
    assert answer.status_code == 200  # the request itself is answered, and right
    [result] = answer.json()["results"]
    assert result["cached_tokens"] == 29
    assert torch.allclose(
        torch.tensor(result["logprobs"]), _direct(teacher.backend.scorer.model, item), atol=1e-5
    )
    sessions = teacher.backend.scorer.sessions
    assert "held" not in sessions and sessions.in_flight == 0
    assert _score(teacher.url, item).cached_tokens == 0  # nothing was put back
    assert _score(teacher.url, item).cached_tokens == 0  # nor by a request after the DELETE
    fresh = item.model_copy(update={"session_id": "fresh"})
    assert _score(teacher.url, fresh).cached_tokens == 0
    assert _score(teacher.url, fresh).cached_tokens == 29  # another session caches as ever


def test_a_delete_while_the_request_is_queued_wins(teacher: Teacher) -> None:
    """A request admitted before the DELETE but still queued behind another used to run
    after it and store the session afresh."""
    item = ScoreItem(input_ids=_ids(2, 40), span_start=30, session_id="queued")
    assert _score(teacher.url, item).cached_tokens == 0
    teacher.gate.arm()
    blocker, _ = _post_in_thread(teacher.url, ScoreItem(input_ids=_ids(3, 20), span_start=10))
    try:
        assert teacher.gate.started.wait(timeout=60)  # the worker is busy with the blocker
        queued, answers = _post_in_thread(teacher.url, item)
        deadline = time.monotonic() + 60
        while teacher.backend.batcher.pending < 2:
            assert time.monotonic() < deadline and queued.is_alive()
            time.sleep(0.01)
        deleted = httpx.delete(f"{teacher.url}/v1/sessions/queued").json()["deleted"]
    finally:
        teacher.gate.released.set()
        blocker.join(timeout=60)
    queued.join(timeout=60)
    assert deleted is True
    assert answers[0].status_code == 200
    assert answers[0].json()["results"][0]["cached_tokens"] == 0  # its state was deleted
    assert "queued" not in teacher.backend.scorer.sessions
    assert _score(teacher.url, item).cached_tokens == 0


def test_sessions_whose_ids_hold_url_syntax_are_deleted(teacher: Teacher) -> None:
    """A trajectory id is "task#0": the client sent DELETE /v1/sessions/task#0, whose path
    ends at '#', and the session it meant was never deleted."""
    ids = ["task#0", "a/b#1", "what?x=1&y=2", "100%", "sp ace", "ünï/cødé", "..", "%2F"]

    async def score_then_drop(item: ScoreItem) -> bool:
        async with TeacherClient(teacher.url) as client:
            await client.score([item])
            assert item.session_id in teacher.backend.scorer.sessions
            assert item.session_id is not None
            return await client.drop_session(item.session_id)

    for index, session_id in enumerate(ids):
        item = ScoreItem(input_ids=_ids(40 + index, 20), span_start=10, session_id=session_id)
        assert asyncio.run(score_then_drop(item)) is True, session_id
        assert session_id not in teacher.backend.scorer.sessions


def _state(config: Any, length: int = 8) -> SessionState:
    """A small state with real key/value tensors in every layer."""
    cache = DynamicCache(config=config)
    shape = (1, config.num_key_value_heads, length, config.head_dim)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.zeros(shape), torch.zeros(shape), layer)
    return SessionState(ids=list(range(length)), cache=cache)


def test_a_drop_or_clear_wins_over_every_request_admitted_before_it(model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(model_dir)
    sessions = SessionCache(budget_bytes=2**30)
    early = sessions.admit("s")
    assert sessions.drop("s") is True  # nothing cached, but a request in flight
    with sessions.checkout(early) as lease:
        assert lease.state is None
        lease.keep(_state(config))
    sessions.release(early)
    assert "s" not in sessions
    kept = _state(config)
    first = sessions.admit("r")
    with sessions.checkout(first) as lease:
        lease.keep(kept)
    sessions.release(first)
    reloading = sessions.admit("r")
    with sessions.checkout(reloading) as lease:
        assert lease.state is kept
        assert sessions.clear() == 0  # a reload while it computes (its state is out)
        lease.keep(_state(config))
    sessions.release(reloading)
    abandoned = sessions.admit("t")
    sessions.release(abandoned)  # its caller gave up; a computation may still finish
    with sessions.checkout(abandoned) as lease:
        lease.keep(_state(config))
    assert len(sessions) == 0 and sessions.total_bytes == 0 and sessions.in_flight == 0


def test_a_request_that_arrives_after_its_sessions_delete_does_not_bring_it_back(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client cancelled it before the server accepted it, then the trajectory ended
    and DELETEd the session: the late request is answered, its state not kept. Only the
    last ENDED_MEMORY ids are remembered."""
    from teacher_server import session_cache

    config = AutoConfig.from_pretrained(model_dir)
    sessions = SessionCache(budget_bytes=2**30)
    assert sessions.drop("gone") is False  # nothing there yet: still remembered
    late = sessions.admit("gone")
    with sessions.checkout(late) as lease:
        assert lease.state is None
        lease.keep(_state(config))
    sessions.release(late)
    assert "gone" not in sessions and sessions.total_bytes == 0
    monkeypatch.setattr(session_cache, "ENDED_MEMORY", 3)
    for name in ("a", "b", "c", "d"):
        sessions.drop(name)
    again = sessions.admit("gone")  # forgotten by now: cached like a new session
    with sessions.checkout(again) as lease:
        lease.keep(_state(config))
    sessions.release(again)
    assert "gone" in sessions


@pytest.mark.timeout(300)
def test_twenty_thousand_sessions_leave_memory_and_put_latency_flat(
    model_dir: Path, teacher: Teacher
) -> None:
    """Each session is created by a request and ended by a DELETE (even ones) or by
    eviction (odd ones, as when a rollout dies without deleting). The cache used to keep a
    lock per session id it had ever seen unless that id was deleted."""
    config = AutoConfig.from_pretrained(model_dir)
    resident = 64
    sessions = SessionCache(budget_bytes=resident * _state(config).nbytes)
    process = psutil.Process()
    latencies = array("d", bytes(8 * 20_000))  # filled in place: its own growth is no noise
    rss: dict[int, int] = {}
    for index in range(20_000):
        state = _state(config)
        started = time.perf_counter()
        store(sessions, f"churn-{index}", state)
        latencies[index] = time.perf_counter() - started
        if index % 2 == 0:
            sessions.drop(f"churn-{index - 10}")
        if index + 1 in (5_000, 20_000):
            gc.collect()
            rss[index + 1] = process.memory_info().rss
    assert len(sessions) <= resident and sessions.in_flight == 0
    assert sessions.evictions >= 9_000
    growth_mb = (rss[20_000] - rss[5_000]) / 2**20
    assert growth_mb <= 0.5, f"RSS grew {growth_mb:.1f} MB over the last 15k sessions"
    first, last = statistics.median(latencies[:1000]), statistics.median(latencies[-1000:])
    assert last <= 2 * first, (first, last)
    # and through the service: requests, DELETEs, evictions
    for index in range(300):
        item = ScoreItem(input_ids=_ids(index, 24), span_start=16, session_id=f"http-{index}")
        _score(teacher.url, item)
        if index % 2 == 0:
            assert httpx.delete(f"{teacher.url}/v1/sessions/http-{index}").json()["deleted"]
    assert _metric(teacher.url, "opd_teacher_sessions_in_flight") == 0
    assert _metric(teacher.url, "opd_teacher_sessions") <= 10
    assert _metric(teacher.url, "opd_teacher_cache_evictions_total") >= 100
