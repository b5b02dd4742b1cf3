"""A stand-in for SGLang's /generate scoring API, for tests where SGLang cannot run (it
needs a CUDA torch). It mirrors SGLang 0.5's documented behaviour for prompt scoring:
`meta_info.input_token_logprobs` has one [logprob, token_id, null] triple per id from
logprob_start_len on with entry 0's logprob null; `input_top_logprobs` has null at entry
0 and k triples elsewhere; prompt log-probs are NOT temperature-scaled; `cached_tokens`
counts a prefix reused from earlier requests, at most logprob_start_len; ids are not
range-checked; logprob_start_len past the input is a 400 with an "error" object.
"""

from __future__ import annotations

from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollout.chat import common_prefix_len


def create_standin(model: Any, context_length: int, misalign: bool = False) -> FastAPI:
    app = FastAPI()
    seen: list[list[int]] = []
    received_headers: list[dict[str, str]] = []

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "standin", "max_model_len": context_length}]}

    @app.get("/standin/headers")
    async def headers() -> list[dict[str, str]]:
        return received_headers

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        received_headers.append(dict(request.headers))
        ids: list[int] = body["input_ids"]
        params = body.get("sampling_params", {})
        if params.get("max_new_tokens", 16) > 0:
            return _generate(model, ids, params)
        start: int = body.get("logprob_start_len", -1)
        top_k: int = body.get("top_logprobs_num", 0) or 0
        if start > len(ids):
            message = (
                f"req.logprob_start_len={start} is higher than the number of input "
                f"tokens len(req.origin_input_ids)={len(ids)}. Please use a smaller "
                "logprob_start_len."
            )
            return JSONResponse({"error": {"message": message}}, status_code=400)
        cached = max((common_prefix_len(ids, old) for old in seen), default=0)
        cached = min(cached, max(start, 0), len(ids) - 1)
        seen.append(ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)  # prompt log-probs: no temperature
        token_entries: list[list[Any]] = [[None, ids[start], None]]
        top_entries: list[Any] = [None]
        for position in range(start + 1, len(ids)):
            row = logprobs[position - 1]
            token = ids[position] + (1 if misalign else 0)
            token_entries.append([float(row[ids[position]]), token, None])
            if top_k:
                top = row.topk(top_k)
                top_entries.append(
                    [[float(v), int(i), None] for v, i in zip(top.values, top.indices, strict=True)]
                )
        meta: dict[str, Any] = {
            "id": "standin",
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": len(ids),
            "completion_tokens": 0,
            "cached_tokens": cached,
            "input_token_logprobs": token_entries,
            "output_token_logprobs": [],
        }
        if top_k:
            meta["input_top_logprobs"] = top_entries
            meta["output_top_logprobs"] = []
        return {"text": "", "output_ids": [], "meta_info": meta}

    return app


def _generate(model: Any, ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
    """Greedy (temperature 0) or sampled generation; output log-probs are
    temperature-scaled, as SGLang's sampler returns them."""
    temperature = params.get("temperature", 1.0)
    stop = set(params.get("stop_token_ids") or []) | {model.config.eos_token_id}
    output, entries = [], []
    finish: dict[str, Any] = {"type": "length", "length": params["max_new_tokens"]}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(params["max_new_tokens"]):
            logits = model(input_ids=torch.tensor([ids + output])).logits[0, -1].float()
            scaled = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
            token = (
                int(scaled.argmax())
                if temperature == 0
                else int(torch.multinomial(scaled.exp(), 1, generator=generator))
            )
            output.append(token)
            entries.append([float(scaled[token]), token, None])
            if token in stop:
                finish = {"type": "stop", "matched": token}
                break
    meta = {
        "id": "standin",
        "finish_reason": finish,
        "prompt_tokens": len(ids),
        "completion_tokens": len(output),
        "cached_tokens": 0,
        "output_token_logprobs": entries,
    }
    return {"text": "", "output_ids": output, "meta_info": meta}
