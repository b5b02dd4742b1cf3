"""The teacher service bounds what a request costs at the resource, not at the inputs tried:
the answer's top-k rows count in a request's tokens, the requests served at once share a
token budget, logits are computed a bounded number of rows at a time, a body of bad values
costs one pass over its bytes and a short answer, and a client that leaves has its queued
work dropped. Each case has a control that shows the attack working without the defence."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
import torch
from pydantic import BaseModel, Field, StrictInt, ValidationError

from slime_ext.models.factory import build_checkpoint
from teacher_server import body_route, hf_backend
from teacher_server.api import ScoreItem, ScoreRequest, ScoreResult, TrajectoryScoreRequest
from teacher_server.app import create_app
from teacher_server.backend import Overloaded, item_tokens
from teacher_server.hf_backend import HFBackend, MicroBatcher, ScoreJob
from teacher_server.metrics import ServerMetrics
from tests.live_server import free_port, serve_in_thread, wait_until_healthy
from tests.processes import running

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.timeout(300)]
MAX_CONTEXT = 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("bounds") / "full", seed=9)


def _ids(length: int, start: int = 0) -> list[int]:
    return [(start + 7 * i) % 800 for i in range(length)]


def _body(*items: ScoreItem) -> dict[str, Any]:
    return {"requests": [item.model_dump(exclude_none=True) for item in items]}


class GatedBackend:
    """An HFBackend whose score() waits for `gate` once `hold` is set: a request held in
    flight for as long as a test needs."""

    def __init__(self, backend: HFBackend) -> None:
        self.backend = backend
        self.hold = False
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        if self.hold:
            self.entered.set()
            await asyncio.to_thread(self.gate.wait, 60)
        return await self.backend.score(items)


# -- memory: the answer counts, and requests share a budget -------------------------------


def test_top_k_rows_count_in_a_requests_tokens(model_dir: Path) -> None:
    metrics = ServerMetrics()
    backend = HFBackend(
        model_dir, metrics, max_context=MAX_CONTEXT, max_top_k=100, max_request_tokens=4096
    )
    wide = ScoreItem(input_ids=_ids(1000), span_start=100, top_k=20)
    # control: by its ids alone this request is well inside every advertised limit
    assert len(wide.input_ids) <= MAX_CONTEXT and wide.top_k <= 100
    assert len(wide.input_ids) < 4096 < 1000 + 900 * 20  # its ids, and its 900 top-k rows
    with serve_in_thread(create_app(backend, metrics)) as url, httpx.Client(base_url=url) as http:
        refused = http.post("/v1/score", json=_body(wide))
        assert refused.status_code == 413, refused.text
        assert "costs 19000 tokens" in refused.json()["detail"]
        assert "top_k" in refused.json()["detail"]
        narrow = wide.model_copy(update={"top_k": 2})  # 1000 + 900 x 2 = 2800 tokens
        served = http.post("/v1/score", json=_body(narrow))
        assert served.status_code == 200, served.text
        assert len(served.json()["results"][0]["top_k_ids"]) == 900


def test_requests_in_flight_share_one_token_budget(model_dir: Path) -> None:
    metrics = ServerMetrics()
    gated = GatedBackend(HFBackend(model_dir, metrics, max_context=MAX_CONTEXT))
    app = create_app(gated, metrics, max_inflight_tokens=1500)  # type: ignore[arg-type]
    first = ScoreItem(input_ids=_ids(1000), span_start=990)  # 1000 tokens
    second = ScoreItem(input_ids=_ids(900, 3), span_start=890)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/v1/info").json()["max_inflight_tokens"] == 1500
        gated.hold = True
        holder = threading.Thread(target=lambda: http.post("/v1/score", json=_body(first)))
        holder.start()
        assert gated.entered.wait(30)
        # 1000 held + 900 > 1500: wait outside, and say when to come back
        busy = http.post("/v1/score", json=_body(second))
        assert busy.status_code == 503 and busy.headers["Retry-After"] == "1", busy.text
        assert "1000 tokens in flight" in busy.json()["detail"]
        # never fits, whatever else is in flight: for good
        huge = http.post("/v1/score", json=_body(first, second))
        assert huge.status_code == 413 and "max_inflight_tokens" in huge.json()["detail"]
        gated.hold = False
        gated.gate.set()
        holder.join(60)
        assert http.post("/v1/score", json=_body(second)).status_code == 200
    assert metrics.errors_total.get(503, 0) >= 1 and metrics.errors_total.get(413, 0) >= 1


@pytest.fixture()
def head_rows(model_dir: Path) -> tuple[HFBackend, list[int]]:
    """A backend whose output layer records the rows of every call."""
    backend = HFBackend(model_dir, ServerMetrics(), max_context=MAX_CONTEXT, max_top_k=5)
    rows: list[int] = []
    head = backend.scorer.model.get_output_embeddings()
    head.register_forward_hook(lambda _m, args, _o: rows.append(args[0].shape[-2]))
    return backend, rows


def test_logits_are_computed_a_bounded_number_of_rows_at_a_time(
    head_rows: tuple[HFBackend, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, rows = head_rows
    scorer = backend.scorer
    stateless = ScoreItem(input_ids=_ids(300), span_start=100, top_k=5)
    session = stateless.model_copy(update={"session_id": "s"})
    trajectory = TrajectoryScoreRequest.model_validate(
        {
            "trunk_ids": _ids(200),
            "turns": [{"context_len": 150, "span_ids": _ids(120, 1)}],
            "top_k": 5,
        }
    )

    def score_all() -> list[ScoreResult]:
        results = scorer.score_batch([ScoreJob(stateless), ScoreJob(session)])
        assert all(isinstance(r, ScoreResult) for r in results)
        scorer.sessions.drop("s")
        return [*results, *scorer.score_packed(trajectory)]  # type: ignore[list-item]

    whole = score_all()
    assert max(rows) >= 200  # control: a span's logits all at once (200 x vocab floats)
    rows.clear()
    vocab = scorer.model.config.vocab_size
    monkeypatch.setattr(hf_backend, "LOGIT_ELEMENTS", 16 * vocab)
    chunked = score_all()
    assert rows and max(rows) <= 16
    for a, b in zip(whole, chunked, strict=True):
        assert a.top_k_ids == b.top_k_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


# -- validation: one pass, a short answer, the loop free ----------------------------------


class UndefendedItem(BaseModel):
    """ScoreItem's ids as they were validated before: every bad value one error."""

    input_ids: list[Annotated[StrictInt, Field(ge=0)]]


