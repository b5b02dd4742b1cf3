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

ROUTING_HEADER = "X-SMG-Routing-Key"
FinishReason = Literal["stop", "length", "abort"]


class PolicyError(RuntimeError):
    """The generation backend failed (not the model's output): the trajectory aborts."""


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


class Policy(Protocol):
    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation: ...


class HFPolicy:
    """A local transformers model; one generation at a time (the model is shared)."""

    def __init__(self, model: Any, eos_token_id: int, seed: int = 0) -> None:
        import torch

        self.model = model.eval()
        self.eos_token_id = eos_token_id
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self._lock = threading.Lock()

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        return await asyncio.to_thread(self._generate, input_ids, params)

    def _generate(self, input_ids: list[int], params: SamplingParams) -> Generation:
        import torch
        from transformers import DynamicCache

        started = time.perf_counter()
        stop = {self.eos_token_id, *params.stop_token_ids}
        output: list[int] = []
        logprobs: list[float] = []
        reason: FinishReason = "length"
        with self._lock, torch.no_grad():
            device = next(self.model.parameters()).device
            cache = DynamicCache(config=self.model.config)
            step_ids = torch.tensor([input_ids], device=device)
            for _ in range(params.max_new_tokens):
                logits = (
                    self.model(input_ids=step_ids, cache=cache, use_cache=True, logits_to_keep=1)
                    .logits[0, -1]
                    .float()
                )
                token, logprob = self._sample(logits, params)
                output.append(token)
                logprobs.append(logprob)
                if token in stop:
                    reason = "stop"
                    break
                step_ids = torch.tensor([[token]], device=device)
        return Generation(
            output_ids=output,
            logprobs=logprobs,
            finish_reason=reason,
            model_s=time.perf_counter() - started,
        )

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
            limits=httpx.Limits(max_connections=max_concurrency),
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
        headers = {ROUTING_HEADER: session_id[:128]} if session_id else {}
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
        finish = (meta.get("finish_reason") or {}).get("type", "abort")
        reason: FinishReason = finish if finish in ("stop", "length") else "abort"
        return Generation(
            output_ids=output_ids,
            logprobs=[float(e[0]) for e in entries],
            finish_reason=reason,
            model_s=time.perf_counter() - started,
        )
