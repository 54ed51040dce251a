"""Apply new tiers to a sequence: merge the demoted values, then have the cache rewrite its slots.

Per unit the surviving slots are rewritten as ``[shared prefix][KEY_ONLY by position][FULL by
position]`` (the layout ``runtime`` describes; the shared prefix is never moved). The merge of
demoted values into the unit's running mean reads the values before the cache moves anything;
``KVCache.rewrite`` then reorders the slots, returns the tail blocks to the pool and points the
V-table entries that now cover only KEY_ONLY slots at the null block, so the next step can use
the freed blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from confkv_engine.cache.kv_cache import KVCache, SeqKV
from confkv_engine.retention.runtime import RetentionState
from confkv_engine.retention.scorer import attention_signal
from confkv_engine.retention.tiers import Tier
from confkv_engine.retention.value_merge import merge_values


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
    values = cache.read_values(seq)  # [L, Hkv, n, D]
    L, H, n = new.shape
    u = L * H
    merge_values(state.v_mean.view(u, -1), state.v_weight.view(u), values.reshape(u, n, -1),
                 attention_signal(state.acc, state.norm).view(u, n), demoted.view(u, n))


def apply_tiers(cache: KVCache, seq: SeqKV, state: RetentionState, new: Tensor) -> int:
    """Rewrite the sequence's slots for ``new`` tiers [L, Hkv, n]; returns blocks freed (net)."""
    n_key = _uniform_count(new == Tier.KEY_ONLY)
    n_new = _uniform_count(new != Tier.DISCARD)
    _merge_demoted(cache, seq, state, new)
    # Slot order: the shared prefix in place, then KEY_ONLY, then FULL, each by position.
    code = torch.where(new == Tier.KEY_ONLY, 1, torch.where(new == Tier.FULL, 2, 3)).long()
    code = torch.where(state.pos < state.base, 0, code)
    order = (code * (1 << 40) + state.pos).argsort(dim=-1)[..., :n_new]  # [L, Hkv, n_new]
    freed = cache.rewrite(seq, order, n_key, state.base)
    state.pos, state.tiers = state.pos.gather(-1, order), new.gather(-1, order)
    state.acc, state.norm = state.acc.gather(-1, order), state.norm.gather(-1, order)
    state.n_key = n_key
    return freed


def held_bytes(cache: KVCache, seq: SeqKV, state: RetentionState | None) -> int:
    """What the sequence holds, read from its block tables, plus its retention metadata."""
    meta = state.metadata_bytes() if state is not None else 0
    return cache.seq_bytes(seq) + meta