def _bombs() -> dict[str, bytes]:
    bad_ids = {"requests": [{"input_ids": [-1] * 600_000, "span_start": 1}]}
    bad_items = {"requests": [{"input_ids": [1, 2], "span_start": 0}] * 100_000}
    keys: dict[str, Any] = {"input_ids": [1, 2], "span_start": 1}
    keys.update({f"k{i}": 0 for i in range(150_000)})
    nested = {"requests": [{"input_ids": [1, 2], "span_start": 1, "top_k": [[0] * 50] * 20_000}]}
    return {
        "bad ids": json.dumps(bad_ids).encode(),
        "bad items": json.dumps(bad_items).encode(),
        "unknown keys": json.dumps({"requests": [keys]}).encode(),
        "a huge value": json.dumps(nested).encode(),
    }


def test_a_body_of_bad_values_is_one_short_answer_and_the_loop_stays_free(model_dir: Path) -> None:
    bombs = _bombs()
    # control: validated value by value, the first body is 600,000 errors
    with pytest.raises(ValidationError) as undefended:
        UndefendedItem.model_validate_json(json.dumps({"input_ids": [-1] * 600_000}))
    assert undefended.value.error_count() == 600_000
    for name, body in bombs.items():
        with pytest.raises(ValidationError) as defended:
            ScoreRequest.model_validate_json(body)
        assert defended.value.error_count() <= 3, name
    metrics = ServerMetrics()
    backend = HFBackend(model_dir, metrics, max_context=MAX_CONTEXT)
    app = create_app(backend, metrics, max_body_bytes=8 * 2**20)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        stalls: list[float] = []
        stop = threading.Event()

        def poll_health() -> None:
            with httpx.Client(base_url=url, timeout=30) as poller:
                while not stop.is_set():
                    started = time.perf_counter()
                    assert poller.get("/health").status_code == 200
                    stalls.append(time.perf_counter() - started)
                    time.sleep(0.02)

        poller = threading.Thread(target=poll_health)
        poller.start()
        try:
            for name, body in bombs.items():
                assert len(body) < 8 * 2**20, name
                started = time.perf_counter()
                answer = http.post(
                    "/v1/score", content=body, headers={"content-type": "application/json"}
                )
                assert answer.status_code == 422, (name, answer.text[:300])
                assert len(answer.content) < 2048, name
                assert time.perf_counter() - started < 10, name
        finally:
            stop.set()
            poller.join(30)
        assert stalls and max(stalls) < 2.0, max(stalls)
        # the service is whole afterwards
        item = ScoreItem(input_ids=_ids(50), span_start=40)
        assert http.post("/v1/score", json=_body(item)).status_code == 200


