"""The SGLang backend: forwards each item to an SGLang server's /generate.

SGLang scores prompt tokens when asked for `max_new_tokens: 0` with `return_logprob` and
`logprob_start_len = s`: `meta_info.input_token_logprobs` then holds one [logprob,
token_id, text] triple per id from s on, entry 0's logprob null. With s = span_start - 1
entries 1.. are the span. Its radix cache reuses at most s prefix tokens, and a router
keeps one session on one replica when given the `X-SMG-Routing-Key` header.

SGLang's prompt log-probs are not temperature-scaled and SGLang does not range-check
input ids (an out-of-vocabulary id crashes its engine), so both are handled here. SGLang
refuses an input of its context length or more (TokenizerManager._validate_one_request:
`len(input_ids) >= context_len`), so the longest input accepted here is one id shorter.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import httpx

from teacher_server.api import (
    ROUTING_HEADER,
    SGLANG_KEEP_ALIVE_S,
    ReloadResult,
    ScoreItem,
    ScoreResult,
    ServerInfo,
    TrajectoryScoreRequest,
    routing_key,
)
from teacher_server.backend import BackendFailure, BadScoreRequest, admit, check_items
from teacher_server.metrics import ServerMetrics


class SGLangBackend:
    def __init__(
        self,
        url: str,
        tokenizer: Any,
        metrics: ServerMetrics,
        *,
        model_name: str,
        tokenizer_identity: str,
        max_context: int | None = None,
        max_top_k: int = 100,
        max_concurrency: int = 64,
        max_queue: int = 1024,
        max_request_tokens: int | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.metrics = metrics
        self.vocab_size = len(tokenizer)
        self.model_name = model_name
        self.tokenizer_identity = tokenizer_identity
        self.max_context = max_context
        self.max_top_k = max_top_k
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.max_request_tokens = max_request_tokens
        """tokens of one request at most (backend.request_tokens; 413 past it); None:
        max_concurrency items of the max context, what SGLang is asked to hold at once for
        one request."""
        self.timeout_s = timeout_s
        self.pending = 0
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._client: httpx.AsyncClient | None = None

    def info(self) -> ServerInfo:
        return ServerInfo(
            model=self.model_name,
            tokenizer=self.tokenizer_identity,
            vocab_size=self.vocab_size,
            max_context=self.max_context or 0,
            backend="sglang",
            max_top_k=self.max_top_k,
            max_batch_size=self.max_concurrency,
            max_request_tokens=self.max_request_tokens
            or (self.max_context * self.max_concurrency if self.max_context else None),
        )

    async def start(self) -> None:
        limits = httpx.Limits(
            max_connections=self.max_concurrency * 2, keepalive_expiry=SGLANG_KEEP_ALIVE_S
        )
        self._client = httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s, limits=limits)
        try:
            models = (await self._client.get("/v1/models")).json()
            context_len = int(models["data"][0]["max_model_len"])
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as err:
            if self.max_context is None:
                raise BackendFailure(
                    f"could not read the context length from {self.url}/v1/models ({err}); "
                    "pass --max-context"
                ) from err
            return  # the given limit stands: it cannot be checked against the server's
        longest = context_len - 1  # SGLang refuses len(input_ids) >= context_len
        self.max_context = longest if self.max_context is None else min(self.max_context, longest)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def drop_session(self, session_id: str) -> bool:
        """SGLang's radix cache is shared and LRU-evicted: there is nothing to free."""
        return False

    async def reload(self, model_dir: str) -> ReloadResult:
        """SGLang's own /update_weights_from_disk (same architecture, new weights)."""
        assert self._client is not None, "start() first"
        try:
            response = await self._client.post(
                "/update_weights_from_disk", json={"model_path": model_dir}
            )
        except httpx.HTTPError as err:
            raise BackendFailure(f"SGLang unreachable for the reload: {err}") from err
        body = response.json() if response.content else {}
        if response.status_code != 200 or body.get("success") is False:
            raise BadScoreRequest(f"SGLang refused to load {model_dir}: {body or response.text}")
        return ReloadResult(model=model_dir, sessions_dropped=0)

    async def score_trajectory(self, request: TrajectoryScoreRequest) -> list[ScoreResult]:
        raise BadScoreRequest(
            "whole-trajectory scoring needs an attention mask per request, which SGLang's "
            "/generate does not take: score per turn with a session_id (the radix cache "
            "reuses each turn's prefix)"
        )

    def metrics_text(self) -> str:
        return f"# TYPE opd_teacher_queue_depth gauge\nopd_teacher_queue_depth {self.pending}\n"

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        check_items(items, self.info())
        for index, item in enumerate(items):
            if item.temperature != 1 and item.top_k == 0:
                raise BadScoreRequest(
                    f"requests[{index}].temperature: SGLang's prompt log-probs are not "
                    "temperature-scaled, so temperature must be 1 unless top_k > 0 (then "
                    "log-probs are renormalized over the top-k plus the scored token)"
                )
        admit(self.pending, len(items), self.max_queue)
        self.pending += len(items)
        try:
            return list(await asyncio.gather(*(self._score_one(item) for item in items)))
        finally:
            self.pending -= len(items)

    async def _score_one(self, item: ScoreItem) -> ScoreResult:
        assert self._client is not None, "start() first"
        start = item.span_start - 1
        body: dict[str, Any] = {
            "input_ids": item.input_ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": start,
        }
        if item.top_k:
            body["top_logprobs_num"] = item.top_k
        headers = {}
        if item.session_id:
            headers[ROUTING_HEADER] = routing_key(item.session_id)
        async with self._semaphore:
            try:
                response = await self._client.post("/generate", json=body, headers=headers)
            except httpx.HTTPError as err:
                raise BackendFailure(f"SGLang at {self.url} unreachable: {err}") from err
        if response.status_code != 200:
            raise BackendFailure(f"SGLang answered {response.status_code}: {response.text[:500]}")
        payload = response.json()
        meta = (payload[0] if isinstance(payload, list) else payload)["meta_info"]
        result = _convert(item, meta)
        span = len(item.input_ids) - item.span_start
        self.metrics.add_tokens(
            scored=span,
            cached=result.cached_tokens,
            computed=len(item.input_ids) - result.cached_tokens,
        )
        return result


