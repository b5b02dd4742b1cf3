"""The transformers backend: a local model, micro-batched, with per-session prefix reuse.

Memory is bounded by construction. Stateless items are sorted by length and cut into
forwards of at most `max_batch_tokens` padded ids (rows x longest row, an item longer than
that alone); no row is shorter than its forward's longest over PAD_FACTOR, so padding
adds at most half again the real ids, and whatever mix of lengths and clients arrives
together, no forward holds more than max_batch_tokens ids. Rows are right-padded without
an attention mask: in a causal model no token attends to the positions after it, so each
row computes as it would alone (positions 0, 1, ...) and attention takes its mask-free
causal kernel, whose memory is linear in the ids (a padding mask is rows x longest^2:
one request of 8 items near the max context got a 1.6 GB server OOM-killed). Logits are
computed at span positions only, one item at a time. The default max_batch_tokens is the
max context: a forward then costs at most what one max-context item costs alone. A
request costing more than max_request_tokens (backend.request_tokens: its ids, and its
top-k rows) is refused (413) before it is queued.

Session requests reuse the longest prefix they share with the session's cached ids (a
request need not extend the previous one: think is dropped, hints are inserted), and only
the rest is computed, in chunks of at most SESSION_CHUNK ids (a chunk attends to the
cached prefix through a mask of chunk x prefix, never prefix^2); hybrid models restart
from a recurrent-state snapshot taken at the end of each turn's context. Log-softmax in
fp32 with the temperature applied to the logits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from slime_ext.turns import pack, trunk_then_branches
from slime_ext.vocab_parallel import VocabShard, log_softmax
from teacher_server.api import (
    ReloadResult,
    ScoreItem,
    ScoreResult,
    ServerInfo,
    TrajectoryScoreRequest,
)
from teacher_server.backend import (
    BackendFailure,
    BadScoreRequest,
    admit,
    check_items,
    check_trajectory,
    tokenizer_identity,
    vocab_digest,
)
from teacher_server.metrics import ServerMetrics
from teacher_server.session_cache import (
    SessionCache,
    SessionState,
    SessionTicket,
    rewind,
    snapshot,
)

PAD_FACTOR = 1.5
"""No row of a forward is shorter than its longest row over this: padding adds at most
half again the real ids."""
SESSION_CHUNK = 512
"""Session requests compute their new ids this many at a time: a chunk's attention mask
over the cached prefix is chunk x context, not context^2."""
LOGIT_ELEMENTS = 2**24
"""Logits computed at once at most (64 MiB in fp32): the output layer runs on
LOGIT_ELEMENTS // vocab span positions at a time (SpanScores)."""

Job = TypeVar("Job")


@dataclass(frozen=True)
class ScoreJob:
    """One item as the worker thread scores it; a session item carries the ticket its
    request was admitted with (a DELETE after that admission wins over it)."""

    item: ScoreItem
    ticket: SessionTicket | None = None


