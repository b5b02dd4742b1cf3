"""What a scoring backend provides, and the checks every backend shares."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol

from teacher_server.api import ScoreItem, ScoreResult, ServerInfo


class BadScoreRequest(ValueError):
    """A request the backend cannot score as asked; the message names the field (HTTP 400)."""


class Overloaded(RuntimeError):
    """The queue is over its bound (HTTP 503 with Retry-After)."""


class BackendFailure(RuntimeError):
    """The backend itself failed (model error, upstream server down): HTTP 502/500."""


class ScoringBackend(Protocol):
    def info(self) -> ServerInfo: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        """Results in request order; raises BadScoreRequest, Overloaded or BackendFailure."""
        ...

    async def drop_session(self, session_id: str) -> bool: ...

    def metrics_text(self) -> str:
        """Backend-specific Prometheus lines (queue depth, cache, tokens computed)."""
        ...


def check_items(items: list[ScoreItem], info: ServerInfo) -> None:
    """The limits every backend enforces, before anything is queued."""
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


def tokenizer_identity(tokenizer: Any) -> str:
    """Name and vocabulary hash: two tokenizers with the same identity map text to the same
    ids, which teacher and student must share (or the teacher scores other tokens)."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    digest = hashlib.sha256(vocab.encode()).hexdigest()[:16]
    return f"{tokenizer.name_or_path or 'tokenizer'}@{digest}"