def test_unknown_keys_are_still_named_one_by_one_when_few() -> None:
    with pytest.raises(ValidationError) as few:
        ScoreRequest.model_validate({"requests": [{"input_ids": [1, 2], "span_start": 1, "x": 0}]})
    assert few.value.errors()[0]["loc"] == ("requests", 0, "x")
    many = {"input_ids": [1, 2], "span_start": 1, **{f"k{i}": 0 for i in range(10)}}
    with pytest.raises(ValidationError, match="10 unknown fields"):
        ScoreRequest.model_validate({"requests": [many]})


# -- a client that leaves ------------------------------------------------------------------


@pytest.mark.parametrize("leaves", [True, False])
def test_a_client_that_leaves_has_its_queued_work_dropped(model_dir: Path, leaves: bool) -> None:
    """Client A's batch holds the worker; client B queues an item of a length nobody else
    sends. B leaving (leaves=True) drops it unscored; B waiting (the control) gets it
    scored, so the record below sees what it would have computed."""
    metrics = ServerMetrics()
    backend = HFBackend(model_dir, metrics, max_context=MAX_CONTEXT, max_batch_size=1)
    scorer = backend.scorer
    release = threading.Event()
    lengths: list[int] = []
    score_batch = scorer.score_batch

    def recorded(jobs: list[ScoreJob]) -> list[Any]:
        lengths.extend(len(job.item.input_ids) for job in jobs)
        if len(jobs[0].item.input_ids) == 64:
            assert release.wait(60)
        return score_batch(jobs)

    backend.batcher.run_batch = recorded
    app = create_app(backend, metrics)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        first = threading.Thread(
            target=lambda: http.post(
                "/v1/score", json=_body(ScoreItem(input_ids=_ids(64), span_start=60))
            )
        )
        first.start()
        deadline = time.monotonic() + 30
        while 64 not in lengths:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        b_item = ScoreItem(input_ids=_ids(77, 5), span_start=70)
        timeout = 0.5 if leaves else 60
        b_answer: list[int] = []

        def client_b() -> None:
            # B leaves: its connection is closed at the timeout
            with (
                httpx.Client(base_url=url, timeout=timeout) as b,
                contextlib.suppress(httpx.ReadTimeout),
            ):
                b_answer.append(b.post("/v1/score", json=_body(b_item)).status_code)

        b = threading.Thread(target=client_b)
        b.start()
        time.sleep(1.5)  # B has queued, and (leaves) has gone
        release.set()
        b.join(60)
        first.join(60)
        time.sleep(0.3)
    if leaves:
        assert b_answer == [] and 77 not in lengths, lengths
    else:
        assert b_answer == [200] and 77 in lengths, lengths


