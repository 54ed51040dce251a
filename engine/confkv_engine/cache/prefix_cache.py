"""The prefix cache's side of the cache: lookup, sharing and registration of cached blocks.

``PrefixCache`` is a part of ``kv_cache.KVCache`` (a mixin over the same state, kept in its own
module for size, as ``disk_tier.DiskTier``): the longest cached prefix of a request (``match`` /
``lookup``), sharing it with a new sequence (``attach``), keying a sequence's computed blocks
(``register``) and the evictable set's bookkeeping. The index itself is ``prefix.PrefixIndex``,
the eviction order ``eviction.LRUK``.
"""

from __future__ import annotations

import time

from confkv_engine.cache.block_pool import is_compressed
from confkv_engine.cache.compress import promote_entry
from confkv_engine.cache.disk_tier import DiskTier
from confkv_engine.cache.layout import SeqKV
from confkv_engine.cache.prefix import CachedBlock, HitCounter, block_key
from confkv_engine.cache.readback import PrefixHit


class PrefixCache(DiskTier):
    """Prefix sharing of ``KVCache`` (its attributes, declared here and in ``DiskTier``)."""

    hits: HitCounter
    null_block: int
    _cold: dict[bytes, float]
    _evictable_handles: int

    def pop_cold(self, released_before: float) -> bytes | None:
        """Take the key of the evictable prefix entry released longest ago, if that was before
        ``released_before`` (``time.monotonic``) and it still has a pool block; else None."""
        key = next(iter(self._cold), None)
        if key is None or self._cold[key] > released_before:
            return None
        del self._cold[key]
        return key

    def count_idle_handle(self, handle: int) -> None:
        """A compressed block of an evictable prefix entry: reclaimable with the entry."""
        self.store.set_idle(handle, 1)
        self._evictable_handles += 1

    def match(self, tokens: list[int], max_blocks: int) -> list[CachedBlock]:
        """The cached blocks covering the longest prefix of ``tokens``. Nothing is shared yet; what the
        disk store holds beyond it comes back through ``request_load`` / ``install_load``."""
        if self.prefix is None or max_blocks <= 0:
            return []
        return self.prefix.match(tokens, self.spec.block_size, max_blocks)

    def lookup(self, tokens: list[int], max_blocks: int, read_disk: bool = True) -> PrefixHit:
        """Admission's one question: the cached blocks covering the longest prefix of ``tokens`` (at
        most ``max_blocks``), the blocks sharing them takes out of the evictable set, and (when
        ``read_disk``) the disk read started for what continues them (see ``readback``)."""
        blocks = self.match(tokens, max_blocks)
        load = self.request_load(tokens, blocks, max_blocks) if read_disk else None
        return PrefixHit(blocks, len(blocks) * self.spec.block_size, self.evictable_among(blocks), load)

    def evictable_among(self, entries: list[CachedBlock]) -> int:
        """Blocks that sharing ``entries`` takes out of the evictable set (they stop being reclaimable)."""
        evictable = [e for e in entries if e.key in self.eviction]
        handles = [b for e in evictable for b in (e.k_block, e.v_block) if is_compressed(b)]
        return sum(2 - _handles(e) for e in evictable) + self.store.hosts_pinned_by(handles)

    def attach(self, seq: SeqKV, entries: list[CachedBlock], queried_tokens: int, spare: int = 0) -> int:
        """Share ``entries`` as the start of an empty sequence; returns the tokens they cover. Up to
        ``spare`` blocks (what admission can give beyond its own need) decode compressed entries back
        into pool blocks (``compress.promote_entry``)."""
        if seq.num_slots or seq.k_blocks:
            raise ValueError("a prefix attaches to an empty sequence only")
        self._clock += 1
        for e in entries:  # all taken out of the evictable set first: a promotion may evict
            if self.eviction.acquire(e.key):
                self._set_idle(e, -1)
                self._cold.pop(e.key, None)
        for i, e in enumerate(entries):
            e, used = promote_entry(self, e, spare)
            entries[i], spare = e, spare - used
            self.store.incref_all([e.k_block, e.v_block])
            self.eviction.touch(e.key, self._clock)
        seq.k_blocks = [e.k_block for e in entries]
        seq.v_blocks = [e.v_block for e in entries]
        seq.block_keys = [e.key for e in entries]
        seq.num_slots = len(entries) * self.spec.block_size
        if queried_tokens:
            self.hits.record(queried_tokens, seq.num_slots)
        return seq.num_slots

    def register(self, seq: SeqKV, tokens: list[int]) -> int:
        """Register the sequence's full blocks not yet keyed (``tokens``: the tokens of its slots, which
        hold them unchanged). A block whose key another request registered first stays private."""
        if self.prefix is None:
            return 0
        bs, added = self.spec.block_size, 0
        for b in range(len(seq.block_keys), min(seq.num_slots, len(tokens)) // bs):
            parent = seq.block_keys[-1] if seq.block_keys else None
            block_tokens = tuple(tokens[b * bs:(b + 1) * bs])
            key = block_key(parent, self.prefix.salt, block_tokens)
            seq.block_keys.append(key)
            if key in self.prefix or seq.v_blocks[b] == self.null_block:
                continue
            self.prefix.insert(CachedBlock(key, parent, block_tokens, seq.k_blocks[b], seq.v_blocks[b]))
            self.store.incref_all([seq.k_blocks[b], seq.v_blocks[b]])
            self.eviction.touch(key, self._clock, parent)  # a new block takes its chain's history
            added += 1
        return added

    def set_eviction_k(self, k: int) -> None:
        """Live LRU-K change: cached blocks and their history stay."""
        self.eviction.set_k(k)

    def _mark_evictable(self, entry: CachedBlock) -> None:
        self.eviction.release(entry.key)
        self._set_idle(entry, 1)
        if _handles(entry) < 2:
            self._cold[entry.key] = time.monotonic()

    def _set_idle(self, entry: CachedBlock, delta: int) -> None:
        """An entry became evictable (+1) or stopped being so (-1): count its compressed blocks."""
        for b in (entry.k_block, entry.v_block):
            if is_compressed(b):
                self.store.set_idle(b, delta)
                self._evictable_handles += delta


def _handles(entry: CachedBlock) -> int:
    """How many of a prefix entry's two blocks are compressed."""
    return is_compressed(entry.k_block) + is_compressed(entry.v_block)
