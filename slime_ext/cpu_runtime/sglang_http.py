"""A stand-in for SGLang's HTTP API, where SGLang cannot run (it needs a CUDA torch): a
TEST AND REHEARSAL AID. Tests serve it in-process (`create_standin`); as an engine of a
whole job it is what `sglang_api.launch_server` serves, with the weight-update routes of
`sglang_engine`. It restates SGLang 0.5.23 (python/sglang/srt/entrypoints/http_server.py,
entrypoints/v1_loads.py, managers/tokenizer_manager.py, managers/scheduler.py,
managers/schedule_batch.py; earlier 0.5 releases answer the same shapes):

- POST /generate, prompt scoring (`max_new_tokens: 0`): `meta_info.input_token_logprobs`
  has one [logprob, token_id, null] triple per id from logprob_start_len on with entry 0's
  logprob null; `input_top_logprobs` has null at entry 0 and k triples elsewhere; prompt
  log-probs are NOT temperature-scaled; `cached_tokens` counts a prefix reused from earlier
  requests, at most logprob_start_len; ids are not range-checked; logprob_start_len past
  the input is a 400 with an "error" object, and so is an input of context_length ids or
  more (TokenizerManager._validate_one_request: `len(input_ids) >= context_len`).
- POST /generate, generation: `output_ids`, and `meta_info.output_token_logprobs` (the
  temperature-scaled log-probs, as SGLang's sampler returns them) only with
  `return_logprob`; `meta_info.id` is the request's `rid` (a fresh uuid hex when absent).
  Requests decode interleaved, one token each in turn (a running batch), with
  `token_delay_s` between a request's tokens; with `max_running_requests` the rest wait
  in a queue.
- POST /abort_request {"abort_all": true} or {"rid": ...}: answers 200 with no body. A
  running request still runs one more decode step (the scheduler sets `to_finish`, which
  the step's finish check reads first), keeps its token, and answers 200 with
  finish_reason {"type": "abort", "message": "Aborted", "status_code": null, "err_type":
  null} and every token produced; a waiting one answers 200 with {"type": "abort",
  "message": "Abort in waiting queue"} and no tokens (earlier releases: "Abort before
  prefill", without output_ids). A rid the server does not know is ignored; a known one
  aborts every request whose rid starts with it (the scheduler's prefix match).
- POST /pause_generation (SGLang's default mode, "abort"): every running and waiting
  request is aborted as by /abort_request, and requests that arrive wait until POST
  /continue_generation. GET or POST /flush_cache: 200 "Cache flushed..." with no request
  running or waiting (the prefix cache is emptied), 400 otherwise (slime retries it).
- GET /v1/loads (the `core` section slime's abort loop polls), /health and
  /health_generate (200, no body), /model_info and /server_info with their deprecated
  /get_* aliases (what the SGLang router reads when it registers a worker: a subset of
  the fields), /v1/models (ModelList).

Test-only: GET /standin/headers (the headers of each /generate; POST
/standin/headers/clear forgets them), and `app.state.standin`
(a `StandinState`: what runs and waits now, for tests in the same process).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from rollout.chat import common_prefix_len

SGLANG_VERSION = "0.5.23"
"""The release whose HTTP API this file restates."""
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
"""FINISH_ABORT().to_json(): a running request ended by /abort_request."""
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}
"""TokenizerManager._handle_abort_req: a queued request ended before it started."""


@dataclass
class GenerateRequest:
    rid: str
    output_ids: list[int] = field(default_factory=list)
    to_abort: bool = False


@dataclass
class StandinState:
    """The stand-in's scheduler: running and waiting /generate requests, by rid."""

    max_running_requests: int | None = None
    running: dict[str, GenerateRequest] = field(default_factory=dict)
    waiting: dict[str, GenerateRequest] = field(default_factory=dict)
    received_headers: list[dict[str, str]] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    paused: bool = False
    prefix_cache: list[list[int]] = field(default_factory=list)
    """Prompts scored so far (what `cached_tokens` counts against; /flush_cache empties)."""
    weight_version: str = "default"
    released: set[str] = field(default_factory=set)
    """Memory released by /release_memory_occupation ("weights", "kv_cache", "cuda_graph")."""

    def tokens_so_far(self) -> dict[str, int]:
        """Tokens each running request has produced (read from another thread)."""
        return {rid: len(request.output_ids) for rid, request in list(self.running.items())}

    async def admit(self, request: GenerateRequest) -> bool:
        """Wait for a running slot; False when the request was aborted while it waited."""
        async with self.changed:
            await self.changed.wait_for(lambda: not self.paused)
            self.waiting[request.rid] = request
            await self.changed.wait_for(lambda: request.to_abort or self._has_slot())
            del self.waiting[request.rid]
            if request.to_abort:
                return False
            self.running[request.rid] = request
            return True

    async def finish(self, request: GenerateRequest) -> None:
        async with self.changed:
            self.running.pop(request.rid, None)
            self.changed.notify_all()

    async def abort(self, rid: str, abort_all: bool) -> None:
        known = rid in self.running or rid in self.waiting
        if not abort_all and not (rid and known):
            return  # TokenizerManager.abort_request: an unknown rid is a no-op
        async with self.changed:
            for request in [*self.running.values(), *self.waiting.values()]:
                if abort_all or request.rid.startswith(rid):
                    request.to_abort = True
            self.changed.notify_all()

    async def unpaused(self) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: not self.paused)

    async def pause(self) -> None:
        """Mode "abort": abort everything in flight, hold what arrives, until resumed."""
        async with self.changed:
            self.paused = True
        await self.abort("", abort_all=True)
        async with self.changed:
            await self.changed.wait_for(lambda: not self.running and not self.waiting)

    async def resume(self) -> None:
        async with self.changed:
            self.paused = False
            self.changed.notify_all()

    def flush(self) -> bool:
        """Empty the prefix cache; False (nothing done) while requests run or wait."""
        if self.running or self.waiting:
            return False
        self.prefix_cache.clear()
        return True

    def _has_slot(self) -> bool:
        limit = self.max_running_requests
        return limit is None or len(self.running) < limit


