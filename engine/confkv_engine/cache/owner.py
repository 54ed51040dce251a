"""``BlockOwner``: the cache core as the helpers that rewrite block tables see it.

Compression (``compress``), retention's precision tiers (``tiered``) and its rewrite (``rewrite``)
change tables and tensors, but never the pool's bookkeeping directly: blocks come from
``take_blocks`` and every reference goes through ``free_blocks``, so ``kv_cache.KVCache`` stays the
one owner of block ids, reference counts, the free queue, the prefix index and the evictable set.
Only public members are listed; ``KVCache`` is the one implementation.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from confkv_engine.cache.block_pool import BlockPool
from confkv_engine.cache.compressed_store import CompressedStore
from confkv_engine.cache.eviction import LRUK
from confkv_engine.cache.layout import CacheSpec, SeqKV
from confkv_engine.cache.prefix import PrefixIndex
from confkv_engine.cache.storage import DeviceKV
from confkv_engine.cache.streams import CacheStreams


class BlockOwner(Protocol):
    spec: CacheSpec
    pool: BlockPool  # read only: reference counts and usage
    store: CompressedStore
    storage: DeviceKV
    prefix: PrefixIndex | None
    eviction: LRUK
    null_block: int
    streams: CacheStreams  # side streams for cache work (none on CPU)

    @property
    def kv(self) -> Tensor: ...

    @property
    def kv_moved(self) -> Tensor: ...

    @property
    def pos(self) -> Tensor: ...

    @property
    def scale(self) -> Tensor | None: ...

    def take_blocks(self, n: int) -> list[int]: ...

    def free_blocks(self, blocks: list[int]) -> None: ...

    def pop_cold(self, released_before: float) -> bytes | None: ...

    def count_idle_handle(self, handle: int) -> None: ...

    def slot_index(self, blocks: list[int], slots: Tensor) -> Tensor: ...

    def held_blocks(self, seq: SeqKV) -> int: ...
