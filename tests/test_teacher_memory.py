"""The hf backend's memory is bounded by construction: forwards of at most max_batch_tokens
padded ids, items bucketed by length (never padded to a concurrent client's long item),
right-padded without an attention mask, session requests computed in chunks, requests of
too many ids refused with 413; and every item scores as it would alone."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from slime_ext.models.factory import build_checkpoint
from teacher_server.api import ScoreItem
from teacher_server.app import create_app
from teacher_server.cli import app as cli_app
from teacher_server.client import TeacherBadRequest, TeacherClient
from teacher_server.hf_backend import PAD_FACTOR, SESSION_CHUNK, HFBackend, LimitsError
from teacher_server.hf_backend import plan_forwards as plan
from teacher_server.metrics import ServerMetrics
from tests.live_server import serve_in_thread
from tests.test_teacher_server import CountingTransport

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.timeout(300)]
MAX_CONTEXT = 1024


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("memory") / "full", seed=5)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3_5-tiny", tmp_path_factory.mktemp("memory") / "hybrid", seed=6)


class ForwardLog:
    """The [rows, ids] shape of every forward: what enters the embedding layer."""

    def __init__(self, backend: HFBackend) -> None:
        self.shapes: list[tuple[int, int]] = []
        embed = backend.scorer.model.get_input_embeddings()
        embed.register_forward_hook(lambda _m, args, _o: self.shapes.append(tuple(args[0].shape)))


def _backend(model_dir: Path, **options: Any) -> tuple[HFBackend, ForwardLog]:
    backend = HFBackend(model_dir, ServerMetrics(), max_context=MAX_CONTEXT, **options)
    return backend, ForwardLog(backend)


def _concurrently(backend: HFBackend, requests: list[list[ScoreItem]]) -> list[list[Any]]:
    """Each list one request, all submitted at once (as concurrent clients)."""

    async def run() -> list[list[Any]]:
        await backend.start()
        try:
            return list(await asyncio.gather(*(backend.score(items) for items in requests)))
        finally:
            await backend.stop()

    return asyncio.run(run())


def _ids(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(800) for _ in range(length)]


def _alone(model: Any, item: ScoreItem) -> tuple[torch.Tensor, torch.return_types.topk | None]:
    """The reference: the item in a forward of its own, no padding."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([item.input_ids])).logits[0].float()
    end = len(item.input_ids) - 1
    rows = torch.log_softmax(logits[item.span_start - 1 : end] / item.temperature, dim=-1)
    chosen = rows.gather(-1, torch.tensor(item.input_ids[item.span_start :])[:, None])[:, 0]
    return chosen, (rows.topk(item.top_k) if item.top_k else None)


@pytest.mark.parametrize("which", ["full", "hybrid"])
def test_mixed_lengths_score_as_each_item_alone(request: pytest.FixtureRequest, which: str) -> None:
    backend, log = _backend(request.getfixturevalue(f"{which}_dir"), max_batch_tokens=MAX_CONTEXT)
    rng = random.Random(3)
    lengths = [700, 40, 600, 35, 520, 90, 41, 300, 280, 44]
    items = [
        ScoreItem(
            input_ids=_ids(rng, length),
            span_start=rng.randrange(1, length),
            top_k=rng.choice([0, 5]),
            temperature=rng.choice([1.0, 0.7]),
        )
        for length in lengths
    ]
    [results] = _concurrently(backend, [items])
    assert any(rows > 1 for rows, _ in log.shapes)  # some forwards did batch rows
    for item, result in zip(items, results, strict=True):
        chosen, top = _alone(backend.scorer.model, item)
        assert torch.allclose(torch.tensor(result.logprobs), chosen, atol=1e-5)
        if top is not None:
            assert result.top_k_ids == top.indices.tolist()
            assert torch.allclose(torch.tensor(result.top_k_logprobs), top.values, atol=1e-5)


def test_no_forward_holds_more_than_the_token_budget(full_dir: Path) -> None:
    """8 items near the max context in one request used to be one forward of 8 x 1024 ids
    with a [8, 1024, 1024] mask; by default a forward holds at most one max-context item."""
    backend, log = _backend(full_dir)
    rng = random.Random(4)
    items = [ScoreItem(input_ids=_ids(rng, MAX_CONTEXT - i), span_start=900) for i in range(8)]
    items += [ScoreItem(input_ids=_ids(rng, 100 + i), span_start=90) for i in range(8)]
    [results] = _concurrently(backend, [items])
    assert len(results) == 16
    assert max(rows * width for rows, width in log.shapes) <= MAX_CONTEXT
    real = sum(len(item.input_ids) for item in items)
    assert sum(rows * width for rows, width in log.shapes) <= PAD_FACTOR * real
    assert [rows for rows, _ in log.shapes].count(8) == 1  # the 8 short ones, together