def _convert(item: ScoreItem, meta: dict[str, Any]) -> ScoreResult:
    """SGLang's triples -> our result, checking every token id against the request."""
    start = item.span_start - 1
    entries = meta["input_token_logprobs"]
    expected = len(item.input_ids) - start
    if len(entries) != expected:
        raise BackendFailure(
            f"SGLang returned {len(entries)} prompt log-probs, expected "
            f"{expected} (logprob_start_len {start})"
        )
    logprobs = []
    for offset, (logprob, token_id, _) in enumerate(entries[1:], start=1):
        if token_id != item.input_ids[start + offset]:
            raise BackendFailure(
                f"SGLang's log-prob {offset} is for id {token_id}, the request has "
                f"{item.input_ids[start + offset]} there: misaligned"
            )
        logprobs.append(float(logprob))
    result = ScoreResult(logprobs=logprobs, cached_tokens=int(meta.get("cached_tokens", 0)))
    if item.top_k:
        rows = meta.get("input_top_logprobs") or []
        if len(rows) != expected:
            raise BackendFailure(f"SGLang returned {len(rows)} top-k rows, expected {expected}")
        result.top_k_ids = [[int(t[1]) for t in row] for row in rows[1:]]
        result.top_k_logprobs = [[float(t[0]) for t in row] for row in rows[1:]]
        if item.temperature != 1:
            _rescale_on_support(result, item.input_ids[item.span_start :], float(item.temperature))
    return result


def _rescale_on_support(result: ScoreResult, targets: list[int], temperature: float) -> None:
    """Temperature-scale exactly on each position's support (top-k ids plus the scored id),
    renormalized there: the full vocabulary's normalizer is not available from SGLang."""
    assert result.top_k_ids is not None and result.top_k_logprobs is not None
    for position, target in enumerate(targets):
        support = dict(
            zip(result.top_k_ids[position], result.top_k_logprobs[position], strict=True)
        )
        support.setdefault(target, result.logprobs[position])
        scaled = {token: value / temperature for token, value in support.items()}
        peak = max(scaled.values())
        normalizer = peak + math.log(sum(math.exp(v - peak) for v in scaled.values()))
        result.logprobs[position] = scaled[target] - normalizer
        result.top_k_logprobs[position] = [
            scaled[t] - normalizer for t in result.top_k_ids[position]
        ]
