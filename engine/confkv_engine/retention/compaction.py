"""Apply new tiers to a sequence: merge the demoted values, then have the cache rewrite its slots.

Per unit the surviving slots are rewritten as ``[shared prefix][KEY_ONLY by position][FULL by
position]`` (the layout ``runtime`` describes; the shared prefix is never moved). The merge of
demoted values into the unit's running mean reads the values before the cache moves anything;
``KVCache.rewrite`` then reorders the slots, returns the tail blocks to the pool and points the
V-table entries that now cover only KEY_ONLY slots at the null block, so the next step can use
the freed blocks.

Precision tiers (``apply_precision``): frozen blocks demoted as a whole are re-encoded at fewer
bits or dropped (``cache.tiered``); the rewritable slots are then laid out ``[tokens to freeze,
per precision tier, oldest first][FULL and staged, by position]`` and the leading whole blocks of
each tier are stored through the compressed store. Every unit has the same count per tier, so
the blocks to freeze are the same table entries in every unit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from confkv_engine.cache.kv_cache import KVCache, SeqKV
from confkv_engine.cache.tiered import drop_blocks, freeze_blocks, requantize_block
from confkv_engine.retention.precision import chain_of
from confkv_engine.retention.runtime import RetentionState
from confkv_engine.retention.scorer import attention_signal
from confkv_engine.retention.tiers import TIER_BITS, Tier, rank_desc
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
    state.keep_slots(order, new)
    state.n_key = n_key
    return freed


def held_bytes(cache: KVCache, seq: SeqKV, state: RetentionState | None) -> int:
    """What the sequence holds, read from its block tables, plus its retention metadata."""
    meta = state.metadata_bytes() if state is not None else 0
    return cache.seq_bytes(seq) + meta


def _select_slots(state: RetentionState, new: Tensor, keep: Tensor) -> Tensor:
    """Keep the slot columns ``keep`` [n] (bool) of the state's mirrors; returns ``new`` likewise."""
    order = keep.nonzero()[:, 0].expand(*state.tiers.shape[:-1], -1)
    state.keep_slots(order)
    return new[..., keep]


def _demote_frozen(cache: KVCache, seq: SeqKV, state: RetentionState, new: Tensor) -> Tensor:
    """Frozen blocks whose tier the policy lowered: re-encoded at the new bits, or dropped."""
    bs, group = cache.spec.block_size, state.cfg.tiers.precision_group
    first = state.base // bs
    dropped = []
    for i, old in enumerate(state.frozen_block_tiers()):
        tier = int(new[0, 0, state.base + i * bs])
        if tier == Tier.DISCARD:
            dropped.append(i)
        elif tier != old:
            requantize_block(cache, seq, first + i, TIER_BITS[Tier(tier)], group)
            state.tiers[..., state.base + i * bs:state.base + (i + 1) * bs] = tier
    if not dropped:
        return new
    drop_blocks(cache, seq, [first + i for i in dropped])
    keep = torch.ones(state.num_slots, dtype=torch.bool)
    for i in dropped:
        keep[state.base + i * bs:state.base + (i + 1) * bs] = False
    state.frozen -= bs * len(dropped)
    return _select_slots(state, new, keep)


def apply_precision(cache: KVCache, seq: SeqKV, state: RetentionState, new: Tensor) -> int:
    """Apply precision-tier decisions ``new`` [L, Hkv, n]; returns pool blocks freed (net)."""
    used = cache.pool.num_used
    new = _demote_frozen(cache, seq, state, new)
    bs, fixed = cache.spec.block_size, state.key_start
    slot = torch.arange(new.shape[-1]).expand_as(new)
    code = torch.where(new == Tier.DISCARD, 99, 90)  # FULL and staged remainders, after the frozen
    bits: list[tuple[int, int]] = []
    by_confidence = state.cfg.tiers.freeze_order == "confidence"
    signal = attention_signal(state.acc, state.norm) if by_confidence else None
    key = torch.where(slot < fixed, slot, state.pos)
    for j, tier in enumerate(chain_of(state.cfg.tiers)[1:]):
        staged = (new == tier) & (slot >= fixed)
        whole = _uniform_count(staged) // bs * bs
        rank = _rank_by_position(state.pos, staged) if signal is None else rank_desc(signal, staged)
        freeze = staged & (rank < whole)
        code = torch.where(freeze, 1 + j, code)
        if by_confidence:  # blocks of like confidence: the walk later drops a block's tokens together
            key = torch.where(freeze, rank, key)
        bits += [TIER_BITS[tier]] * (whole // bs)
    code = torch.where(slot < fixed, 0, code)
    n_new = _uniform_count(new != Tier.DISCARD)
    order = (code.long() * (1 << 40) + key).argsort(dim=-1)[..., :n_new]
    cache.rewrite(seq, order, 0, fixed)
    state.keep_slots(order, new)
    done = freeze_blocks(cache, seq, fixed // bs, bits, state.cfg.tiers.precision_group)
    if done < len(bits):  # the codec refused a block: its tokens stay in the pool, as FULL
        state.tiers[..., fixed + done * bs:fixed + len(bits) * bs] = Tier.FULL
    state.frozen += done * bs
    return used - cache.pool.num_used


def _rank_by_position(pos: Tensor, mask: Tensor) -> Tensor:
    """Rank (0 = oldest) of each masked slot within its unit by position; others get n."""
    n = pos.shape[-1]
    key = torch.where(mask, pos, torch.full_like(pos, 1 << 40))
    order = key.argsort(dim=-1, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(n).expand_as(order).contiguous())
    return torch.where(mask, ranks, torch.full_like(ranks, n))