def test_short_items_are_not_padded_to_another_clients_long_one(full_dir: Path) -> None:
    """Items from concurrent clients share a micro-batch; they used to share one forward,
    every short item padded to the long one (8x the ids here)."""
    backend, log = _backend(full_dir, max_batch_tokens=8 * MAX_CONTEXT)
    rng = random.Random(5)
    long = ScoreItem(input_ids=_ids(rng, 1000), span_start=990)
    shorts = [ScoreItem(input_ids=_ids(rng, 50 + i), span_start=40) for i in range(7)]
    results = _concurrently(backend, [[long], *([item] for item in shorts)])
    assert [len(r[0].logprobs) for r in results] == [10] + [10 + i for i in range(7)]
    computed = sum(rows * width for rows, width in log.shapes)
    assert computed <= PAD_FACTOR * (1000 + sum(len(item.input_ids) for item in shorts))
    assert sorted(log.shapes) == [(1, 1000), (7, 56)]


@given(
    lengths=st.lists(st.integers(2, 5000), max_size=40),
    budget=st.integers(64, 8192),
)
def test_plan_forwards_covers_every_item_once_within_the_bounds(
    lengths: list[int], budget: int
) -> None:
    forwards = plan(lengths, budget)
    assert sorted(i for forward in forwards for i in forward) == list(range(len(lengths)))
    for forward in forwards:
        longest = max(lengths[i] for i in forward)
        assert len(forward) == 1 or len(forward) * longest <= budget
        assert all(lengths[i] * PAD_FACTOR >= longest for i in forward)


@pytest.mark.parametrize("which", ["full", "hybrid"])
def test_long_session_requests_compute_in_chunks_as_a_direct_forward(
    request: pytest.FixtureRequest, which: str
) -> None:
    """A session request used to compute its new ids in one forward, whose mask over the
    cached prefix is new x (prefix + new): quadratic in the context."""
    backend, log = _backend(request.getfixturevalue(f"{which}_dir"), snapshot_every=256)
    rng = random.Random(6)
    first = ScoreItem(input_ids=_ids(rng, 40), span_start=30, session_id="long")
    second_ids = first.input_ids[:30] + _ids(rng, 980)
    second = ScoreItem(input_ids=second_ids, span_start=990, session_id="long")
    [[first_result], [second_result]] = [_concurrently(backend, [[i]])[0] for i in (first, second)]
    assert second_result.cached_tokens == 30  # the shared prefix (hybrid: a snapshot there)
    assert max(width for _, width in log.shapes) <= SESSION_CHUNK
    for item, result in ((first, first_result), (second, second_result)):
        chosen, _ = _alone(backend.scorer.model, item)
        assert torch.allclose(torch.tensor(result.logprobs), chosen, atol=1e-5)


@pytest.fixture(scope="module")
def small_request_teacher(full_dir: Path) -> Iterator[tuple[str, HFBackend]]:
    metrics = ServerMetrics()
    backend = HFBackend(full_dir, metrics, max_context=MAX_CONTEXT, max_request_tokens=2048)
    with serve_in_thread(create_app(backend, metrics)) as url:
        yield url, backend


def test_a_request_of_too_many_ids_is_413_naming_the_limit(
    small_request_teacher: tuple[str, HFBackend],
) -> None:
    url, backend = small_request_teacher
    assert backend.info().max_request_tokens == 2048
    rng = random.Random(7)
    over = [ScoreItem(input_ids=_ids(rng, 1000), span_start=990) for _ in range(3)]
    with httpx.Client(base_url=url) as http:
        response = http.post("/v1/score", json={"requests": [i.model_dump() for i in over]})
    assert response.status_code == 413
    detail = response.json()["detail"]
    assert "costs 3000 tokens" in detail and "at most 2048" in detail
    assert "max_request_tokens" in detail
    transport = CountingTransport()

    async def score(items: list[ScoreItem]) -> list[Any]:
        async with TeacherClient(url, transport=transport, backoff_s=0.01) as teacher:
            return await teacher.score(items)

    with pytest.raises(TeacherBadRequest, match="at most 2048"):
        asyncio.run(score(over))
    assert transport.requests == 1  # not retried
    assert len(asyncio.run(score(over[:2]))) == 2  # 2000 ids: under the limit, served


def test_limits_that_cannot_hold_one_max_context_item_are_refused(full_dir: Path) -> None:
    with pytest.raises(
        LimitsError, match=re.escape("max_batch_tokens (512) is under the max context")
    ):
        HFBackend(full_dir, ServerMetrics(), max_context=MAX_CONTEXT, max_batch_tokens=512)
    with pytest.raises(LimitsError, match="max_request_tokens"):
        HFBackend(full_dir, ServerMetrics(), max_context=MAX_CONTEXT, max_request_tokens=1000)
    default = HFBackend(full_dir, ServerMetrics(), max_context=MAX_CONTEXT, max_batch_size=8)
    assert default.scorer.max_batch_tokens == MAX_CONTEXT
    assert default.info().max_request_tokens == 8 * MAX_CONTEXT


def test_serve_help_states_the_memory_bound() -> None:
    result = CliRunner().invoke(cli_app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "bounded by construction" in result.output
    assert "--max-batch-tokens" in result.output and "--max-request-tokens" in result.output
