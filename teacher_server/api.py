"""The teacher service's wire format: every request and response is a pydantic model."""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

TokenId = Annotated[StrictInt, Field(ge=0)]
ROUTING_HEADER = "X-SMG-Routing-Key"
"""The SGLang router's session header: one trajectory's requests to one engine (under the
router's manual and consistent_hashing policies)."""
MAX_ROUTING_KEY_LEN = 128
DEFAULT_MAX_TOP_K = 100
"""The largest top_k a service accepts unless started with another --max-top-k."""
SERVICE_KEEP_ALIVE_S = 75.0
"""How long the teacher service keeps an idle connection open. Longer than any client of
it keeps one (CLIENT_KEEP_ALIVE_S): with equal times (uvicorn's and httpx's defaults are
both 5 s) a client reuses a connection just as the server closes it, and the request fails
as a read error that no server fault caused."""
CLIENT_KEEP_ALIVE_S = 30.0
"""How long our clients of the teacher service keep an idle connection for reuse."""
SGLANG_KEEP_ALIVE_S = 3.0
"""How long our clients of SGLang keep an idle connection: SGLang's server closes one after
5 s idle (uvicorn's timeout_keep_alive=5), so ours let go first."""
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 1e2
"""Temperatures accepted: within them fp32 log-softmax(logits / T) stays finite."""
Temperature = Annotated[
    StrictFloat | StrictInt, Field(ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE, allow_inf_nan=False)
]


MAX_UNKNOWN_KEYS = 3
"""A body object with more unknown keys than this is one error, not one per key."""


class RequestBody(BaseModel):
    """A request body, validated with a cost linear in its size and a bounded error list:
    a list stops at its first bad element (fail_fast), and an object with more than
    MAX_UNKNOWN_KEYS unknown keys is one error naming a few of them."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and len(data) > len(cls.model_fields) + MAX_UNKNOWN_KEYS:
            unknown = [key for key in data if key not in cls.model_fields]
            if len(unknown) > MAX_UNKNOWN_KEYS:
                shown = ", ".join(repr(str(key)[:40]) for key in unknown[:MAX_UNKNOWN_KEYS])
                raise ValueError(
                    f"{len(unknown)} unknown fields ({shown}, ...); accepted: "
                    f"{', '.join(cls.model_fields)}"
                )
        return data


def routing_key(session_id: str) -> str:
    """The `X-SMG-Routing-Key` value of a session: the id itself when it is printable ASCII
    of at most MAX_ROUTING_KEY_LEN characters (httpx sends header values as ASCII), else
    its SHA-256, so that distinct sessions keep distinct keys."""
    fits = len(session_id) <= MAX_ROUTING_KEY_LEN
    if fits and session_id.isascii() and session_id.isprintable():
        return session_id
    return hashlib.sha256(session_id.encode()).hexdigest()


class ScoreItem(RequestBody):
    """Score input_ids[span_start:] given everything before each token."""

    input_ids: list[TokenId] = Field(min_length=2, fail_fast=True)
    """Context then span, as token ids of the teacher's tokenizer."""
    span_start: StrictInt = Field(ge=1)
    """Index of the first scored token; the span runs to the end of input_ids."""
    top_k: StrictInt = Field(default=0, ge=0)
    """Also return the k most likely ids (and their log-probs) at each span position."""
    session_id: StrictStr | None = Field(default=None, max_length=256)
    """Requests of one trajectory share a session, so each turn reuses the last one's prefix."""
    temperature: Temperature = 1.0
    """Log-probs are of softmax(logits / temperature), temperature in [0.01, 100]."""


class ScoreRequest(RequestBody):
    requests: list[ScoreItem] = Field(min_length=1, fail_fast=True)


class ScoreResult(BaseModel):
    logprobs: list[float]
    """logprobs[i] = log p(input_ids[span_start + i] | input_ids[:span_start + i])."""
    top_k_ids: list[list[int]] | None = None
    top_k_logprobs: list[list[float]] | None = None
    cached_tokens: int = 0
    """Prefix tokens reused from the session's cache instead of computed."""


class ScoreResponse(BaseModel):
    results: list[ScoreResult]


class TrajectoryTurn(RequestBody):
    """One turn of a whole trajectory: its context is trunk_ids[:context_len] followed by
    context_suffix_ids (the part a later context rewrote), then the span to score."""

    context_len: StrictInt = Field(ge=0)
    context_suffix_ids: list[TokenId] = Field(default_factory=list, fail_fast=True)
    span_ids: list[TokenId] = Field(min_length=1, fail_fast=True)


class TrajectoryScoreRequest(RequestBody):
    """Score every turn's span of one trajectory in a single tree-packed forward (each
    token computed once; hf backend, full-attention models)."""

    trunk_ids: list[TokenId] = Field(min_length=1, fail_fast=True)
    """The latest context of the trajectory (system, task, actions, observations)."""
    turns: list[TrajectoryTurn] = Field(min_length=1, fail_fast=True)
    top_k: StrictInt = Field(default=0, ge=0)
    temperature: Temperature = 1.0


class TrajectoryScoreResponse(BaseModel):
    results: list[ScoreResult]
    """One per turn, in order; logprobs[i] is of span_ids[i] given the turn's context."""


class ReloadRequest(RequestBody):
    """Replace the served weights (a self-teacher refreshed from the student)."""

    model_dir: StrictStr = Field(min_length=1)
    """A checkpoint directory readable by the server, with the same tokenizer."""


class ReloadResult(BaseModel):
    model: str
    sessions_dropped: int
    """Cached prefixes computed with the old weights, now discarded."""


class SessionDeleted(BaseModel):
    session_id: str
    deleted: bool
    """False when the session was not cached (already evicted, or never seen)."""


class ServerInfo(BaseModel):
    model: str
    tokenizer: str
    """Identity of the tokenizer: name and a hash of its vocabulary; compare with yours."""
    vocab_size: int
    """Ids at or above this are rejected."""
    max_context: int
    """The longest input_ids accepted (ids)."""
    backend: Literal["hf", "sglang"]
    max_top_k: int
    max_batch_size: int
    max_request_tokens: int | None = None
    """The most tokens one request may cost (backend.request_tokens: every input id once,
    every scored position top_k more times, for its top-k row in the answer); more is
    refused with 413. None: no bound but the body size."""
    max_inflight_tokens: int | None = None
    """The most tokens the requests being served at once may cost together; a request that
    would pass it waits outside (503 with Retry-After). None: not bounded by the server."""


class Health(BaseModel):
    status: Literal["ok"]


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer: what went wrong, naming the field where one is at fault."""

    detail: str