def create_standin(
    model: Any,
    context_length: int,
    misalign: bool = False,
    *,
    model_path: str = "standin",
    token_delay_s: float = 0.0,
    max_running_requests: int | None = None,
    server_args: dict[str, Any] | None = None,
) -> FastAPI:
    """The stand-in serving `model`; `server_args` (the engine's ServerArgs as a dict) go
    into /server_info as SGLang reports them."""
    app = FastAPI()
    state = StandinState(max_running_requests=max_running_requests)
    app.state.standin = state

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": model_path,
            "served_model_name": model_path,
            "tokenizer_path": model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.weight_version,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {
            **(server_args or {}),
            "model_path": model_path,
            "tokenizer_path": model_path,
            "served_model_name": model_path,
            "context_length": context_length,
            "tp_size": 1,
            "dp_size": 1,
            "max_running_requests": max_running_requests,
            "internal_states": [{}],
            "version": SGLANG_VERSION,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_path,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": model_path,
            "parent": None,
            "max_model_len": context_length,
        }
        return {"object": "list", "data": [card]}

    @app.get("/v1/loads")
    async def loads(include: str | None = None) -> dict[str, Any]:
        core = {
            "dp_rank": 0,
            "num_running_reqs": len(state.running),
            "num_waiting_reqs": len(state.waiting),
            "num_used_tokens": 0,
            "num_total_tokens": 0,
            "max_total_num_tokens": context_length,
            "max_running_requests": max_running_requests or 0,
            "token_usage": 0.0,
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.0,
            "utilization": 0.0,
        }
        return {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": SGLANG_VERSION,
            "accelerator": None,
            "num_accelerators": 1,
            "loads": [core],
        }

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await request.json()
        await state.abort(body.get("rid") or "", bool(body.get("abort_all", False)))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation() -> dict[str, str]:
        await state.pause()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, str]:
        await state.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if state.flush():
            return Response("Cache flushed.\n", status_code=200)
        return Response("Flush cache failed.\n", status_code=400)

    @app.get("/standin/headers")
    async def headers() -> list[dict[str, str]]:
        return state.received_headers

    @app.post("/standin/headers/clear")
    async def clear_headers() -> None:
        state.received_headers.clear()

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        state.received_headers.append(dict(request.headers))
        ids: list[int] = body["input_ids"]
        params = body.get("sampling_params", {})
        if state.released:  # SGLang would touch freed memory: refused here, loudly
            message = (
                f"memory released ({', '.join(sorted(state.released))}): "
                "/resume_memory_occupation before /generate"
            )
            return JSONResponse({"error": {"message": message}}, status_code=503)
        if len(ids) >= context_length:
            message = (
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({context_length} tokens)."
            )
            return JSONResponse({"error": {"message": message}}, status_code=400)
        if params.get("max_new_tokens", 16) > 0:
            running = GenerateRequest(rid=body.get("rid") or uuid.uuid4().hex)
            return_logprob = bool(body.get("return_logprob", False))
            if not await state.admit(running):
                return _aborted_while_waiting(running.rid, return_logprob, state.weight_version)
            try:
                answer = await _generate(model, ids, params, running, return_logprob, token_delay_s)
                answer["meta_info"]["weight_version"] = state.weight_version
                return answer
            finally:
                await state.finish(running)
        start: int = body.get("logprob_start_len", -1)
        top_k: int = body.get("top_logprobs_num", 0) or 0
        if start > len(ids):
            message = (
                f"req.logprob_start_len={start} is higher than the number of input "
                f"tokens len(req.origin_input_ids)={len(ids)}. Please use a smaller "
                "logprob_start_len."
            )
            return JSONResponse({"error": {"message": message}}, status_code=400)
        await state.unpaused()
        cached = max((common_prefix_len(ids, old) for old in state.prefix_cache), default=0)
        cached = min(cached, max(start, 0), len(ids) - 1)
        state.prefix_cache.append(ids)
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
            "weight_version": state.weight_version,
            "input_token_logprobs": token_entries,
            "output_token_logprobs": [],
        }
        if top_k:
            meta["input_top_logprobs"] = top_entries
            meta["output_top_logprobs"] = []
        return {"text": "", "output_ids": [], "meta_info": meta}

    return app


