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


class SessionCache:
    """session id -> SessionState, least recently used evicted first past the budget.

    A state is taken out while a request computes on it and put back after, so a failed
    request loses the session's cache instead of leaving it half-updated. Every read and
    write of the table holds `_guard`: the scoring thread writes while /metrics reads.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._states: OrderedDict[str, tuple[SessionState, int]] = OrderedDict()
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._bytes = 0
        """Sum of the sizes in `_states`, kept with it under `_guard`."""
        self.evictions = 0

    def lock(self, session_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(session_id, threading.Lock())

    def take(self, session_id: str) -> SessionState | None:
        with self._guard:
            entry = self._pop(session_id)
        return entry[0] if entry else None

    def put(self, session_id: str, state: SessionState) -> None:
        size = state.nbytes
        with self._guard:
            self._pop(session_id)
            self._states[session_id] = (state, size)
            self._bytes += size
            while self._states and self._bytes > self.budget_bytes:
                _, (_, evicted) = self._states.popitem(last=False)
                self._bytes -= evicted
                self.evictions += 1

    def drop(self, session_id: str) -> bool:
        with self._guard:
            self._locks.pop(session_id, None)
            return self._pop(session_id) is not None

    def clear(self) -> int:
        """Drop every session (their prefixes were computed with other weights)."""
        with self._guard:
            count = len(self._states)
            self._states.clear()
            self._bytes = 0
            self._locks.clear()
            return count

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

    def __len__(self) -> int:
        with self._guard:
            return len(self._states)
