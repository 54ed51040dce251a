"""Reading prefix blocks back from the disk store without stalling the engine: the chain to read and
the load in flight.

Admission works in three moves, so no engine step ever waits for the disk:

1. On the engine thread, ``KVCache.request_load`` computes the chain keys that continue a request's
   in-memory hit (hashing only, at most ``MAX_LOAD_BLOCKS``) and hands them to the sink
   (``disk.sink.DiskSink.start_load``), which answers at once: None when the disk has no record for
   the chain's next block (the request is admitted now, as a miss), else a ``ChainLoad`` queued
   for its reader thread. The request stays waiting and holds no block meanwhile; requests behind
   it are admitted past it, and running ones keep stepping.
2. The reader thread reads each record, verifies its checksum (``DiskStore.get``: a corrupt record
   is dropped and counted, never served), checks its tokens and parent against the chain and
   decodes the payload into a ``[2, L, bs, Hkv, D]`` tensor. The chain stops at the first gap.
   ``done`` is set however that ends (a failure included), so nothing waits forever.
3. On the engine thread again, once ``done`` is set, ``KVCache.install_load`` copies the decoded
   pairs into pool blocks as evictable prefix entries (a copy, no I/O; on CUDA from pinned memory on
   the cache's read-back stream, the compute stream waiting on its event), and the request's
   admission matches them like any in-memory hit. What could not be read is recomputed, so the
   answer equals a cold cache's.
"""

from __future__ import annotations

import threading
from collections.abc import Container
from dataclasses import dataclass, field

import torch
from torch import Tensor

from confkv_engine.cache.prefix import CachedBlock, block_key

MAX_LOAD_BLOCKS = 64  # blocks read back for one admission (a 1,024-token prefix at block size 16)


@dataclass(frozen=True)
class ChainLink:
    """One block of the chain to read: its key, parent key and tokens; ``cached``: in memory already
    when the load was asked for (not read)."""

    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    cached: bool


@dataclass
class ChainLoad:
    """A read-back in flight: the reader fills ``pairs`` (key -> decoded K/V pair and, for an int8
    pool, the pair's scales) then sets ``done``."""

    links: list[ChainLink]
    shape: tuple[int, ...]  # of one decoded pair: [2, L, bs, Hkv, D]
    dtype: torch.dtype
    scale_shape: tuple[int, ...] | None = None  # an int8 pool's fp16 scales after the pair: [2, L, bs, Hkv]
    pairs: dict[bytes, tuple[Tensor, Tensor | None]] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    pin: bool = False  # decode into pinned memory (a CUDA pool: the copy to it runs on a side stream)

    def decode(self, payload: bytes) -> tuple[Tensor, Tensor | None] | None:
        """The payload as (pair, scales), or None when its size does not fit this layout."""
        data = torch.empty((), dtype=self.dtype).element_size() * int(torch.Size(self.shape).numel())
        scales = 0 if self.scale_shape is None else 2 * int(torch.Size(self.scale_shape).numel())
        if len(payload) != data + scales:
            return None
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if self.pin:
            raw = raw.pin_memory()
        pair = raw[:data].view(self.dtype).view(self.shape)
        if self.scale_shape is None:
            return pair, None
        return pair, raw[data:].view(torch.float16).view(self.scale_shape)


@dataclass(frozen=True)
class PrefixHit:
    """What admission learns from one ``KVCache.lookup`` (as vLLM's ``KVCacheBlocks``): the cached
    blocks to share, the tokens they cover, the blocks sharing them takes out of the evictable set
    (so admission counts them against the pool), and the disk read started for what continues them
    (None: nothing to read; then the request is admitted with ``blocks`` now)."""

    blocks: list[CachedBlock]
    tokens: int
    reclaimable_taken: int
    load: ChainLoad | None = None


def chain_links(tokens: list[int], start: int, stop: int, parent: bytes | None, salt: bytes, block_size: int,
                cached: Container[bytes]) -> list[ChainLink]:
    """The links of blocks ``[start, stop)`` of ``tokens`` (``parent``: block start-1's key)."""
    links = []
    for b in range(start, stop):
        block_tokens = tuple(tokens[b * block_size:(b + 1) * block_size])
        key = block_key(parent, salt, block_tokens)
        links.append(ChainLink(key, parent, block_tokens, key in cached))
        parent = key
    return links