def plan_forwards(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices into `lengths`, one list per forward: longest first; a forward's rows x
    longest at most `max_batch_tokens` (an item longer than that goes alone) and no row
    shorter than its longest over PAD_FACTOR."""
    forwards: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        current = forwards[-1] if forwards else None
        if (
            current is not None
            and (len(current) + 1) * lengths[current[0]] <= max_batch_tokens
            and lengths[index] * PAD_FACTOR >= lengths[current[0]]
        ):
            current.append(index)
        else:
            forwards.append([index])
    return forwards


class HFScorer:
    """Synchronous scoring on one model; called from one worker thread at a time."""

    def __init__(
        self,
        model: PreTrainedModel,
        metrics: ServerMetrics,
        cache_budget_bytes: int,
        snapshot_every: int = 512,
        *,
        max_batch_tokens: int,
    ) -> None:
        self.model = model.eval()
        self.metrics = metrics
        self.sessions = SessionCache(cache_budget_bytes)
        self.max_batch_tokens = max_batch_tokens
        """Padded ids (rows x longest) of one stateless forward at most."""
        layer_types = getattr(model.config, "layer_types", None) or []
        self.is_hybrid = "linear_attention" in layer_types
        self.device = next(model.parameters()).device
        self.snapshot_every = snapshot_every
        """Hybrid models: also snapshot every this many tokens, so a request that diverges
        mid-context (a hint inserted) reuses up to the last snapshot before it."""

    def score_batch(self, jobs: list[ScoreJob]) -> list[ScoreResult | Exception]:
        """Results in job order: stateless items in the forwards `plan_forwards` cuts (one
        that fails is retried item by item, so a bad item fails alone), then session items
        one by one."""
        results: list[ScoreResult | Exception | None] = [None] * len(jobs)
        stateless = [i for i, job in enumerate(jobs) if job.item.session_id is None]
        lengths = [len(jobs[i].item.input_ids) for i in stateless]
        for forward in plan_forwards(lengths, self.max_batch_tokens):
            indices = [stateless[position] for position in forward]
            if len(indices) == 1:
                continue
            try:
                batch = self._score_right_padded([jobs[i].item for i in indices])
                for index, result in zip(indices, batch, strict=True):
                    results[index] = result
            except Exception:
                pass
        for index, job in enumerate(jobs):
            if results[index] is not None:
                continue
            try:
                results[index] = (
                    self._score_session(job.item, job.ticket)
                    if job.item.session_id is not None
                    else self._score_right_padded([job.item])[0]
                )
            except Exception as err:
                results[index] = BackendFailure(f"scoring failed: {type(err).__name__}: {err}")
        return [r for r in results if r is not None]

    def _span_scores(self, item: ScoreItem) -> SpanScores:
        head = self.model.get_output_embeddings()
        assert head is not None
        return SpanScores(head, item, max(1, LOGIT_ELEMENTS // self.model.config.vocab_size))

    @torch.no_grad()
    def _score_right_padded(self, items: list[ScoreItem]) -> list[ScoreResult]:
        """One forward of `items`, right-padded to the longest and without an attention
        mask (causal: a row's ids never see the padding after them); the output layer runs
        on each item's span positions only."""
        width = max(len(item.input_ids) for item in items)
        input_ids = torch.zeros((len(items), width), dtype=torch.long)
        for row, item in enumerate(items):
            input_ids[row, : len(item.input_ids)] = torch.tensor(item.input_ids)
        hidden = self.model.get_decoder()(
            input_ids=input_ids.to(self.device), use_cache=False
        ).last_hidden_state
        self.metrics.add_tokens(computed=input_ids.numel())
        results = []
        for row, item in enumerate(items):
            scores = self._span_scores(item)
            scores.add(hidden[row, item.span_start - 1 : len(item.input_ids) - 1])
            results.append(scores.result(cached=0, metrics=self.metrics))
        return results

    @torch.no_grad()
    def score_packed(self, request: TrajectoryScoreRequest) -> list[ScoreResult]:
        """All spans of a trajectory from one tree-packed forward (slime_ext.turns.pack; a
        hybrid teacher's linear-attention layers run each branch from the trunk's state,
        slime_ext.hybrid_tree)."""
        packed = pack(request.trunk_ids, request.turns)
        hidden = trunk_then_branches(self.model, packed)
        rows_all = torch.tensor(packed.span_rows, device=hidden.device)
        self.metrics.add_tokens(computed=len(packed.ids))
        results, offset = [], 0
        for turn in request.turns:
            rows = rows_all[offset : offset + len(turn.span_ids)]
            offset += len(turn.span_ids)
            item = ScoreItem(
                input_ids=[0, *turn.span_ids],
                span_start=1,
                top_k=request.top_k,
                temperature=request.temperature,
            )
            scores = self._span_scores(item)
            scores.add(hidden[rows])
            results.append(scores.result(cached=0, metrics=self.metrics))
        return results

    def _score_session(self, item: ScoreItem, ticket: SessionTicket | None) -> ScoreResult:
        assert item.session_id is not None
        if ticket is not None:
            return self._score_with_ticket(item, ticket)
        ticket = self.sessions.admit(item.session_id)  # a caller without admission
        try:
            return self._score_with_ticket(item, ticket)
        finally:
            self.sessions.release(ticket)

    @torch.no_grad()
    def _score_with_ticket(self, item: ScoreItem, ticket: SessionTicket) -> ScoreResult:
        with self.sessions.checkout(ticket) as lease:
            state = lease.state
            ids = list(item.input_ids)
            reused = state.reuse_length(ids, limit=item.span_start - 1) if state else 0
            if state is None or reused == 0:
                state = SessionState(ids=[], cache=DynamicCache(config=self.model.config))
            else:
                rewind(state.cache, reused, state.snapshots)
                state.snapshots = {p: s for p, s in state.snapshots.items() if p <= reused}
            # The context ends at span_start: the next turn's context extends at least that far.
            snapshot_at = {len(ids)}
            if self.is_hybrid:
                periodic = range(
                    reused + self.snapshot_every - reused % self.snapshot_every,
                    item.span_start,
                    self.snapshot_every,
                )
                snapshot_at = {*periodic, item.span_start, len(ids)}
            chunks = range(reused + SESSION_CHUNK, len(ids), SESSION_CHUNK)
            scores, begin = self._span_scores(item), reused
            decoder = self.model.get_decoder()
            for end in sorted(snapshot_at.union(chunks)):
                hidden = decoder(
                    input_ids=torch.tensor([ids[begin:end]], device=self.device),
                    cache=state.cache,
                    use_cache=True,
                ).last_hidden_state[0]
                self.metrics.add_tokens(computed=end - begin)
                # the rows that predict span tokens: from span_start - 1 to the last id but one
                first, last = max(begin, item.span_start - 1), min(end, len(ids) - 1)
                if first < last:
                    scores.add(hidden[first - begin : last - begin])
                if self.is_hybrid and end in snapshot_at:
                    state.snapshots[end] = snapshot(state.cache)
                begin = end
            state.ids = ids
            result = scores.result(cached=reused, metrics=self.metrics)
            lease.keep(state)
            return result


class SpanScores:
    """A span's log-probs (and top-k rows), from the hidden states that predict its tokens
    (added in order, any number at a time); the output layer and log-softmax run on at
    most `rows` of them at once, so logits never hold more than rows x vocab floats."""

    def __init__(self, head: torch.nn.Module, item: ScoreItem, rows: int) -> None:
        self.head, self.item, self.rows = head, item, rows
        self.targets = item.input_ids[item.span_start :]
        self.logprobs: list[float] = []
        self.top_ids: list[list[int]] = []
        self.top_logprobs: list[list[float]] = []

    def add(self, hidden: Tensor) -> None:
        for start in range(0, len(hidden), self.rows):
            chunk = hidden[start : start + self.rows]
            done = len(self.logprobs)
            targets = torch.tensor(self.targets[done : done + len(chunk)], device=chunk.device)
            logprobs = log_softmax(self.head(chunk), VocabShard(), float(self.item.temperature))
            self.logprobs += logprobs.gather(-1, targets[:, None])[:, 0].tolist()
            if self.item.top_k:
                top = logprobs.topk(self.item.top_k, dim=-1)
                self.top_ids += top.indices.tolist()
                self.top_logprobs += top.values.tolist()

    def result(self, cached: int, metrics: ServerMetrics) -> ScoreResult:
        assert len(self.logprobs) == len(self.targets), "every span position added once"
        metrics.add_tokens(scored=len(self.targets), cached=cached)
        result = ScoreResult(logprobs=self.logprobs, cached_tokens=cached)
        if self.item.top_k:
            result.top_k_ids, result.top_k_logprobs = self.top_ids, self.top_logprobs
        return result


class MicroBatcher(Generic[Job]):
    """Collects concurrently submitted jobs into batches for one worker thread; how a batch
    is cut into forwards is `run_batch`'s business (HFScorer.score_batch)."""

    def __init__(
        self,
        run_batch: Callable[[list[Job]], list[ScoreResult | Exception]],
        max_batch_size: int,
        max_wait_s: float,
        max_queue: int,
    ) -> None:
        self.run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.pending = 0
        self._queue: asyncio.Queue[tuple[Job, asyncio.Future[ScoreResult]]] | None = None
        self._worker: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Bind to the running event loop (a queue belongs to one loop)."""
        self._queue = asyncio.Queue()
        self._worker = asyncio.get_running_loop().create_task(self._run(self._queue))

    async def stop(self) -> None:
        queue, self._queue = self._queue, None
        if self._worker:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        self.pending = 0
        while queue is not None and not queue.empty():
            _, future = queue.get_nowait()
            if not future.done():
                future.set_exception(BackendFailure("the teacher is shutting down"))

    async def submit(self, jobs: list[Job]) -> list[ScoreResult]:
        if self._queue is None:
            raise BackendFailure("the scoring worker is not running")
        admit(self.pending, len(jobs), self.max_queue)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in jobs]
        self.pending += len(jobs)
        for job, future in zip(jobs, futures, strict=True):
            self._queue.put_nowait((job, future))
        # counted until the worker is done with them: a cancelled request's jobs stay in
        # the queue, and in the bound, until it drops them
        return list(await asyncio.gather(*futures))

    async def _run(self, queue: asyncio.Queue[tuple[Job, asyncio.Future[ScoreResult]]]) -> None:
        while True:
            batch = [await queue.get()]
            deadline = time.monotonic() + self.max_wait_s
            while len(batch) < self.max_batch_size:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(queue.get(), timeout))
                except asyncio.TimeoutError:
                    break
            live = [(job, future) for job, future in batch if not future.done()]
            try:
                results = await asyncio.to_thread(self.run_batch, [job for job, _ in live])
            except Exception as err:
                results = [BackendFailure(f"batch failed: {err}")] * len(live)
            finally:  # queued or computed until now, whether their requests are there or not
                self.pending -= len(batch)
            for (_, future), result in zip(live, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)


def _one_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="opd-teacher-trajectory")


class LimitsError(ValueError):
    """Limits that contradict each other (the message says which to change)."""


class HFBackend:
    """`max_batch_tokens`: padded ids of one forward at most (default: the max context);
    `max_request_tokens`: the tokens of one request at most (backend.request_tokens), more
    is 413 (default: max_batch_size items of the max context, what the default body limit
    holds)."""

    def __init__(
        self,
        model_dir: str | Path,
        metrics: ServerMetrics,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_context: int | None = None,
        max_top_k: int = 100,
        max_batch_size: int = 32,
        max_batch_tokens: int | None = None,
        max_request_tokens: int | None = None,
        max_wait_ms: float = 5.0,
        max_queue: int = 1024,
        cache_budget_mb: float = 1024.0,
        snapshot_every: int = 512,
    ) -> None:
        self.model_dir = str(model_dir)
        self.device, self.dtype = device, dtype
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = self._load(model_dir)
        config_context = getattr(model.config, "max_position_embeddings", None) or 4096
        context = min(max_context or config_context, config_context)
        batch_tokens = max_batch_tokens or context
        request_tokens = max_request_tokens or context * max_batch_size
        for name, value in (
            ("max_batch_tokens", batch_tokens),
            ("max_request_tokens", request_tokens),
        ):
            if value < context:
                raise LimitsError(
                    f"{name} ({value}) is under the max context ({context}): one item of the "
                    f"max context would not fit; raise {name} or lower max_context"
                )
        self.scorer = HFScorer(
            model,
            metrics,
            int(cache_budget_mb * 2**20),
            snapshot_every,
            max_batch_tokens=batch_tokens,
        )
        self._info = ServerInfo(
            model=self.model_dir,
            tokenizer=tokenizer_identity(tokenizer),
            vocab_size=min(len(tokenizer), model.config.vocab_size),
            max_context=context,
            backend="hf",
            max_top_k=max_top_k,
            max_batch_size=max_batch_size,
            max_request_tokens=request_tokens,
        )
        self.batcher: MicroBatcher[ScoreJob] = MicroBatcher(
            self.scorer.score_batch, max_batch_size, max_wait_ms / 1000.0, max_queue
        )
        self._trajectories = _one_thread()

    def info(self) -> ServerInfo:
        return self._info

    def _load(self, model_dir: str | Path) -> PreTrainedModel:
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, self.dtype)
        )
        torch.nn.Module.to(model, torch.device(self.device))
        return model.eval()

    async def reload(self, model_dir: str) -> ReloadResult:
        try:
            identity = tokenizer_identity(AutoTokenizer.from_pretrained(model_dir))
            if vocab_digest(identity) != vocab_digest(self._info.tokenizer):
                raise BadScoreRequest(
                    f"{model_dir} has another tokenizer ({identity}) than the served model "
                    f"({self._info.tokenizer}): the teacher would score other tokens"
                )
            model = await asyncio.to_thread(self._load, model_dir)
        except (OSError, ValueError) as err:
            if isinstance(err, BadScoreRequest):
                raise
            raise BadScoreRequest(f"cannot load {model_dir}: {err}") from err
        # meant between training steps: a session request in flight during the swap may
        # finish on the old weights (it stores nothing: the clear wins over it)
        self.scorer.model = model
        dropped = self.scorer.sessions.clear()
        self.model_dir = str(model_dir)
        self._info = self._info.model_copy(update={"model": self.model_dir})
        return ReloadResult(model=self.model_dir, sessions_dropped=dropped)

    async def start(self) -> None:
        self.batcher.start()
        self._trajectories = _one_thread()  # a stopped backend may start again

    async def stop(self) -> None:
        await self.batcher.stop()
        self._trajectories.shutdown(wait=False, cancel_futures=True)

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        check_items(items, self._info)
        sessions = self.scorer.sessions
        # admitted here, not when the worker gets to them: a DELETE while they wait in the
        # queue wins over them too
        jobs = [
            ScoreJob(item, None if item.session_id is None else sessions.admit(item.session_id))
            for item in items
        ]
        try:
            return await self.batcher.submit(jobs)
        finally:
            for job in jobs:
                if job.ticket is not None:
                    sessions.release(job.ticket)

    async def drop_session(self, session_id: str) -> bool:
        return self.scorer.sessions.drop(session_id)

    async def score_trajectory(self, request: TrajectoryScoreRequest) -> list[ScoreResult]:
        check_trajectory(request, self._info)
        # read-only inference: safe beside the batcher's worker thread. One at a time in
        # its own thread: a forward cannot be stopped once started, so requests whose
        # clients left leave at most one running, and those still queued never start
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._trajectories, self.scorer.score_packed, request)

    def metrics_text(self) -> str:
        sessions = self.scorer.sessions
        return (
            "\n".join(
                [
                    "# TYPE opd_teacher_queue_depth gauge",
                    f"opd_teacher_queue_depth {self.batcher.pending}",
                    "# TYPE opd_teacher_sessions gauge",
                    f"opd_teacher_sessions {len(sessions)}",
                    "# TYPE opd_teacher_sessions_in_flight gauge",
                    f"opd_teacher_sessions_in_flight {sessions.in_flight}",
                    "# TYPE opd_teacher_cache_bytes gauge",
                    f"opd_teacher_cache_bytes {sessions.total_bytes}",
                    "# TYPE opd_teacher_cache_budget_bytes gauge",
                    f"opd_teacher_cache_budget_bytes {sessions.budget_bytes}",
                    "# TYPE opd_teacher_cache_evictions_total counter",
                    f"opd_teacher_cache_evictions_total {sessions.evictions}",
                ]
            )
            + "\n"
        )
