"""Per-session model state for prefix reuse, under a memory budget with LRU eviction.

A session holds the ids its cache covers, the cache itself (keys/values of full-attention
layers, recurrent state of linear-attention layers) and, for hybrid models, snapshots of
the linear-attention layers at earlier positions: a recurrent state cannot be cropped back
to an earlier length, so reuse can only restart from a snapshotted position.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from rollout.chat import common_prefix_len

LayerSnapshot = dict[int, Any]
"""layer index -> a deep copy of that linear-attention layer's cache."""


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor reachable from a cache layer (keys, values, conv, recurrent)."""
    total = 0
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            total += sum(
                v.numel() * v.element_size() for v in value.values() if isinstance(v, torch.Tensor)
            )
    return total


def linear_layer_indices(cache: DynamicCache) -> list[int]:
    return [
        i
        for i, layer in enumerate(cache.layers)
        if isinstance(layer, LinearAttentionCacheLayerMixin)
    ]


def snapshot(cache: DynamicCache) -> LayerSnapshot:
    return {i: copy.deepcopy(cache.layers[i]) for i in linear_layer_indices(cache)}


def rewind(cache: DynamicCache, to_length: int, snapshots: dict[int, LayerSnapshot]) -> None:
    """Put the cache back to covering the first `to_length` ids, in place."""
    drop = cache.get_seq_length() - to_length
    linear = set(linear_layer_indices(cache))
    if linear and to_length not in snapshots:
        raise ValueError(f"no recurrent-state snapshot at position {to_length}")
    for index, layer in enumerate(cache.layers):
        if index in linear:
            cache.layers[index] = copy.deepcopy(snapshots[to_length][index])
        elif drop > 0:
            cast(Any, layer).crop(-drop)


@dataclass
class SessionState:
    ids: list[int]
    cache: DynamicCache
    snapshots: dict[int, LayerSnapshot] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        layers = sum(tensor_bytes(layer) for layer in self.cache.layers)
        snaps = sum(
            tensor_bytes(layer) for snap in self.snapshots.values() for layer in snap.values()
        )
        return layers + snaps

    def reuse_length(self, ids: list[int], limit: int) -> int:
        """How many leading ids of a new request this state can serve (at most `limit`)."""
        shared = min(common_prefix_len(self.ids, ids), limit)
        if not linear_layer_indices(self.cache):
            return shared
        return max((p for p in self.snapshots if p <= shared), default=0)


@dataclass(eq=False)
class _InFlight:
    """The bookkeeping of a session with requests in flight, removed with the last of them."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while one request computes on the session: its requests run one at a time."""
    holders: int = 0
    """Requests admitted and not yet released."""
    generation: int = 0
    """Bumped by a drop or a clear: requests admitted before it store nothing."""


@dataclass(eq=False)
class SessionTicket:
    """A request's claim on its session, from admission (`SessionCache.admit`) to its
    answer (`SessionCache.release`)."""

    session_id: str
    generation: int
    record: _InFlight


@dataclass(eq=False)
class SessionLease:
    """What `SessionCache.checkout` lends: the cached state (None: start afresh), and
    `keep(state)` to have the updated one stored when the checkout ends."""

    state: SessionState | None
    kept: SessionState | None = None

    def keep(self, state: SessionState) -> None:
        self.kept = state


ENDED_MEMORY = 4096
"""Dropped session ids remembered (about 100 bytes each, 0.4 MB in all): many times the
trajectories a job has in flight (rollout.concurrency, 256 in the reference runs), whose
late requests come seconds after their DELETE."""


