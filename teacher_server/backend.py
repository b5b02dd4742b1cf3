"""What a scoring backend provides, and the checks every backend shares."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol

from teacher_server.api import (
    ReloadResult,
    ScoreItem,
    ScoreRequest,
    ScoreResult,
    ServerInfo,
    TrajectoryScoreRequest,
)


class BadScoreRequest(ValueError):
    """A request the backend cannot score as asked; the message names the field (HTTP 400)."""


class RequestTooLarge(ValueError):
    """A request over a per-request bound: no retry can succeed (HTTP 413); the message
    names the bound."""


class TooManyItems(RequestTooLarge):
    """More items in one request than the queue ever holds."""


class TooManyTokens(RequestTooLarge):
    """A request that costs more tokens (request_tokens) than the server accepts in one."""


class Overloaded(RuntimeError):
    """The queue is over its bound (HTTP 503 with Retry-After)."""


class BackendFailure(RuntimeError):
    """The backend itself failed (model error, upstream server down): HTTP 502/500."""


class ScoringBackend(Protocol):
    def info(self) -> ServerInfo: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        """Results in request order; raises BadScoreRequest, RequestTooLarge, Overloaded or
        BackendFailure."""
        ...

    async def score_trajectory(self, request: TrajectoryScoreRequest) -> list[ScoreResult]:
        """Every turn's span in one tree-packed forward; raises BadScoreRequest when the
        backend or model cannot (then score per turn with sessions)."""
        ...

    async def drop_session(self, session_id: str) -> bool: ...

    async def reload(self, model_dir: str) -> ReloadResult:
        """Serve the weights in `model_dir` from now on; raises BadScoreRequest when they
        cannot replace the current ones (another tokenizer, unreadable)."""
        ...

    def metrics_text(self) -> str:
        """Backend-specific Prometheus lines (queue depth, cache, tokens computed)."""
        ...


def admit(pending: int, count: int, max_queue: int) -> None:
    """Refuses `count` new items: for good (TooManyItems) when the queue could never hold
    them, for now (Overloaded) when it cannot while `pending` are queued."""
    if count > max_queue:
        raise TooManyItems(
            f"requests: {count} items in one request, at most {max_queue} are accepted; "
            "split it into several requests"
        )
    if pending + count > max_queue:
        raise Overloaded(f"{pending} items queued (bound {max_queue}); retry later")


def item_tokens(item: ScoreItem) -> int:
    """What one item costs the server: its ids once, and each scored position top_k more
    times (the top-k ids and log-probs it answers with)."""
    span = max(0, len(item.input_ids) - item.span_start)  # past the end: a 400 later
    return len(item.input_ids) + span * item.top_k


def request_tokens(body: object) -> int:
    """The cost of a request body in tokens (item_tokens summed; a trajectory: its trunk,
    suffixes and spans once and each span position top_k more times); 0 for bodies that
    neither carry nor answer ids."""
    if isinstance(body, ScoreRequest):
        return sum(item_tokens(item) for item in body.requests)
    if isinstance(body, TrajectoryScoreRequest):
        spans = sum(len(turn.span_ids) for turn in body.turns)
        suffixes = sum(len(turn.context_suffix_ids) for turn in body.turns)
        return len(body.trunk_ids) + suffixes + spans * (1 + body.top_k)
    return 0


def check_request_tokens(total: int, info: ServerInfo) -> None:
    """TooManyTokens when a request costing `total` is over the server's max_request_tokens."""
    if info.max_request_tokens is not None and total > info.max_request_tokens:
        raise TooManyTokens(
            f"request: costs {total} tokens (every input id once, every scored position "
            f"top_k more times), at most {info.max_request_tokens} are accepted (the "
            "server's max_request_tokens); split it into several requests or ask a smaller "
            "top_k"
        )


def check_items(items: list[ScoreItem], info: ServerInfo) -> None:
    """The limits every backend enforces, before anything is queued."""
    check_request_tokens(sum(item_tokens(item) for item in items), info)
    for index, item in enumerate(items):
        where = f"requests[{index}]"
        length = len(item.input_ids)
        if item.span_start >= length:
            raise BadScoreRequest(
                f"{where}.span_start: {item.span_start} leaves no token to score "
                f"(input_ids has {length}; span_start must be at most {length - 1})"
            )
        if length > info.max_context:
            raise BadScoreRequest(
                f"{where}.input_ids: {length} ids exceed the max context of {info.max_context}"
            )
        if item.top_k > info.max_top_k:
            raise BadScoreRequest(f"{where}.top_k: {item.top_k} is over the limit {info.max_top_k}")
        for position, token in enumerate(item.input_ids):
            if token >= info.vocab_size:
                raise BadScoreRequest(
                    f"{where}.input_ids[{position}]: id {token} is outside the vocabulary "
                    f"(size {info.vocab_size})"
                )


def check_trajectory(request: TrajectoryScoreRequest, info: ServerInfo) -> None:
    """Whole-trajectory requests: contexts inside the trunk and growing, ids in range, and
    the packed sequence within the max context."""
    check_request_tokens(request_tokens(request), info)
    trunk = len(request.trunk_ids)
    previous = 0
    packed = trunk
    if request.top_k > info.max_top_k:
        raise BadScoreRequest(f"top_k: {request.top_k} is over the limit {info.max_top_k}")
    for index, turn in enumerate(request.turns):
        where = f"turns[{index}]"
        if turn.context_len > trunk:
            raise BadScoreRequest(
                f"{where}.context_len: {turn.context_len} is past the trunk ({trunk} ids)"
            )
        total = turn.context_len + len(turn.context_suffix_ids)
        if total < 1 or total <= previous:
            raise BadScoreRequest(
                f"{where}: its context ({total} ids) must be non-empty and longer than the "
                f"previous turn's ({previous})"
            )
        previous = total
        packed += len(turn.context_suffix_ids) + len(turn.span_ids)
        ids = [*turn.context_suffix_ids, *turn.span_ids]
        if any(token >= info.vocab_size for token in ids):
            raise BadScoreRequest(f"{where}: an id is outside the vocabulary ({info.vocab_size})")
    if any(token >= info.vocab_size for token in request.trunk_ids):
        raise BadScoreRequest(f"trunk_ids: an id is outside the vocabulary ({info.vocab_size})")
    if packed > info.max_context:
        raise BadScoreRequest(
            f"the packed trajectory ({packed} ids) exceeds the max context {info.max_context}"
        )


def vocab_digest(identity: str) -> str:
    """The content part of a tokenizer identity (`name@digest`): names differ across copies."""
    return identity.rsplit("@", 1)[-1]


def tokenizer_identity(tokenizer: Any) -> str:
    """Name and vocabulary hash: two tokenizers with the same identity map text to the same
    ids, which teacher and student must share (or the teacher scores other tokens)."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    digest = hashlib.sha256(vocab.encode()).hexdigest()[:16]
    return f"{tokenizer.name_or_path or 'tokenizer'}@{digest}"