def test_large_bodies_are_checked_in_another_process_that_may_die(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over PROCESS_CHECK_BYTES a body is checked in the app's BodyChecker process first:
    good ones are then served as any, bad ones refused from there; a checker that died is
    replaced, and the body in hand is still answered; the service's end ends it."""
    monkeypatch.setattr(body_route, "PROCESS_CHECK_BYTES", 1024)
    metrics = ServerMetrics()
    backend = HFBackend(model_dir, metrics, max_context=MAX_CONTEXT)
    good = _body(ScoreItem(input_ids=_ids(600), span_start=590))
    bad = {"requests": [{"input_ids": [-1] * 600, "span_start": 1}]}
    started = set(multiprocessing.active_children())
    app = create_app(backend, metrics)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        assert http.post("/v1/score", json=good).status_code == 200
        refused = http.post("/v1/score", json=bad)
        assert refused.status_code == 422 and "input_ids.0" in refused.json()["detail"]
        checkers = set(multiprocessing.active_children()) - started
        assert len(checkers) == 1  # the check ran there
        for process in checkers:
            process.kill()
            process.join(10)
        assert http.post("/v1/score", json=good).status_code == 200
        assert http.post("/v1/score", json=bad).status_code == 422
        replaced = set(multiprocessing.active_children()) - started
        assert len(replaced) == 1 and not replaced & checkers
    deadline = time.monotonic() + 10  # stopped with the service
    while set(multiprocessing.active_children()) - started:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_span_start_past_the_end_costs_no_negative_tokens(model_dir: Path) -> None:
    """A negative cost would have admitted everything after it (review of issue 39)."""
    past = ScoreItem(input_ids=_ids(10), span_start=10**30, top_k=5)
    assert item_tokens(past) == 10
    metrics = ServerMetrics()
    app = create_app(HFBackend(model_dir, metrics, max_context=MAX_CONTEXT), metrics)
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as http:
        answer = http.post("/v1/score", json=_body(past))
        assert answer.status_code == 400 and "span_start" in answer.json()["detail"]


def test_jobs_of_requests_that_left_count_in_the_queue_until_dropped() -> None:
    """While the worker is busy, requests that are cancelled leave their jobs queued: they
    count against max_queue until the worker drops them, so the queue cannot grow past it
    (before, each cancel gave its room back while its jobs stayed)."""

    async def run() -> tuple[int, int]:
        busy = threading.Event()
        batcher: MicroBatcher[int] = MicroBatcher(
            lambda jobs: [ScoreResult(logprobs=[]) for _ in jobs] if busy.wait(30) else [],
            max_batch_size=1,
            max_wait_s=0.0,
            max_queue=8,
        )
        batcher.start()
        first = asyncio.ensure_future(batcher.submit([0]))
        await asyncio.sleep(0.1)  # the worker holds job 0
        for _ in range(3):
            leaving = asyncio.ensure_future(batcher.submit([1, 2]))
            await asyncio.sleep(0.01)
            leaving.cancel()
        await asyncio.sleep(0.05)
        queued = batcher.pending  # job 0 and the 6 left behind
        with pytest.raises(Overloaded):  # 7 + 2 > 8 (admitted, it would wait: a timeout)
            await asyncio.wait_for(batcher.submit([3, 4]), 1)
        busy.set()
        await first
        await asyncio.sleep(0.2)  # the worker drops the cancelled jobs
        drained = batcher.pending
        await batcher.stop()
        return queued, drained

    assert asyncio.run(run()) == (7, 0)


def test_an_answer_being_sent_holds_its_tokens_until_the_client_takes_it(
    model_dir: Path,
) -> None:
    """Answers go out a chunk at a time: one that a client does not read keeps its tokens
    in the budget (another such request waits, 503), and gives them back when the client
    leaves, instead of sitting whole in the connection's buffer outside the budget."""
    metrics = ServerMetrics()
    backend = HFBackend(
        model_dir, metrics, max_context=MAX_CONTEXT, max_top_k=200, max_request_tokens=10**6
    )
    wide = ScoreItem(input_ids=_ids(1000), span_start=2, top_k=200)  # about 5 MB of JSON
    app = create_app(backend, metrics, max_inflight_tokens=item_tokens(wide) + 10)
    body = json.dumps(_body(wide)).encode()
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        host, port = url.removeprefix("http://").split(":")
        with socket.socket() as reader:
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader.connect((host, int(port)))
            reader.sendall(
                b"POST /v1/score HTTP/1.1\r\nHost: t\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            time.sleep(3)  # scored, serialized, partly sent; never read
            busy = http.post("/v1/score", json=_body(wide))
            assert busy.status_code == 503, busy.text[:200]
        deadline = time.monotonic() + 10
        while (answer := http.post("/v1/score", json=_body(wide))).status_code == 503:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert answer.status_code == 200


@pytest.mark.timeout(120)
def test_a_killed_service_leaves_no_body_checker_behind(model_dir: Path, tmp_path: Path) -> None:
    """The checker dies with the service even when the service is SIGKILLed (before, each
    killed or exited service left its checker waiting on its queue for ever)."""
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "teacher_server", "serve", "--model", str(model_dir),
             "--port", str(port), "--max-context", str(MAX_CONTEXT)],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, server, log)
        bad = {"requests": [{"input_ids": [-1] * 200_000, "span_start": 1}]}  # over 256 KiB
        assert httpx.post(f"{url}/v1/score", json=bad, timeout=60).status_code == 422
        # the checker, and multiprocessing's resource tracker beside it
        children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
        assert any(b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes() for c in children)
    finally:
        server.kill()
        server.wait(30)
    deadline = time.monotonic() + 10
    while alive := [c for c in children if running(int(c))]:
        assert time.monotonic() < deadline, f"{alive} outlived the service"
        time.sleep(0.1)
