"""The teacher as a service: the CLI, client retries, an OpenAPI fuzz run, a load test."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from rollout.policy import SGLangPolicy
from slime_ext.models.factory import build_checkpoint
from teacher_server.api import CLIENT_KEEP_ALIVE_S, SERVICE_KEEP_ALIVE_S, ScoreItem
from teacher_server.app import create_app
from teacher_server.client import TeacherClient, TeacherOverloaded, TeacherUnavailable
from teacher_server.hf_backend import HFBackend
from teacher_server.metrics import ServerMetrics
from tests.live_server import free_port, serve_in_thread, wait_until_healthy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
LOAD_TEST_S = float(os.environ.get("OPD_LOAD_TEST_S", "10"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("service") / "m", seed=4)


@pytest.mark.timeout(180)
def test_cli_serves_and_scores(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "teacher_server",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--api-key",
            "k",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, server, tmp_path / "server.log")

        async def run() -> Any:
            async with TeacherClient(url, api_key="k") as teacher:
                return await teacher.score_span([5, 6, 7, 8, 9], span_start=2, top_k=3)

        result = asyncio.run(run())
        assert len(result.logprobs) == 3 and len(result.top_k_ids) == 3
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def _flaky_upstream(failures: int) -> FastAPI:
    app = FastAPI()
    calls = Counter[str]()

    @app.post("/v1/score")
    async def score() -> Any:
        calls["score"] += 1
        if calls["score"] <= failures:
            return JSONResponse({"detail": "busy"}, status_code=503, headers={"Retry-After": "0"})
        return {"results": [{"logprobs": [-1.0, -2.0], "cached_tokens": 0}]}

    return app


def test_clients_let_idle_connections_go_before_the_servers_close_them() -> None:
    # equal times (uvicorn's and httpx's defaults, 5 s) race: a pooled connection is
    # reused as the server closes it, a read error no server fault caused
    async def pool_expiry() -> float:
        async with TeacherClient("http://127.0.0.1:1") as teacher:
            return float(teacher._http._transport._pool._keepalive_expiry)  # type: ignore[attr-defined]

    assert asyncio.run(pool_expiry()) == CLIENT_KEEP_ALIVE_S < SERVICE_KEEP_ALIVE_S
    policy = SGLangPolicy("http://127.0.0.1:1")
    try:
        expiry = policy._http._transport._pool._keepalive_expiry  # type: ignore[attr-defined]
        assert expiry < 5  # SGLang's uvicorn.run(timeout_keep_alive=5)
    finally:
        asyncio.run(policy.close())


def test_client_retries_503_then_succeeds_or_gives_up() -> None:
    item = ScoreItem(input_ids=[1, 2, 3], span_start=1)

    async def run(url: str, retries: int) -> Any:
        async with TeacherClient(url, retries=retries, backoff_s=0.01) as teacher:
            return await teacher.score([item])

    with serve_in_thread(_flaky_upstream(failures=2)) as url:
        assert asyncio.run(run(url, retries=3))[0].logprobs == [-1.0, -2.0]
    with serve_in_thread(_flaky_upstream(failures=5)) as url, pytest.raises(TeacherOverloaded):
        asyncio.run(run(url, retries=2))
    with pytest.raises(TeacherUnavailable):
        asyncio.run(run(f"http://127.0.0.1:{free_port()}", retries=2))


def _only_network_errors(report: str) -> bool:
    """Whether a schemathesis report's only problems are network errors (no failed
    check: no server error, no answer off its schema)."""
    return "Network Error" in report and "FAILURES" not in report and "Failed checks" not in report


@pytest.fixture(scope="module")
def live_teacher(model_dir: Path) -> Iterator[tuple[str, HFBackend]]:
    metrics = ServerMetrics()
    backend = HFBackend(
        model_dir, metrics, max_context=256, max_top_k=8, max_queue=48, cache_budget_mb=2.0
    )
    with serve_in_thread(create_app(backend, metrics)) as url:
        yield url, backend


@pytest.mark.timeout(300)
def test_openapi_fuzz_finds_no_server_error(live_teacher: tuple[str, HFBackend]) -> None:
    schemathesis = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    if not Path(schemathesis).exists():
        pytest.skip("schemathesis is not installed (it is in the dev extra)")
    url, _ = live_teacher
    command = [
        schemathesis, "run", f"{url}/openapi.json", "-n", "40", "--seed", "1",
        "--checks", "not_a_server_error,response_schema_conformance",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=130, check=False)
    if done.returncode != 0 and _only_network_errors(done.stdout):
        # once in CI (of about 8 full runs, under load) the coverage phase's TRACE with a
        # body, refused 413 from its headers with the body unread, had its connection
        # reset before the answer was read: the same seed again, which a server error
        # (a 5xx or a schema violation) fails again
        done = subprocess.run(command, capture_output=True, text=True, timeout=130, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.timeout(int(LOAD_TEST_S) + 120)
def test_load_64_clients_only_503_under_overload(live_teacher: tuple[str, HFBackend]) -> None:
    url, backend = live_teacher
    statuses: Counter[int] = Counter()

    async def client(index: int, http: httpx.AsyncClient, stop_at: float) -> None:
        rng = random.Random(index)
        context = [rng.randrange(800) for _ in range(rng.randrange(16, 96))]
        while time.monotonic() < stop_at:
            span = [rng.randrange(800) for _ in range(rng.randrange(4, 24))]
            item = {
                "input_ids": context + span,
                "span_start": len(context),
                "top_k": rng.choice([0, 4]),
                "session_id": f"load-{index}" if index % 2 else None,
            }
            response = await http.post("/v1/score", json={"requests": [item]})
            statuses[response.status_code] += 1
            if response.status_code == 200:
                assert len(response.json()["results"][0]["logprobs"]) == len(span)
            context = (context + span[:4] + [rng.randrange(800) for _ in range(8)])[-200:]

    async def run() -> None:
        # as TeacherClient: idle connections let go before the service closes them
        limits = httpx.Limits(max_connections=64, keepalive_expiry=CLIENT_KEEP_ALIVE_S)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:
            stop_at = time.monotonic() + LOAD_TEST_S
            await asyncio.gather(*(client(i, http, stop_at) for i in range(64)))

    asyncio.run(run())
    assert set(statuses) <= {200, 503}, statuses
    assert statuses[200] > 64
    sessions = backend.scorer.sessions
    assert sessions.total_bytes <= sessions.budget_bytes
    assert httpx.get(f"{url}/health").status_code == 200