async def _generate(
    model: Any,
    ids: list[int],
    params: dict[str, Any],
    running: GenerateRequest,
    return_logprob: bool,
    token_delay_s: float,
) -> dict[str, Any]:
    """Greedy (temperature 0) or sampled generation, one token per turn of the event loop
    so that other requests and /abort_request run in between."""
    temperature = params.get("temperature", 1.0)
    stop = set(params.get("stop_token_ids") or []) | {model.config.eos_token_id}
    output, entries = running.output_ids, []
    finish: dict[str, Any] = {"type": "length", "length": params["max_new_tokens"]}
    generator = torch.Generator().manual_seed(0)
    for step in range(params["max_new_tokens"]):
        if step:
            await asyncio.sleep(token_delay_s)  # between tokens: an abort may land here
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + output])).logits[0, -1].float()
        scaled = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        token = (
            int(scaled.argmax())
            if temperature == 0
            else int(torch.multinomial(scaled.exp(), 1, generator=generator))
        )
        output.append(token)
        entries.append([float(scaled[token]), token, None])
        if running.to_abort:  # checked before stop and length, as Req.update_finish_state
            finish = dict(ABORTED)
            break
        if token in stop:
            finish = {"type": "stop", "matched": token}
            break
    meta: dict[str, Any] = {
        "id": running.rid,
        "finish_reason": finish,
        "prompt_tokens": len(ids),
        "completion_tokens": len(output),
        "cached_tokens": 0,
    }
    if return_logprob:
        meta["output_token_logprobs"] = entries
    return {"text": "", "output_ids": list(output), "meta_info": meta}


def _aborted_while_waiting(rid: str, return_logprob: bool, weight_version: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": dict(ABORTED_WAITING),
        "weight_version": weight_version,
        "completion_tokens": 0,
    }
    if return_logprob:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = []
    return {"text": "", "output_ids": [], "meta_info": meta}
