"""Growing the KV pool live (a raised ``maxCacheSize``): one reallocation and copy, between two steps.

**One tensor, reallocated, not a list of slabs.** Growth allocates the larger ``kv`` and ``pos``
tensors, copies the old ones into their first blocks and swaps them in; every block id keeps its
bytes, so block tables, prefix entries, compressed arenas (whose hosts are pool block ids, read
through a byte view that is rebound), reference counts and the LRU-K history stay valid untouched.
The alternative, a list of slabs with ids mapped to (slab, offset), would grow without a copy and
without the transient peak, but every step pays for it: a write plan and each layer's gather become
one index operation per slab (or a gather through a slab table), and the attention backend, the
arena byte streams and compression would all have to learn the mapping. A live raise is rare (an
operator or the agent changing the policy); a step is not, so the copy is paid once instead.
Measured on this repository's CPU machine (2 cores) at SmolLM2-135M's block layout by
``bench/pool_grow.py`` (half the old pool written; fp32 and bf16 alike, bound by memory
bandwidth, about 0.45 ms per MiB of the new pool): 64 MiB -> 128 MiB in 31 ms, 256 -> 512 MiB in
115 ms, 1 GiB -> 2 GiB (the CPU default pool doubled) in 0.46 s. The engine holds its lock for
that long, so the grow lands between two steps and delays the next one by as much. New blocks are
zeroed, not left uninitialised: attention masks unused slots, but a NaN bit pattern times a zero
weight would still poison a row.

**Memory.** The old and the new tensors coexist during the copy, so the new pool must fit in what
the machine can give a pool *now*: ``layout.machine_cap`` (the start-up cap: 90% of free CUDA memory,
or half the available RAM, cgroup-aware), measured with the old pool still allocated. A larger
request is refused, naming the bytes, and nothing changes; so is an allocation that fails anyway.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from confkv_engine.cache.arena import CompressedStore
from confkv_engine.cache.block_pool import BlockPool
from confkv_engine.cache.layout import CacheSpec, machine_cap


class KVCache(Protocol):
    """The parts of ``kv_cache.KVCache`` growth replaces (it is the only implementation)."""

    spec: CacheSpec
    pool: BlockPool
    store: CompressedStore
    kv: Tensor
    kv_flat: Tensor
    scale: Tensor | None
    pos: Tensor


def grow_pool(cache: KVCache, physical_blocks: int, limit_bytes: int | None = None) -> None:
    """Reallocate ``cache``'s pool tensors to ``physical_blocks`` blocks (the null block included);
    the new ids join the tail of the free queue. ``limit_bytes``: the most the new pool may take
    (None: ``machine_cap`` now). Raises ValueError, changing nothing, when it does not fit."""
    spec, old_blocks = cache.spec, cache.pool.num_blocks
    if physical_blocks <= old_blocks:
        return
    new_bytes = physical_blocks * spec.block_bytes
    cap, what = machine_cap(spec.device) if limit_bytes is None else (limit_bytes, "the limit given")
    if new_bytes > cap:
        raise ValueError(
            f"a pool of {new_bytes} bytes ({physical_blocks - 1} blocks) is more than this machine can "
            f"hold now: at most {cap} bytes ({what}, while the current {old_blocks * spec.block_bytes} "
            f"bytes are still allocated)")
    bs, h, d = spec.block_size, spec.num_kv_heads, spec.head_dim
    try:
        kv = torch.empty(spec.num_layers, physical_blocks, bs, h, d, dtype=spec.dtype, device=spec.device)
        pos = torch.empty(spec.num_layers, physical_blocks * bs, h, dtype=torch.int32, device=spec.device)
        scale = None if cache.scale is None else torch.ones(
            spec.num_layers, physical_blocks * bs, h, dtype=cache.scale.dtype, device=spec.device)
    except RuntimeError as err:  # torch.OutOfMemoryError included: nothing was changed
        raise ValueError(f"allocating a pool of {new_bytes} bytes failed: {err}") from None
    kv[:, :old_blocks].copy_(cache.kv)
    kv[:, old_blocks:].zero_()
    pos[:, :old_blocks * bs].copy_(cache.pos)
    pos[:, old_blocks * bs:].fill_(-1)
    if scale is not None and cache.scale is not None:
        scale[:, :old_blocks * bs].copy_(cache.scale)
        cache.scale = scale
    cache.kv, cache.pos = kv, pos
    cache.kv_flat = kv.view(spec.num_layers, physical_blocks * bs, h, d)
    cache.store.rebind(kv)
    cache.pool.grow(physical_blocks)
