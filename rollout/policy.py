"""Generation backends: token ids in; sampled ids, their log-probs and a finish reason out.

Log-probs are those of the temperature-scaled, untruncated distribution (what SGLang
returns by default). They are the sampler's own only when top_p is 1 and top_k is off:
OPD's sampled reverse KL is on-policy only then (REFERENCE.md), so OPD rollouts keep the
defaults here unless the recipe computes student log-probs under the same truncation.

Reproducibility: a request that names its random stream (`SamplingParams.sampling_key`;
the Runner derives one from the task, the sample index and the turn) draws from a stream
seeded by (the policy's seed, that key) alone, so what it samples does not depend on which
requests arrived with it or in what order. HFPolicy also decodes such requests with
shapes of their own by default (`batch_invariant`): on CPU, a row's logits change in their
last bits with the number of rows beside it in a forward, and those bits decide a sampled
token now and then; once one token differs, the trajectory and the run diverge.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field

from rollout.prefixes import DEFAULT_MAX_BYTES, Prefix, PrefixStore, full_attention_only
from teacher_server.api import ROUTING_HEADER, SGLANG_KEEP_ALIVE_S, routing_key

FinishReason = Literal["stop", "length", "abort"]
SGLANG_MAX_SEED = 2**31 - 1
"""SGLang's sampling_seed stays below this (some releases hold it as int32)."""


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
    sampling_key: str | None = None
    """Names this request's random stream: with the policy's seed it seeds the request's
    own generator (HFPolicy) or SGLang's per-request `sampling_seed`, so the same key
    samples the same tokens from the same logits whatever else is being generated. None:
    the next seed of the policy's shared stream, which depends on the order of calls."""


