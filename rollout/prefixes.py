"""The local student's prefix reuse: a trajectory's next turn starts from the keys and
values its last turn left, instead of encoding its whole context again.

Turn k+1's context is turn k's context, its span and the tool's answer: all but the new
tail is already encoded. A session (the trajectory's id) keeps the key/value rows of
every token its last generation saw; the next request of that session feeds only what
follows its longest common prefix with them (a context re-rendered differently, say with
an earlier turn's reasoning dropped, reuses up to where it changed: a key at position p
depends on the tokens up to p alone). Reuse changes which shapes compute a row, so its
last bits, never what it means; under rounds (rollout/rounds.py) it is as reproducible
as the batches are.

Memory bound: at most `max_bytes` of keys and values in all (bytes per token = layers x 2
x key-value heads x head size x element size: 4 KiB for the bundled student, 112 KiB for
a 28-layer bf16 model with 8 KV heads of 128), the least recently used session evicted
first; a session is dropped when its trajectory ends. Only for models whose every layer
is plain full attention (a sliding window or a linear-attention layer keeps a state a
prefix cannot be cut from: such models re-encode, as before).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_BYTES = 1 << 30
"""1 GiB of cached keys and values per policy."""


@dataclass(frozen=True)
class Prefix:
    """The keys and values of `ids`, per layer: ([1, heads, len(ids), head], same)."""

    ids: tuple[int, ...]
    layers: tuple[tuple[Any, Any], ...]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)


class PrefixStore:
    """Sessions' prefixes, least recently used first, within `max_bytes` (thread-safe:
    decoding threads share it)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be at least 0, not {max_bytes}")
        self.max_bytes = max_bytes
        self._prefixes: OrderedDict[str, Prefix] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._prefixes)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def reusable(self, session_id: str | None, input_ids: list[int]) -> tuple[int, Prefix | None]:
        """How many leading tokens of `input_ids` the session holds (at most all but the
        last: a forward needs one token), and its prefix; (0, None) when none."""
        if session_id is None:
            return 0, None
        with self._lock:
            prefix = self._prefixes.get(session_id)
            if prefix is None:
                return 0, None
            self._prefixes.move_to_end(session_id)
        limit = min(len(prefix.ids), len(input_ids) - 1)
        common = 0
        while common < limit and prefix.ids[common] == input_ids[common]:
            common += 1
        return (common, prefix) if common > 0 else (0, None)

    def put(self, session_id: str, prefix: Prefix) -> None:
        """Keep `prefix` as the session's (replacing its last one), evicting the least
        recently used sessions past max_bytes; one larger than max_bytes is not kept."""
        size = prefix.nbytes
        with self._lock:
            self._pop(session_id)
            if size > self.max_bytes:
                return
            while self._prefixes and self._bytes + size > self.max_bytes:
                self._pop(next(iter(self._prefixes)))
            self._prefixes[session_id] = prefix
            self._bytes += size

    def drop(self, session_id: str) -> None:
        with self._lock:
            self._pop(session_id)

    def _pop(self, session_id: str) -> None:
        prefix = self._prefixes.pop(session_id, None)
        if prefix is not None:
            self._bytes -= prefix.nbytes


def full_attention_only(model: Any) -> bool:
    """Whether every layer of `model` keeps a plain key/value cache (a prefix of it is
    the prefix's): no sliding window, no linear attention."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    return bool(cache.layers) and all(
        type(layer) is DynamicLayer and not layer.is_sliding for layer in cache.layers
    )
