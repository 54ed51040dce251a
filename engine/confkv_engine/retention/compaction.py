"""Apply new tiers to a sequence's paged slots: merge demoted values, reorder, free blocks.

Per unit the surviving slots are rewritten as ``[KEY_ONLY by position][FULL by position]`` (the
layout ``runtime`` describes). Everything is read into temporaries first, then the block tables are
trimmed (tail blocks back to the pool, V-table entries that now cover only KEY_ONLY slots swapped
for the null block), then the slots are written back. Freed blocks return to the pool in the same
call, so the next step can use them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from confkv_engine.cache.kv_cache import KVCache, SeqKV
from confkv_engine.retention.runtime import RetentionState
from confkv_engine.retention.scorer import attention_signal
from confkv_engine.retention.tiers import Tier
from confkv_engine.retention.value_merge import merge_values


class NullBlock:
    """One pool block shared (reference-counted) by every V-table entry whose values were dropped."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.id: int | None = None

    def take(self) -> int:
        """One more reference for a table entry. The first call allocates the block and keeps a
        reference of its own, so the block never returns to the free list while we use its id."""
        if self.id is None:
            self.id = self.cache.pool.allocate(1)[0]
        self.cache.pool.incref([self.id])
        return self.id


def _uniform_count(mask: Tensor) -> int:
    counts = mask.sum(-1)
    n = int(counts.flatten()[0]) if counts.numel() else 0
    if not bool((counts == n).all()):
        raise ValueError("retention must keep the same number of slots per tier in every (layer, KV head)")
    return n


def _merge_demoted(cache: KVCache, seq: SeqKV, state: RetentionState, new: Tensor) -> None:
    demoted = (new == Tier.KEY_ONLY) & (state.tiers == Tier.FULL)
    if not bool(demoted.any()):
        return
    n = state.num_slots
    idx = cache.slot_index(seq.v_blocks, torch.arange(n, device=cache.kv.device))
    values = cache.kv_flat[:, idx].permute(0, 2, 1, 3).float().cpu()  # [L, Hkv, n, D]
    L, H = new.shape[:2]
    u = L * H
    merge_values(state.v_mean.view(u, -1), state.v_weight.view(u), values.reshape(u, n, -1),
                 attention_signal(state.acc, state.norm).view(u, n), demoted.view(u, n))


def _set_v_entries(cache: KVCache, seq: SeqKV, null: NullBlock, hole: int) -> None:
    """V-table entries below ``hole`` become the null block; the others real blocks."""
    for i in range(len(seq.v_blocks)):
        is_null = seq.v_blocks[i] == null.id
        if i < hole and not is_null:
            cache.pool.free([seq.v_blocks[i]])
            seq.v_blocks[i] = null.take()
        elif i >= hole and is_null:
            cache.pool.free([seq.v_blocks[i]])
            seq.v_blocks[i] = cache.pool.allocate(1)[0]


def apply_tiers(cache: KVCache, seq: SeqKV, state: RetentionState, new: Tensor, null: NullBlock) -> int:
    """Rewrite the sequence's slots for ``new`` tiers [L, Hkv, n]; returns blocks freed (net)."""
    n_key = _uniform_count(new == Tier.KEY_ONLY)
    n_new = _uniform_count(new != Tier.DISCARD)
    _merge_demoted(cache, seq, state, new)
    dev, bs = cache.kv.device, cache.spec.block_size
    code = torch.where(new == Tier.KEY_ONLY, 0, torch.where(new == Tier.FULL, 1, 2)).long()
    order = (code * (1 << 40) + state.pos).argsort(dim=-1)[..., :n_new]  # [L, Hkv, n_new]
    src = order.to(dev)
    layer = torch.arange(new.shape[0], device=dev)[:, None, None]
    head = torch.arange(new.shape[1], device=dev)[None, :, None]
    keys = cache.kv_flat[layer, cache.slot_index(seq.k_blocks, src), head]
    vals = cache.kv_flat[layer, cache.slot_index(seq.v_blocks, src[..., n_key:]), head]
    pos = state.pos.gather(-1, order)
    used_before = cache.pool.num_used

    nb = -(-n_new // bs)
    tail_k, tail_v = seq.k_blocks[nb:], seq.v_blocks[nb:]
    del seq.k_blocks[nb:], seq.v_blocks[nb:]
    cache._clear_positions(tail_k)
    cache.pool.free(tail_k + tail_v)
    _set_v_entries(cache, seq, null, n_key // bs)

    dst = torch.arange(n_new, device=dev).expand_as(src)
    k_dst = cache.slot_index(seq.k_blocks, dst)
    cache.kv_flat[layer, k_dst, head] = keys
    cache.kv_flat[layer, cache.slot_index(seq.v_blocks, dst[..., n_key:]), head] = vals
    cache.pos[layer, k_dst, head] = pos.to(dev, torch.int32)
    if n_new < nb * bs:  # the rest of the last block is empty now
        rest = cache.slot_index(seq.k_blocks, torch.arange(n_new, nb * bs, device=dev))
        cache.pos[:, rest, :] = -1
    seq.num_slots, seq.head_slots = n_new, None

    state.pos, state.tiers = pos, new.gather(-1, order)
    state.acc, state.norm = state.acc.gather(-1, order), state.norm.gather(-1, order)
    state.n_key = n_key
    return used_before - cache.pool.num_used


def held_bytes(cache: KVCache, seq: SeqKV, state: RetentionState | None, null: NullBlock) -> int:
    """What the sequence holds, read from its block tables (null entries are not its blocks)."""
    v_real = sum(1 for b in seq.v_blocks if b != null.id)
    meta = state.metadata_bytes() if state is not None else 0
    return (len(seq.k_blocks) + v_real) * cache.spec.block_bytes + meta
