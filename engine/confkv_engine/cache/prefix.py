"""The prefix index: full KV blocks keyed by chained hashes of their tokens, verified on every hit.

A block's key is ``blake2b(parent key | salt | its tokens)``: the salt names everything that changes
the stored K/V besides the tokens (model, dtype, block size), and the parent chain makes a key name
the whole prefix, not just one block's tokens. A hit is served only when the stored tokens and
parent key equal the request's, so even a hash collision can never hand out another prefix's K/V.

An entry is one K block and one V block (registered and evicted as a pair). The index holds one
pool reference on each of them; a request sharing the entry holds another. When only the index's
reference is left the entry is *evictable*, and the eviction policy (``eviction.LRUK``) decides the
order; the cache reclaims evictable entries only when the free list runs short (lazy eviction, as
vLLM v1's block pool does).

Hit rate is counted in prompt tokens: cumulative counters, and a ratio over a sliding window of the
last ``HIT_WINDOW_SECONDS`` (the cumulative ratio hides a recent collapse behind a long good past).
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import deque
from dataclasses import dataclass, field

HIT_WINDOW_SECONDS = 300.0  # the deployment guide's hit-rate alert looks at 5 minutes


def block_key(parent: bytes | None, salt: bytes, tokens: tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(salt)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def chain_keys(tokens: list[int], block_size: int, salt: bytes, start: int = 0,
               parent: bytes | None = None) -> list[bytes]:
    """Keys of the full blocks ``start``, ``start + 1``... of ``tokens`` (``parent``: block start-1's)."""
    keys = []
    for b in range(start, len(tokens) // block_size):
        parent = block_key(parent, salt, tuple(tokens[b * block_size:(b + 1) * block_size]))
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class CachedBlock:
    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    k_block: int
    v_block: int


@dataclass
class HitCounter:
    """Prompt tokens looked up and found: cumulative, and over a sliding window."""

    window: float = HIT_WINDOW_SECONDS
    queried: int = 0
    hit: int = 0
    _recent: deque[tuple[float, int, int]] = field(default_factory=deque)

    def record(self, queried: int, hit: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.queried += queried
        self.hit += hit
        self._recent.append((now, queried, hit))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window:
            self._recent.popleft()

    def window_ratio(self, now: float | None = None) -> float | None:
        """Hit tokens / queried tokens over the window; None when nothing was looked up in it."""
        self._trim(time.monotonic() if now is None else now)
        queried = sum(q for _, q, _ in self._recent)
        return sum(h for _, _, h in self._recent) / queried if queried else None


class PrefixIndex:
    def __init__(self, salt: bytes) -> None:
        self.salt = salt
        self._entries: dict[bytes, CachedBlock] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def entries(self) -> list[CachedBlock]:
        """Every entry, parents before children (insertion order)."""
        return list(self._entries.values())

    def get(self, key: bytes) -> CachedBlock | None:
        return self._entries.get(key)

    def match(self, tokens: list[int], block_size: int, max_blocks: int) -> list[CachedBlock]:
        """The cached chain covering the longest prefix of ``tokens`` (at most ``max_blocks`` blocks),
        each entry verified token by token against the request."""
        found: list[CachedBlock] = []
        parent: bytes | None = None
        for b in range(min(max_blocks, len(tokens) // block_size)):
            block_tokens = tuple(tokens[b * block_size:(b + 1) * block_size])
            entry = self._entries.get(block_key(parent, self.salt, block_tokens))
            if entry is None or entry.tokens != block_tokens or entry.parent != parent:
                break
            found.append(entry)
            parent = entry.key
        return found

    def insert(self, entry: CachedBlock) -> None:
        if entry.key in self._entries:
            raise ValueError("block key registered twice")
        self._entries[entry.key] = entry

    def replace(self, entry: CachedBlock) -> None:
        """Point a registered key at other storage of the same block (its compressed copy)."""
        if entry.key not in self._entries:
            raise KeyError("replace of a block key that is not registered")
        self._entries[entry.key] = entry

    def remove(self, key: bytes) -> CachedBlock:
        return self._entries.pop(key)
