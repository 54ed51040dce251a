"""The disk tier's side of the cache: what evicted prefix blocks spill as and how loaded ones return.

``DiskTier`` is a part of ``kv_cache.KVCache`` (a mixin over the same state, kept in its own module
for size): the payload a cached block pair spills as, the read-back request for a prefix's
continuation, and the insertion of loaded pairs as evictable prefix entries. The sink itself
(``disk.sink.DiskSink``) is known only through the ``EvictionSink`` protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from confkv_engine.cache.compressed_store import CompressedStore
from confkv_engine.cache.eviction import LRUK
from confkv_engine.cache.layout import CacheSpec
from confkv_engine.cache.prefix import CachedBlock, PrefixIndex
from confkv_engine.cache.readback import MAX_LOAD_BLOCKS, ChainLink, ChainLoad, chain_links
from confkv_engine.cache.storage import DeviceKV
from confkv_engine.cache.streams import CacheStreams, PendingBytes, copy_to_host


class EvictionSink(Protocol):
    """Where evicted prefix blocks go and come back from (``disk.sink.DiskSink``); must not block long."""

    def spill(self, entry: CachedBlock, payload: PendingBytes, uses: int) -> None:
        """Keep ``payload.bytes()`` (read them off the engine thread: on CUDA they are in flight)."""
        ...

    def start_load(self, links: list[ChainLink], shape: tuple[int, ...], dtype: torch.dtype,
                   scale_shape: tuple[int, ...] | None = None, pin: bool = False) -> ChainLoad | None:
        """Start reading ``links`` back off the engine thread (``readback``); None: nothing to read."""
        ...


class DiskTier:
    """Spill payloads and read-backs of ``KVCache`` (its attributes, declared here for the checker)."""

    spec: CacheSpec
    sink: EvictionSink | None
    prefix: PrefixIndex | None
    streams: CacheStreams
    storage: DeviceKV
    store: CompressedStore
    eviction: LRUK
    scale: Tensor | None
    _clock: int

    if TYPE_CHECKING:
        def can_allocate(self, n: int) -> bool: ...

        def take_blocks(self, n: int) -> list[int]: ...

        def _mark_evictable(self, entry: CachedBlock) -> None: ...

    def request_load(self, tokens: list[int], found: list[CachedBlock], max_blocks: int) -> ChainLoad | None:
        """Ask the disk store to read back the blocks continuing ``found`` (a ``match``) over ``tokens``,
        up to ``max_blocks`` blocks in all; None when there is none to read (see ``readback``)."""
        spec = self.spec
        stop = min(max_blocks, len(found) + MAX_LOAD_BLOCKS, len(tokens) // spec.block_size)
        if self.sink is None or self.prefix is None or stop <= len(found):
            return None
        links = chain_links(tokens, len(found), stop, found[-1].key if found else None, self.prefix.salt,
                            spec.block_size, self.prefix)
        shape = (2, spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim)
        scale_shape = None if self.scale is None else shape[:-1]
        pin = self.streams.compute is not None  # a CUDA pool: decode into pinned memory
        return self.sink.start_load(links, shape, spec.dtype, scale_shape, pin)

    def install_load(self, load: ChainLoad) -> int:
        """Insert a finished load's blocks as evictable cached entries, in chain order, up to the first
        block that is neither cached nor loaded (or when no block is free); returns blocks inserted."""
        inserted = 0
        for link in load.links:
            if self.prefix is not None and link.key in self.prefix:
                continue
            if not self._insert_pair(link, load):
                break
            inserted += 1
        return inserted

    def entry_payload(self, entry: CachedBlock) -> bytes:
        """A cached block pair's stored bytes (K block then V block, ``[L, bs, Hkv, D]`` each)."""
        return self.spill_payload(entry).bytes()

    def spill_payload(self, entry: CachedBlock) -> PendingBytes:
        """``entry_payload``'s bytes, copied off the device on the spill stream (``streams``)."""
        blocks = (entry.k_block, entry.v_block)

        def parts() -> list[Tensor]:
            data = [self.store.block_data(b) for b in blocks]
            if self.scale is not None:  # then the blocks' scales, [L, bs, Hkv] fp16 each
                data += [self.storage.block_scales(b) for b in blocks]
            return data
        return copy_to_host(self.streams, self.streams.spill, parts)

    def _insert_pair(self, link: ChainLink, load: ChainLoad) -> bool:
        """One loaded block pair as an evictable entry; False when it was not loaded or no block is free."""
        pair = load.pairs.get(link.key)
        if pair is None or self.prefix is None or not self.can_allocate(2):
            return False
        k_block, v_block = self.take_blocks(2)
        data, scales = pair
        side = self.streams.readback  # host-to-device on the read-back stream, then the compute one waits
        side.wait(self.streams.fence())
        with side.running():
            for i, b in enumerate((k_block, v_block)):
                self.storage.set_block(b, data[i], None if scales is None else scales[i])
        self.streams.hand_over(side.record())
        entry = CachedBlock(link.key, link.parent, link.tokens, k_block, v_block)
        self.prefix.insert(entry)
        self.eviction.touch(link.key, self._clock, link.parent)
        self._mark_evictable(entry)  # the index's reference only: evictable until someone hits it
        return True

    def offer_all(self) -> int:
        """Offer every cached entry to the sink (at shutdown, so a restart finds them on disk)."""
        if self.sink is None or self.prefix is None:
            return 0
        entries = self.prefix.entries()
        for entry in entries:
            self.sink.spill(entry, self.spill_payload(entry), self.eviction.uses(entry.key))
        return len(entries)
