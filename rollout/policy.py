"""Generation backends: token ids in; sampled ids, their log-probs and a finish reason out.

Log-probs are those of the temperature-scaled, untruncated distribution (what SGLang
returns by default). They are the sampler's own only when top_p is 1 and top_k is off:
OPD's sampled reverse KL is on-policy only then (REFERENCE.md), so OPD rollouts keep the
defaults here unless the recipe computes student log-probs under the same truncation.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Literal, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field

from teacher_server.api import ROUTING_HEADER, SGLANG_KEEP_ALIVE_S, routing_key

FinishReason = Literal["stop", "length", "abort"]


class PolicyError(RuntimeError):
    """The generation backend failed (not the model's output): the trajectory aborts."""


class GenerationAborted(PolicyError):
    """The engine aborted a turn's generation (slime ends a rollout step by POSTing SGLang's
    /abort_request to every engine): the trajectory ends aborted, and the partial span is
    never recorded as a turn."""

    def __init__(self, engine_message: str, partial_tokens: int) -> None:
        super().__init__(
            f"the engine aborted the generation ({engine_message}) after {partial_tokens} tokens"
        )
        self.engine_message = engine_message
        self.partial_tokens = partial_tokens


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    """0 is greedy (log-probs then at temperature 1)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    """-1: off."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after sampling one of these (it is kept in the output)."""


class Generation(BaseModel):
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    model_s: float = 0.0
    abort_message: str | None = None
    """The engine's word when finish_reason is 'abort' (SGLang: 'Aborted' for a running
    request ended by /abort_request, 'Abort in waiting queue' for one that never started)."""


class Policy(Protocol):
    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation: ...


class HFPolicy:
    """A local transformers model. Concurrent `generate` calls are decoded together: a
    left-padded batch sharing one KV cache, each row stopping on its own."""

    def __init__(
        self,
        model: Any,
        eos_token_id: int,
        seed: int = 0,
        max_batch_size: int = 32,
        max_wait_s: float = 0.005,
    ) -> None:
        import torch

        self.model = model.eval()
        self.eos_token_id = eos_token_id
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self._lock = threading.Lock()
        self._pending: list[tuple[list[int], SamplingParams, asyncio.Future[Generation]]] = []
        self._worker: asyncio.Task[None] | None = None

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._pending.append((input_ids, params, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        """Decode what is pending, a batch at a time, until nothing is."""
        while self._pending:
            await asyncio.sleep(self.max_wait_s)  # let concurrent callers join the batch
            batch = self._pending[: self.max_batch_size]
            del self._pending[: len(batch)]
            try:
                results = await asyncio.to_thread(self._decode, [(i, p) for i, p, _ in batch])
            except Exception as err:  # every caller of the batch learns of it
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(PolicyError(f"generation failed: {err}"))
                continue
            for (_, _, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)

    def _decode(self, requests: list[tuple[list[int], SamplingParams]]) -> list[Generation]:
        import torch
        from transformers import DynamicCache

        started = time.perf_counter()
        rows = len(requests)
        width = max(len(ids) for ids, _ in requests)
        outputs: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        reasons: list[FinishReason] = ["length"] * rows
        active = [True] * rows
        with self._lock, torch.no_grad():
            device = next(self.model.parameters()).device
            input_ids = torch.zeros((rows, width), dtype=torch.long)
            attention = torch.zeros((rows, width), dtype=torch.long)
            for row, (ids, _) in enumerate(requests):
                input_ids[row, width - len(ids) :] = torch.tensor(ids)
                attention[row, width - len(ids) :] = 1
            cache = DynamicCache(config=self.model.config)
            step_ids = input_ids
            for step in range(max(params.max_new_tokens for _, params in requests)):
                positions = attention.cumsum(-1)[:, -step_ids.shape[1] :] - 1
                logits = (
                    self.model(
                        input_ids=step_ids.to(device),
                        attention_mask=attention.to(device),
                        position_ids=positions.clamp(min=0).to(device),
                        cache=cache,
                        use_cache=True,
                        logits_to_keep=1,
                    )
                    .logits[:, -1]
                    .float()
                )
                next_ids = torch.zeros((rows, 1), dtype=torch.long)
                for row, (_, params) in enumerate(requests):
                    if not active[row]:
                        continue
                    token, logprob = self._sample(logits[row], params)
                    outputs[row].append(token)
                    logprobs[row].append(logprob)
                    next_ids[row, 0] = token
                    if token in {self.eos_token_id, *params.stop_token_ids}:
                        active[row], reasons[row] = False, "stop"
                    elif step + 1 >= params.max_new_tokens:
                        active[row] = False
                if not any(active):
                    break
                step_ids = next_ids
                attention = torch.cat([attention, torch.ones((rows, 1), dtype=torch.long)], 1)
        model_s = time.perf_counter() - started
        return [
            Generation(output_ids=o, logprobs=lp, finish_reason=r, model_s=model_s)
            for o, lp, r in zip(outputs, logprobs, reasons, strict=True)
        ]

    def _sample(self, logits: Any, params: SamplingParams) -> tuple[int, float]:
        import torch

        if params.temperature == 0:
            logprobs = torch.log_softmax(logits, dim=-1)
            token = int(logprobs.argmax())
            return token, float(logprobs[token])
        logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
        sampling = logprobs.clone()
        if params.top_k > 0:
            kth = sampling.topk(min(params.top_k, sampling.numel())).values[-1]
            sampling[sampling < kth] = float("-inf")
        if params.top_p < 1.0:
            ordered, order = sampling.sort(descending=True)
            cumulative = ordered.exp().cumsum(-1)
            drop = cumulative - ordered.exp() >= params.top_p  # keep the token that crosses
            sampling[order[drop]] = float("-inf")
        token = int(torch.multinomial(torch.softmax(sampling, -1), 1, generator=self.generator))
        return token, float(logprobs[token])


class SGLangPolicy:
    """An SGLang server's /generate with input ids; one trajectory routed to one replica
    by its session id (`X-SMG-Routing-Key`)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 600.0,
        max_concurrency: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=url.rstrip("/"),
            timeout=timeout_s,
            limits=httpx.Limits(
                max_connections=max_concurrency, keepalive_expiry=SGLANG_KEEP_ALIVE_S
            ),
            transport=transport,
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        started = time.perf_counter()
        body = {
            "input_ids": input_ids,
            "sampling_params": {
                "max_new_tokens": params.max_new_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
                "stop_token_ids": list(params.stop_token_ids),
                "skip_special_tokens": False,
                "no_stop_trim": True,
            },
            "return_logprob": True,
        }
        headers = {ROUTING_HEADER: routing_key(session_id)} if session_id else {}
        try:
            response = await self._http.post("/generate", json=body, headers=headers)
        except httpx.HTTPError as err:
            raise PolicyError(f"SGLang unreachable: {err}") from err
        if response.status_code != 200:
            raise PolicyError(f"SGLang answered {response.status_code}: {response.text[:500]}")
        payload = response.json()
        payload = payload[0] if isinstance(payload, list) else payload
        meta = payload["meta_info"]
        entries = meta.get("output_token_logprobs") or []
        output_ids = [int(entry[1]) for entry in entries]
        if payload.get("output_ids") is not None and list(payload["output_ids"]) != output_ids:
            raise PolicyError("SGLang's output_ids and output_token_logprobs disagree")
        finish_info = meta.get("finish_reason") or {}
        finish = finish_info.get("type")
        reason: FinishReason = finish if finish in ("stop", "length") else "abort"
        abort_message = None
        if reason == "abort":
            abort_message = str(finish_info.get("message") or f"finish_reason {finish_info!r}")
        return Generation(
            output_ids=output_ids,
            logprobs=[float(e[0]) for e in entries],
            finish_reason=reason,
            model_s=time.perf_counter() - started,
            abort_message=abort_message,
        )
