"""The sglang backend against a stand-in of SGLang's /generate
(slime_ext/cpu_runtime/sglang_http.py), and against real SGLang when it is installed with a
GPU (skipped otherwise)."""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime_ext.cpu_runtime.sglang_http import create_standin
from slime_ext.models.factory import build_checkpoint
from teacher_server.api import ROUTING_HEADER, ScoreItem, routing_key
from teacher_server.app import create_app
from teacher_server.backend import tokenizer_identity
from teacher_server.client import TeacherClient, TeacherError
from teacher_server.metrics import ServerMetrics
from teacher_server.sglang_backend import SGLangBackend
from tests.live_server import serve_in_thread

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("sglang") / "m", seed=3)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def _teacher(model_dir: Path, upstream: str) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    metrics = ServerMetrics()
    backend = SGLangBackend(
        upstream,
        tokenizer,
        metrics,
        model_name=str(model_dir),
        tokenizer_identity=tokenizer_identity(tokenizer),
        max_top_k=20,
    )
    return serve_in_thread(create_app(backend, metrics))


@pytest.fixture(scope="module")
def standin_url(model: Any) -> Iterator[str]:
    with serve_in_thread(create_standin(model, context_length=1024)) as url:
        yield url


@pytest.fixture(scope="module")
def teacher_url(model_dir: Path, standin_url: str) -> Iterator[str]:
    with _teacher(model_dir, standin_url) as url:
        yield url


def _score(url: str, items: list[ScoreItem]) -> list[Any]:
    async def run() -> list[Any]:
        async with TeacherClient(url, retries=0) as teacher:
            return await teacher.score(items)

    return asyncio.run(run())


def _reference(model: Any, ids: list[int], span_start: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[span_start - 1 : -1], dim=-1)


IDS = [(i * 37 + 11) % 800 for i in range(48)]