def request_seed(seed: int, sampling_key: str) -> int:
    """The seed of the stream `sampling_key` names under the run seed `seed` (63 bits)."""
    digest = hashlib.blake2b(f"{seed}\x00{sampling_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


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


@dataclass(frozen=True)
class GenerationRequest:
    """One turn's generation: its context ids and sampling parameters."""

    input_ids: list[int]
    params: SamplingParams
    session_id: str | None = None
    """The trajectory's id (a backend may route or cache by it)."""


class BatchPolicy(Protocol):
    """A policy that decodes a batch the caller composed (rollout/rounds.py)."""

    async def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """The requests decoded together, their rows in order; a failure fails them all."""
        ...


class HFPolicy:
    """A local transformers model decoding what is pending in worker threads.

    batch_invariant (default): each request is decoded alone, in shapes of its own, so its
    log-probs (and, with a sampling key, its tokens) are bit for bit the same whatever else
    was pending, on an idle or a loaded machine; `decode_threads` requests at a time, each
    in a thread of its own (a small model's forward is mostly Python: a second thread keeps
    a second core busy). False: requests that arrive within max_wait_s of each other are
    decoded together, one batch at a time (left-padded, sharing one KV cache, each row
    stopping on its own): about twice the tokens per second on `opd demo`'s rollouts
    (bench/policy_batching.py), but a row's logits then depend on its batch mates in their
    last bits, and so, now and then, does a sampled token. `generate_batch`: a batch the
    caller composed, decoded together whatever is pending: rollout/rounds.py composes it
    by the schedule, so the speed of batches comes without the dependence on timing
    (bench/policy_batching.py: all three).

    A batch decodes into key/value buffers allocated once (`_decode_cache`), and a row
    that finished leaves the batch's forwards (`drop_finished`; its prefix kept first):
    which rows a forward holds then follows from the rows' own tokens, so it is as
    reproducible as the batch. Dropping rows changes the shapes that compute the others,
    so their log-probs in their last bits against feeding finished rows padding to the
    end (`opd demo`'s summary.json came out the same: bench/demo_stages.py).

    A sampled request draws from a generator of its own: seeded by (seed, its
    sampling_key), or, without a key, by the next draw from `generator`, the policy's
    shared stream (call order; its state is what a checkpoint saves). Greedy requests
    (temperature 0) take the argmax and draw nothing."""

    def __init__(
        self,
        model: Any,
        eos_token_id: int,
        seed: int = 0,
        max_batch_size: int = 32,
        max_wait_s: float = 0.005,
        batch_invariant: bool = True,
        decode_threads: int = 2,
        prefix_cache_bytes: int = DEFAULT_MAX_BYTES,
        drop_finished: bool = True,
    ) -> None:
        import torch

        if decode_threads < 1:
            raise ValueError(f"decode_threads must be at least 1, not {decode_threads}")
        self.model = model.eval()
        self.eos_token_id = eos_token_id
        self.seed = seed
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.batch_invariant = batch_invariant
        self.decode_threads = decode_threads if batch_invariant else 1
        self._pending: list[_Request] = []
        self._workers: list[asyncio.Task[None]] = []
        self.drop_finished = drop_finished
        """A row that finished leaves the batch's forwards (False: it is fed padding to
        the end, as until 2026-12-07)."""
        self.prefixes = PrefixStore(prefix_cache_bytes)
        """Each trajectory's keys and values, for its next turn (rollout/prefixes.py)."""
        self._reuse = full_attention_only(model)
        self.context_tokens = Counter[str]()
        """Contexts' tokens: "reused" from a session's prefix, "encoded" by a forward."""

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        request = _Request(input_ids, params, self._stream(params), future, session_id)
        self._pending.append(request)
        self._workers = [worker for worker in self._workers if not worker.done()]
        if len(self._workers) < self.decode_threads:
            self._workers.append(asyncio.get_running_loop().create_task(self._drain()))
        return await future

    async def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """`requests` decoded together, max_batch_size rows at a time in their order (one
        left-padded forward per token, each row stopping on its own): the batch the
        caller composed, whatever else is pending (rollout/rounds.py fixes it by the
        schedule, so its rows' last bits are too)."""
        rows = [
            _Request(r.input_ids, r.params, self._stream(r.params), None, r.session_id)
            for r in requests
        ]
        results: list[Generation] = []
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            try:
                results += await asyncio.to_thread(self._decode, chunk)
            except Exception as err:
                raise PolicyError(f"generation failed: {err}") from err
        return results

    def end_session(self, session_id: str) -> None:
        """The trajectory ended: forget its prefix."""
        self.prefixes.drop(session_id)

    def _reusable(self, request: _Request) -> tuple[int, Prefix | None]:
        if not self._reuse:
            return 0, None
        return self.prefixes.reusable(request.session_id, request.input_ids)

    def _keep_prefixes(
        self, rows: list[tuple[_Request, list[int], int]], cache: Any, width: int
    ) -> None:
        """Each session's keys and values of what the batch's forwards saw: its context
        and every generated token fed back (all but the last), cut out of its row of
        `cache` (rows: request, its output, its row in the cache)."""
        if self.prefixes.max_bytes == 0 or not self._reuse:
            return
        for request, output, row in rows:
            if request.session_id is None:
                continue
            ids = (*request.input_ids, *output[:-1])
            start = width - len(request.input_ids)
            layers = tuple(
                (
                    layer.keys[row : row + 1, :, start : start + len(ids)].clone(),
                    layer.values[row : row + 1, :, start : start + len(ids)].clone(),
                )
                for layer in cache.layers
            )
            self.prefixes.put(request.session_id, Prefix(ids, layers))

    def _stream(self, params: SamplingParams) -> Any:
        """The generator a request samples from (None for greedy), fixed when it arrives."""
        import torch

        if params.temperature == 0:
            return None
        if params.sampling_key is not None:
            seed = request_seed(self.seed, params.sampling_key)
        else:
            seed = int(torch.randint(0, 2**63 - 1, (1,), generator=self.generator))
        return torch.Generator(device="cpu").manual_seed(seed)

    async def _drain(self) -> None:
        """Decode what is pending, a batch (or, batch-invariant, a request) at a time,
        until nothing is."""
        while self._pending:
            if self.batch_invariant:
                batch = self._pending[:1]
            else:
                await asyncio.sleep(self.max_wait_s)  # let concurrent callers join the batch
                batch = self._pending[: self.max_batch_size]
            del self._pending[: len(batch)]
            try:
                results = await asyncio.to_thread(self._decode, batch)
            except Exception as err:  # every caller of the batch learns of it
                for request in batch:
                    if request.future is not None and not request.future.done():
                        request.future.set_exception(PolicyError(f"generation failed: {err}"))
                continue
            for request, result in zip(batch, results, strict=True):
                if request.future is not None and not request.future.done():
                    request.future.set_result(result)

    def _decode(self, requests: list[_Request]) -> list[Generation]:
        import torch

        started = time.perf_counter()
        rows = len(requests)
        width = max(len(request.input_ids) for request in requests)
        outputs: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        reasons: list[FinishReason] = ["length"] * rows
        active = [True] * rows
        reused = [self._reusable(request) for request in requests]
        for request, (n, _) in zip(requests, reused, strict=True):
            self.context_tokens["reused"] += n
            self.context_tokens["encoded"] += len(request.input_ids) - n
        # the batch feeds each row's tokens past its reused prefix, right-aligned; a row
        # that reused less is fed some of its held tokens again (fed: the widest tail)
        fed = max(len(r.input_ids) - n for r, (n, _) in zip(requests, reused, strict=True))
        with torch.no_grad():
            device = next(self.model.parameters()).device
            input_ids = torch.zeros((rows, fed), dtype=torch.long)
            attention = torch.zeros((rows, width), dtype=torch.long)
            for row, request in enumerate(requests):
                ids = request.input_ids[-fed:]
                input_ids[row, fed - len(ids) :] = torch.tensor(ids)
                attention[row, width - len(request.input_ids) :] = 1
            longest = max(request.params.max_new_tokens for request in requests)
            # every column the batch can hold: its widest context and every new token
            cache = _decode_cache(self.model.config, width + longest)
            if fed < width:
                _seed_cache(cache, requests, reused, fed, width - fed, device)
            step_ids = input_ids
            live = list(range(rows))  # the requests the forward's rows are, in order
            compact = self.drop_finished and _compactable(cache)
            for step in range(longest):
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
                next_ids = torch.zeros((len(live), 1), dtype=torch.long)
                for i, row in enumerate(live):
                    if not active[row]:
                        continue
                    params = requests[row].params
                    token, logprob = _sample(logits[i].cpu(), params, requests[row].generator)
                    outputs[row].append(token)
                    logprobs[row].append(logprob)
                    next_ids[i, 0] = token
                    if token in {self.eos_token_id, *params.stop_token_ids}:
                        active[row], reasons[row] = False, "stop"
                    elif step + 1 >= params.max_new_tokens:
                        active[row] = False
                if not any(active):
                    break
                if compact and not all(active[row] for row in live):
                    # rows that finished leave the batch (their prefixes kept first): which
                    # do, and when, follows from the rows' own tokens, so the shapes that
                    # compute a row stay a function of the batch the caller composed
                    self._keep_prefixes(
                        [(requests[row], outputs[row], i) for i, row in enumerate(live)
                         if not active[row]], cache, width,
                    )  # fmt: skip
                    kept = [i for i, row in enumerate(live) if active[row]]
                    index = torch.tensor(kept)
                    on_device = index.to(device)
                    for layer in cache.layers:
                        layer.select_rows(on_device)
                    attention, next_ids = attention[index], next_ids[index]
                    live = [live[i] for i in kept]
                step_ids = next_ids
                attention = torch.cat([attention, torch.ones((len(live), 1), dtype=torch.long)], 1)
        self._keep_prefixes(
            [(requests[row], outputs[row], i) for i, row in enumerate(live)], cache, width
        )
        model_s = time.perf_counter() - started
        return [
            Generation(output_ids=o, logprobs=lp, finish_reason=r, model_s=model_s)
            for o, lp, r in zip(outputs, logprobs, reasons, strict=True)
        ]


def _compactable(cache: Any) -> bool:
    """Whether rows can leave `cache` mid-decode: every layer is a preallocated one."""
    layer_class = _preallocated_layer()
    return all(isinstance(layer, layer_class) for layer in cache.layers)


def _decode_cache(config: Any, capacity: int) -> Any:
    """A key/value cache for one batch's decoding: transformers' DynamicCache, but each
    plain full-attention layer writes a step's keys and values into buffers of `capacity`
    columns, allocated once, instead of concatenating its whole cache every step (a copy
    of everything so far, per layer and token: a quarter of the bundled student's decode
    time). What the layer hands attention is the filled columns, a view with the shape,
    values and inner strides the concatenation gave, so the logits are bit for bit
    those of DynamicCache (tests/test_policy.py). Its memory is what DynamicCache holds
    at the batch's end (without the concatenation's second copy). Rows leave it with
    `select_rows` (finished ones, `HFPolicy.drop_finished`). Other layer kinds are kept as
    they are, and a cache holding one keeps every row."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    layer_class = _preallocated_layer()
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[index] = layer_class(capacity)
    return cache


@functools.cache
def _preallocated_layer() -> type:
    """The DynamicLayer that fills preallocated buffers (built on first use: transformers
    is imported only by the local policy)."""
    import torch
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity
            self.filled = 0
            self._keys: Any = None
            self._values: Any = None

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.filled + key_states.shape[-2]
            if self.filled == 0:
                self._grow(key_states, value_states, max(end, self.capacity))
            elif end > self._keys.shape[-2]:  # past capacity: doubled, not a column a step
                self._grow(key_states, value_states, max(end, 2 * self._keys.shape[-2]))
            self._keys[..., self.filled : end, :] = key_states
            self._values[..., self.filled : end, :] = value_states
            self.filled = end
            self.keys = self._keys[..., :end, :]
            self.values = self._values[..., :end, :]
            return self.keys, self.values

        def select_rows(self, index: Any) -> None:
            """Keep the batch rows `index` names, in its order (the filled columns)."""

            def pick(buffer: Any) -> Any:
                picked = torch.empty(
                    (len(index), *buffer.shape[1:]), dtype=buffer.dtype, device=buffer.device
                )
                picked[..., : self.filled, :] = buffer[index, ..., : self.filled, :]
                return picked

            self._keys, self._values = pick(self._keys), pick(self._values)
            self.keys = self._keys[..., : self.filled, :]
            self.values = self._values[..., : self.filled, :]

        def _grow(self, key_states: Any, value_states: Any, columns: int) -> None:
            def buffer(held: Any, like: Any) -> Any:
                shape = (*like.shape[:-2], columns, like.shape[-1])
                grown = torch.empty(shape, dtype=like.dtype, device=like.device)
                grown[..., : self.filled, :] = held[..., : self.filled, :]
                return grown

            held_keys = self._keys if self.filled else key_states
            held_values = self._values if self.filled else value_states
            self._keys = buffer(held_keys, key_states)
            self._values = buffer(held_values, value_states)

    return PreallocatedLayer


def _seed_cache(
    cache: Any, requests: list[_Request], reused: list[tuple[int, Prefix | None]], fed: int,
    held: int, device: Any,
) -> None:  # fmt: skip
    """`cache` holding the `held` columns before the fed tail: each row's tokens before
    its last `fed` (all within its reused prefix), right-aligned; zeros on the left of a
    row with fewer (masked, as left padding is)."""
    import torch

    template = next(prefix for _, prefix in reused if prefix is not None)
    for layer, (keys, _) in enumerate(template.layers):
        shape = (len(requests), keys.shape[1], held, keys.shape[3])
        layer_keys = torch.zeros(shape, dtype=keys.dtype, device=device)
        layer_values = torch.zeros(shape, dtype=keys.dtype, device=device)
        for row, (request, (_, prefix)) in enumerate(zip(requests, reused, strict=True)):
            mine = len(request.input_ids) - fed
            if prefix is None or mine <= 0:
                continue
            layer_keys[row, :, held - mine :] = prefix.layers[layer][0][0, :, :mine]
            layer_values[row, :, held - mine :] = prefix.layers[layer][1][0, :, :mine]
        cache.update(layer_keys, layer_values, layer)


@dataclass
class _Request:
    input_ids: list[int]
    params: SamplingParams
    generator: Any
    """Its own torch.Generator (None: greedy)."""
    future: asyncio.Future[Generation] | None
    """Where its caller waits (None: a batch its caller composed, generate_batch)."""
    session_id: str | None = None
    """Its trajectory: the prefix its last generation left is reused (rollout/prefixes.py)."""


def _sample(logits: Any, params: SamplingParams, generator: Any) -> tuple[int, float]:
    """One token from one row of logits: the argmax at temperature 0, else a draw from
    `generator` under top-k / top-p; and its log-prob at the temperature, untruncated."""
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
    token = int(torch.multinomial(torch.softmax(sampling, -1), 1, generator=generator))
    return token, float(logprobs[token])


class SGLangPolicy:
    """An SGLang server's /generate with input ids; one trajectory routed to one replica
    by its session id (`X-SMG-Routing-Key`). A request with a sampling key is sent with
    SGLang's per-request `sampling_seed` (from `seed` and the key), which a server started
    with --enable-deterministic-inference honours (batch-invariant kernels, seeded
    sampling) and any other ignores."""

    def __init__(
        self,
        url: str,
        *,
        seed: int = 0,
        timeout_s: float = 600.0,
        max_concurrency: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.seed = seed
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
        sampling: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "stop_token_ids": list(params.stop_token_ids),
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if params.sampling_key is not None and params.temperature > 0:
            sampling["sampling_seed"] = (
                request_seed(self.seed, params.sampling_key) % SGLANG_MAX_SEED
            )
        body = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True}
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