class SessionCache:
    """session id -> SessionState, least recently used evicted first past the budget.

    A request holds a ticket on its session from admission to answer (`admit`, `release`)
    and has the state out of the table while it computes (`checkout`), so a failed request
    loses the session's cache instead of leaving it half-updated. A drop (DELETE) or a
    clear (reload) wins over every request admitted before it, queued or computing: none of
    them puts a state back, and nor does a request admitted after it: the last
    ENDED_MEMORY dropped ids are remembered, so a request the client cancelled before the
    server accepted it (sent, then the trajectory ended and DELETEd its session) cannot
    bring a session back to hold memory until eviction. Such a request is still answered;
    an id reused after its drop only goes uncached. Per-session bookkeeping (a lock, a
    holder count) exists only while the session has requests in flight, so nothing
    outlives a session. Every
    operation is O(1) in the number of sessions and holds `_guard` for its table work (the
    scoring thread writes while /metrics and DELETE read).
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._states: OrderedDict[str, tuple[SessionState, int]] = OrderedDict()
        self._in_flight: dict[str, _InFlight] = {}
        self._guard = threading.Lock()
        self._bytes = 0
        """Sum of the sizes in `_states`, kept with it under `_guard`."""
        self._ended: OrderedDict[str, None] = OrderedDict()
        """The last ENDED_MEMORY dropped session ids, oldest first."""
        self.evictions = 0

    def admit(self, session_id: str) -> SessionTicket:
        """Claim `session_id` for one request; `release` the ticket once it is answered."""
        with self._guard:
            record = self._in_flight.get(session_id)
            if record is None:
                record = self._in_flight[session_id] = _InFlight()
            record.holders += 1
            return SessionTicket(session_id, record.generation, record)

    def release(self, ticket: SessionTicket) -> None:
        with self._guard:
            ticket.record.holders -= 1
            if ticket.record.holders == 0:
                del self._in_flight[ticket.session_id]

    @contextmanager
    def checkout(self, ticket: SessionTicket) -> Iterator[SessionLease]:
        """The session's state, out of the table while the body runs (one request of a
        session at a time); what the body `keep`s is stored after it, unless the session
        was dropped since the ticket's admission or the body raised."""
        with ticket.record.lock:
            with self._guard:
                entry = self._pop(ticket.session_id) if self._current(ticket) else None
            lease = SessionLease(entry[0] if entry else None)
            yield lease
            if lease.kept is not None:
                self._store(ticket, lease.kept)

    def _store(self, ticket: SessionTicket, state: SessionState) -> None:
        size = state.nbytes
        with self._guard:
            if not self._current(ticket) or ticket.session_id in self._ended:
                return  # dropped while it computed or before it came: the drop wins
            self._pop(ticket.session_id)
            self._states[ticket.session_id] = (state, size)
            self._bytes += size
            while self._states and self._bytes > self.budget_bytes:
                _, (_, evicted) = self._states.popitem(last=False)
                self._bytes -= evicted
                self.evictions += 1

    def drop(self, session_id: str) -> bool:
        """Forget the session, also for its requests in flight; whether there was anything
        (a cached state or a request in flight) to forget."""
        with self._guard:
            record = self._in_flight.get(session_id)
            if record is not None:
                record.generation += 1
            self._ended[session_id] = None
            self._ended.move_to_end(session_id)
            while len(self._ended) > ENDED_MEMORY:
                self._ended.popitem(last=False)
            return self._pop(session_id) is not None or record is not None

    def clear(self) -> int:
        """Drop every session (their prefixes were computed with other weights), also for
        the requests in flight; how many cached states were dropped."""
        with self._guard:
            count = len(self._states)
            self._states.clear()
            self._bytes = 0
            for record in self._in_flight.values():
                record.generation += 1
            return count

    def _current(self, ticket: SessionTicket) -> bool:
        """Whether no drop or clear came since the ticket's admission, and it was not
        released (a request whose caller gave up); the caller holds `_guard`."""
        record = self._in_flight.get(ticket.session_id)
        return record is ticket.record and record.generation == ticket.generation

    def _pop(self, session_id: str) -> tuple[SessionState, int] | None:
        """Remove one entry; the caller holds `_guard`."""
        entry = self._states.pop(session_id, None)
        if entry is not None:
            self._bytes -= entry[1]
        return entry

    @property
    def total_bytes(self) -> int:
        with self._guard:
            return self._bytes

    @property
    def in_flight(self) -> int:
        """Sessions with a request admitted and not yet answered."""
        with self._guard:
            return len(self._in_flight)

    def __len__(self) -> int:
        with self._guard:
            return len(self._states)

    def __contains__(self, session_id: object) -> bool:
        """Whether a state of the session is cached."""
        with self._guard:
            return session_id in self._states