def test_scores_and_top_k_match_the_model(teacher_url: str, model: Any) -> None:
    [result] = _score(teacher_url, [ScoreItem(input_ids=IDS, span_start=30, top_k=5)])
    rows = _reference(model, IDS, 30)
    chosen = rows.gather(-1, torch.tensor(IDS[30:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(result.logprobs), chosen, atol=1e-5)
    assert result.top_k_ids == rows.topk(5).indices.tolist()
    assert torch.allclose(torch.tensor(result.top_k_logprobs), rows.topk(5).values, atol=1e-5)


def test_session_requests_carry_the_routing_key_and_report_cached_tokens(
    teacher_url: str, standin_url: str
) -> None:
    ids = [(i * 53 + 7) % 800 for i in range(48)]  # not seen by the stand-in before
    first = ScoreItem(input_ids=ids[:40], span_start=30, session_id="traj-7")
    second = ScoreItem(input_ids=ids, span_start=44, session_id="traj-7")
    results = [_score(teacher_url, [first])[0], _score(teacher_url, [second])[0]]
    headers = httpx.get(f"{standin_url}/standin/headers").json()
    assert headers[-1][ROUTING_HEADER.lower()] == "traj-7"
    assert results[1].cached_tokens == 40  # the stand-in's radix cache: the shared prefix


def test_a_non_ascii_session_reaches_sglang_as_its_routing_key(
    teacher_url: str, standin_url: str
) -> None:
    """httpx sends header values as ASCII: a session id such as a task's own name used to
    make the backend fail the whole request."""
    item = ScoreItem(input_ids=IDS[:40], span_start=30, session_id="tâche-7#0")
    [result] = _score(teacher_url, [item])
    assert len(result.logprobs) == 10
    headers = httpx.get(f"{standin_url}/standin/headers").json()
    assert headers[-1][ROUTING_HEADER.lower()] == routing_key("tâche-7#0")


def test_temperature_needs_top_k_and_is_exact_on_the_support(teacher_url: str, model: Any) -> None:
    with httpx.Client(base_url=teacher_url) as http:
        refused = http.post(
            "/v1/score",
            json={"requests": [{"input_ids": IDS, "span_start": 40, "temperature": 0.5}]},
        )
    assert refused.status_code == 400
    assert "not temperature-scaled" in refused.json()["detail"]
    [result] = _score(
        teacher_url, [ScoreItem(input_ids=IDS, span_start=40, top_k=4, temperature=0.5)]
    )
    rows = _reference(model, IDS, 40)
    for position, target in enumerate(IDS[40:]):
        top = rows[position].topk(4)
        support = {int(i): float(v) for i, v in zip(top.indices, top.values, strict=True)}
        support.setdefault(target, float(rows[position, target]))
        normalizer = math.log(sum(math.exp(v / 0.5) for v in support.values()))
        assert result.logprobs[position] == pytest.approx(
            support[target] / 0.5 - normalizer, abs=1e-5
        )
        expected_top = [support[int(i)] / 0.5 - normalizer for i in top.indices]
        assert result.top_k_logprobs[position] == pytest.approx(expected_top, abs=1e-5)


def test_out_of_vocabulary_ids_never_reach_sglang(teacher_url: str, standin_url: str) -> None:
    calls_before = len(httpx.get(f"{standin_url}/standin/headers").json())
    with httpx.Client(base_url=teacher_url) as http:
        response = http.post(
            "/v1/score", json={"requests": [{"input_ids": [1, 2, 5000], "span_start": 1}]}
        )
    assert response.status_code == 400 and "outside the vocabulary" in response.json()["detail"]
    assert len(httpx.get(f"{standin_url}/standin/headers").json()) == calls_before


def test_misaligned_answers_are_caught(model_dir: Path, model: Any) -> None:
    with (
        serve_in_thread(create_standin(model, 1024, misalign=True)) as upstream,
        _teacher(model_dir, upstream) as url,
        pytest.raises(TeacherError, match="misaligned"),
    ):
        _score(url, [ScoreItem(input_ids=IDS, span_start=30)])


def test_context_length_comes_from_the_server(teacher_url: str) -> None:
    async def run() -> Any:
        async with TeacherClient(teacher_url) as teacher:
            return await teacher.info()

    info = asyncio.run(run())
    # the server's context length is 1024; SGLang refuses an input of that many ids
    assert info.backend == "sglang" and info.max_context == 1023


def test_an_input_of_the_context_length_is_a_400_not_an_upstream_failure(
    teacher_url: str, standin_url: str
) -> None:
    """SGLang refuses len(input_ids) >= context_len; our check let exactly context_len
    through, and SGLang's refusal came back as a server error."""
    ids = [(i * 29 + 3) % 800 for i in range(1024)]
    calls_before = len(httpx.get(f"{standin_url}/standin/headers").json())
    with httpx.Client(base_url=teacher_url) as http:
        refused = http.post(
            "/v1/score", json={"requests": [{"input_ids": ids, "span_start": 1000}]}
        )
        assert refused.status_code == 400, refused.text
        assert "1024 ids exceed the max context of 1023" in refused.json()["detail"]
        assert len(httpx.get(f"{standin_url}/standin/headers").json()) == calls_before
        served = http.post(
            "/v1/score", json={"requests": [{"input_ids": ids[:1023], "span_start": 1000}]}
        )
    assert served.status_code == 200, served.text
    assert len(served.json()["results"][0]["logprobs"]) == 23
    upstream = httpx.post(  # the stand-in holds SGLang's rule, so the boundary is real
        f"{standin_url}/generate",
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "logprob_start_len": 999},
    )
    assert upstream.status_code == 400
    assert "longer than the model's context length (1024" in upstream.json()["error"]["message"]


def test_a_request_over_the_token_budget_is_a_413_that_never_reaches_sglang(
    model_dir: Path, standin_url: str
) -> None:
    """The sglang backend had no per-request budget: a request of many long items went
    upstream whole. The default is max_concurrency items of the max context."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    metrics = ServerMetrics()
    backend = SGLangBackend(
        standin_url,
        tokenizer,
        metrics,
        model_name=str(model_dir),
        tokenizer_identity=tokenizer_identity(tokenizer),
        max_concurrency=2,
    )
    item = {"input_ids": [(i * 7 + 1) % 800 for i in range(1000)], "span_start": 990}
    calls_before = len(httpx.get(f"{standin_url}/standin/headers").json())
    with serve_in_thread(create_app(backend, metrics)) as url:
        info = httpx.get(f"{url}/v1/info").json()
        assert info["max_request_tokens"] == 2 * 1023
        refused = httpx.post(f"{url}/v1/score", json={"requests": [item] * 3})
        assert refused.status_code == 413, refused.text
        assert "costs 3000 tokens" in refused.json()["detail"]
        assert len(httpx.get(f"{standin_url}/standin/headers").json()) == calls_before
        served = httpx.post(f"{url}/v1/score", json={"requests": [item] * 2}, timeout=60)
        assert served.status_code == 200, served.text


def test_a_given_max_context_is_clamped_to_what_sglang_accepts(
    model_dir: Path, standin_url: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    backend = SGLangBackend(
        standin_url,
        tokenizer,
        ServerMetrics(),
        model_name=str(model_dir),
        tokenizer_identity=tokenizer_identity(tokenizer),
        max_context=4096,
    )

    async def run() -> int:
        await backend.start()
        try:
            return backend.info().max_context
        finally:
            await backend.stop()

    assert asyncio.run(run()) == 1023


def _real_sglang_url() -> str | None:
    return os.environ.get("OPD_TEST_SGLANG_URL")


@pytest.mark.skipif(
    _real_sglang_url() is None,
    reason="real SGLang needs a GPU: set OPD_TEST_SGLANG_URL (a running "
    "server) and OPD_TEST_SGLANG_MODEL (its model directory)",
)
def test_against_real_sglang() -> None:
    url, model_path = _real_sglang_url(), os.environ["OPD_TEST_SGLANG_MODEL"]
    assert url is not None
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = tokenizer("The capital of France is Paris. The capital of Italy is Rome.")["input_ids"]
    with _teacher(Path(model_path), url) as teacher:
        [result] = _score(
            teacher,
            [ScoreItem(input_ids=ids, span_start=len(ids) // 2, top_k=5, session_id="real")],
        )
    assert len(result.logprobs) == len(ids) - len(ids) // 2
    assert all(lp <= 0 for lp in result.logprobs)
    assert all(row == sorted(row, reverse=True) for row in result.top_k_logprobs or [])
