"""Retention's rewrite of a sequence's private blocks: the procedure behind ``KVCache.rewrite``.

Gathers the kept keys, values and positions first, then frees tail blocks and turns KEY_ONLY value
blocks into the null block, then scatters what was gathered into the slots ``[base, n_new)``, so the
source and destination may overlap. Blocks shared with another holder (a prefix) are refused.
"""

from __future__ import annotations

import torch
from torch import Tensor

from confkv_engine.cache.block_pool import is_compressed
from confkv_engine.cache.layout import SeqKV
from confkv_engine.cache.owner import BlockOwner as KVCache


def rewrite_seq(cache: KVCache, seq: SeqKV, order: Tensor, n_key: int, base: int) -> int:
    """``KVCache.rewrite`` (its docstring says what is kept)."""
    spec, dev, bs = cache.spec, cache.kv.device, cache.spec.block_size
    n_new = order.shape[-1]
    if base % bs or any(cache.store.ref(b) > 1 or is_compressed(b) for b in seq.k_blocks[base // bs:]):
        raise ValueError("retention may rewrite only a sequence's private blocks after its prefix")
    src = order[..., base:].to(dev)
    layer = torch.arange(spec.num_layers, device=dev)[:, None, None]
    head = torch.arange(spec.num_kv_heads, device=dev)[None, :, None]
    k_src = cache.slot_index(seq.k_blocks, src)
    kv, v_src = cache.kv_moved, cache.slot_index(seq.v_blocks, src[..., n_key:])
    keys, pos, vals = kv[layer, k_src, head], cache.pos[layer, k_src, head], kv[layer, v_src, head]
    sc = cache.scale
    scales = None if sc is None else (sc[layer, k_src, head], sc[layer, v_src, head])
    held_before = cache.held_blocks(seq)

    nb = -(-n_new // bs)
    tail_k, tail_v = seq.k_blocks[nb:], seq.v_blocks[nb:]
    del seq.k_blocks[nb:], seq.v_blocks[nb:]
    cache.free_blocks(tail_k + [b for b in tail_v if b != cache.null_block])
    _set_null_entries(cache, seq, base // bs, (base + n_key) // bs)

    dst = torch.arange(base, n_new, device=dev).expand_as(src)
    k_dst = cache.slot_index(seq.k_blocks, dst)
    v_dst = cache.slot_index(seq.v_blocks, dst[..., n_key:])
    kv[layer, k_dst, head], kv[layer, v_dst, head] = keys, vals
    if scales is not None:
        cache.scale[layer, k_dst, head], cache.scale[layer, v_dst, head] = scales
    cache.pos[layer, k_dst, head] = pos
    if n_new < nb * bs:  # the rest of the last block is empty now
        rest = cache.slot_index(seq.k_blocks, torch.arange(n_new, nb * bs, device=dev))
        cache.pos[:, rest, :] = -1
    seq.num_slots = n_new
    return held_before - cache.held_blocks(seq)

def _set_null_entries(cache: KVCache, seq: SeqKV, start: int, hole: int) -> None:
    """V-table entries in ``[start, hole)`` become the null block; those after it real blocks."""
    for i in range(start, len(seq.v_blocks)):
        block = seq.v_blocks[i]
        is_null = block == cache.null_block
        if i < hole and not is_null:
            cache.free_blocks([block])
            seq.v_blocks[i] = cache.null_block
        elif i >= hole and is_null:
            seq.v_blocks[i] = cache.take_blocks(1)[0]
