"""Precision tiers: confidence chooses each token's precision under the byte budget (pure functions).

The chain is FULL, then the configured precision tiers highest first (``TierConfig.precisions``,
e.g. int4, int2), then DISCARD. A token at a precision tier keeps both its key and its value through
the cache's codec (keys grouped per channel, values per token, as KIVI; ``cache.tiered``; k4v2:
int4 keys with int2 values, since int2 loses by its keys).

Layout per unit (layer, KV head), all units with the same counts (the pool stays rectangular)::

    [shared prefix][frozen: whole blocks, one tier each][rewritable: FULL + staged, sinks, window]

- *Thresholds*: a token leaving the recent window is tiered once: ``c >= high`` (0.9) FULL, else the
  first precision tier (below ``last_tier_below``, off by default, the last one). Thresholds never
  discard and, by default, never go below the first precision tier: sending low-attention tokens to
  int2 while the budget had room measured worse than leaving every lower step to the walk.
- *Staging*: a token whose tier is a precision tier stays in the rewritable region, at full
  precision, until its unit holds a whole block of that tier; compaction then *freezes* the block
  (oldest tokens first) into the compressed store. So bytes are always exact whole blocks, of the
  pool or of the codec, and a frozen block is never re-encoded unless it is demoted as a whole.
- *Budget walk*: while the bytes exceed the target, the token whose next demotion (FULL -> int4 ->
  int2 -> DISCARD) costs least per byte saved goes down one tier: cost = confidence x the step's
  loss (``precision_loss``) / the step's bytes per token (the codec's exact block bytes / block).
  Shared counts need one walk for all units: it runs on the mean over units of each unit's
  confidences sorted high to low, then every unit gives the counts to its own tokens by rank
  (``assign_chain``), so the choice of tokens stays per (layer, KV head). With losses convex along
  the chain (checked by ``TierConfig``), a higher-confidence token never ends below a lower one.
- *Frozen blocks* take part in the same walk as whole blocks: a block's step costs its mean
  confidence (over its slots in every unit) x the step's weight, and demotes every unit's slots of
  the block together (re-encoded at fewer bits, or dropped). Without it a budget that stops
  growing (``kv_budget_tokens``) could only demote the newest tokens once the older ones froze.
- Sinks, the recent window and a shared prefix stay FULL; demotion is one-way. The window is the
  chain's own (``TierConfig.precision_window``, 2), shorter than the decision interval the other
  chains' window must hold: a token leaving it is quantized before the walk may drop it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from confkv_engine.retention.tiers import (
    PRECISION_TIERS,
    KVAccounting,
    Tier,
    TierConfig,
    equal_count,
    protected_mask,
)


def chain_of(cfg: TierConfig) -> list[Tier]:
    """Kept tiers, highest precision first: FULL then the precision tiers in force."""
    return [Tier.FULL] + [PRECISION_TIERS[p] for p in cfg.chain]


def _loss(cfg: TierConfig, tier: Tier) -> float:
    if tier == Tier.FULL:
        return 0.0
    if tier == Tier.DISCARD:
        return 1.0
    return cfg.precision_loss[list(PRECISION_TIERS.values()).index(tier)]


def step_weights(cfg: TierConfig, acct: KVAccounting) -> list[float]:
    """Per chain tier j: loss added per byte saved by demoting one token from tier j to the next."""
    kept = chain_of(cfg)
    nxt = kept[1:] + [Tier.DISCARD]
    bs = acct.block_size
    per_token = [acct.tier_pair_bytes(t) / bs for t in kept] + [0.0]
    return [(_loss(cfg, b) - _loss(cfg, a)) / (per_token[j] - per_token[j + 1])
            for j, (a, b) in enumerate(zip(kept, nxt, strict=True))]


def threshold_chain(conf: Tensor, cfg: TierConfig) -> Tensor:
    """Chain index each confidence asks for: 0 (FULL) at >= high, 1 in [last_tier_below, high), the
    last precision tier below."""
    last = len(cfg.chain)
    idx = torch.full_like(conf, last, dtype=torch.long)
    idx[conf >= cfg.last_tier_below] = min(1, last)
    idx[conf >= cfg.high] = 0
    return idx


def chain_index(tiers: Tensor, kept: list[Tier]) -> Tensor:
    """Position of each slot's tier in ``kept`` (DISCARD and anything else: len(kept))."""
    idx = torch.full_like(tiers, len(kept), dtype=torch.long)
    for j, t in enumerate(kept):
        idx[tiers == t] = j
    return idx


def assign_chain(conf: Tensor, tiers: Tensor, eligible: Tensor, counts: list[int],
                 kept: list[Tier]) -> Tensor:
    """Per unit, tier by tier from the top: the ``counts[j]`` best eligible slots not yet placed whose
    current tier is tier j or above get tier j; the remaining eligible slots are discarded (one-way)."""
    out = tiers.clone()
    # One descending sort serves every tier: a slot's rank in a tier's pool is the number of pool
    # slots before it in that order (the order rank_desc breaks ties in: stable, by slot).
    order = conf.masked_fill(~eligible, -math.inf).argsort(dim=-1, descending=True, stable=True)
    cur = chain_index(tiers, kept).gather(-1, order)
    free = eligible.gather(-1, order)
    new = torch.full_like(cur, len(kept))
    for j in range(len(kept)):
        pool = free & (cur <= j)
        pick = pool & (pool.cumsum(-1) <= counts[j])
        new[pick] = j
        free &= ~pick
    placed = torch.empty_like(new).scatter_(-1, order, new)
    lookup = torch.tensor([int(t) for t in kept] + [int(Tier.DISCARD)], dtype=out.dtype)
    return torch.where(eligible, lookup.to(out.device)[placed], out)


Allow = Callable[[int, list[int], list[int]], bool]


def walk(profile: list[float], counts: list[int], weights: list[float],
         fits: Callable[[list[int], list[int]], bool], block_conf: tuple[float, ...] = (),
         blocks: tuple[int, ...] = (), allow: Allow | None = None) -> tuple[list[int], list[int]]:
    """Demote one step at a time until ``fits(counts, blocks)``. ``counts[j]`` tokens at chain tier j
    hold the ranks after those of tiers < j in ``profile`` (confidences, high to low): a token step
    demotes the last token of tier j, at profile[rank] x weights[j]. ``blocks`` are frozen blocks'
    chain indices (``len(weights)``: dropped) with mean confidences ``block_conf``: a block step
    demotes a whole block, at its mean x weights[j]. The cheapest step goes first (ties: tokens, then
    the higher tier, then the first block); once it fits, ``refund`` undoes the steps it turned out
    not to need. ``allow(j, counts, blocks)``: whether a step out of tier j may go now (None:
    always; with a rule, nothing is refunded, since an undone drop could break it)."""
    counts, frozen = list(counts), list(blocks)
    steps: list[int] = []
    while not fits(counts, frozen):
        best, best_key, end = -1, math.inf, 0
        ok = [allow is None or allow(j, counts, frozen) for j in range(len(weights))]
        for j, c in enumerate(counts):
            end += c
            if c and ok[j] and profile[end - 1] * weights[j] < best_key:
                best, best_key = j, profile[end - 1] * weights[j]
        for i, j in enumerate(frozen):
            if j < len(weights) and ok[j] and block_conf[i] * weights[j] < best_key:
                best, best_key = len(counts) + i, block_conf[i] * weights[j]
        if best < 0:
            break
        steps.append(best)
        if best >= len(counts):
            frozen[best - len(counts)] += 1
            continue
        counts[best] -= 1
        if best + 1 < len(counts):
            counts[best + 1] += 1
    return refund(steps, counts, frozen, fits) if allow is None else (counts, frozen)


def refund(steps: list[int], counts: list[int], frozen: list[int],
           fits: Callable[[list[int], list[int]], bool]) -> tuple[list[int], list[int]]:
    """Undo ``walk``'s steps (``steps``: what it demoted, in order, as ``walk`` numbers them), latest
    first, wherever the result still fits. The bytes are not additive in the steps: a precision
    tier's staged remainder costs FULL bytes until it fills a block, the pool holds whole blocks,
    and a block step frees a block at once, so a late step can free more than the target asked
    and leave earlier ones unneeded. Undoing only moves back towards the walk's start (one-way
    still holds), and ranks stay ordered (counts are boundaries in the same profile)."""
    for step in reversed(steps):
        c, f = list(counts), list(frozen)
        if step >= len(c):
            f[step - len(c)] -= 1
        else:
            if step + 1 < len(c):
                if c[step + 1] == 0:  # its token went further down: not this step's to undo
                    continue
                c[step + 1] -= 1
            c[step] += 1
        if fits(c, f):
            counts, frozen = c, f
    return counts, frozen


def last_tier_cap(cfg: TierConfig, n_kept: int, block_size: int) -> Allow | None:
    """``walk``'s rule for ``TierConfig.last_tier_share``: a step into the last precision tier goes
    only while that tier holds under the share of the kept tokens (walked and frozen)."""
    share, last = cfg.last_tier_share, n_kept - 1
    if share is None or last < 2:
        return None

    def allow(j: int, counts: list[int], blocks: list[int]) -> bool:
        if j != last - 1:
            return True
        at_last = counts[last] + block_size * sum(b == last for b in blocks)
        kept = sum(counts) + block_size * sum(b <= last for b in blocks)
        return at_last < share * kept

    return allow


def held_bytes(acct: KVAccounting, prefix: int, frozen: list[int], n_full: int, staged: list[int],
               staged_tiers: list[Tier]) -> int:
    """Bytes after compaction: ``prefix`` slots and the rewritable slots as pool blocks (FULL, and the
    staged remainders below a whole block), whole staged blocks and ``frozen`` block tiers at their
    codec bytes, plus the retention metadata of every slot. ``staged[j]`` tokens of ``staged_tiers[j]``."""
    bs = acct.block_size
    frozen = [t for t in frozen if t != Tier.DISCARD]  # a block demoted to DISCARD is dropped
    codec = sum(acct.tier_pair_bytes(t) for t in frozen)
    codec += sum((s // bs) * acct.tier_pair_bytes(t) for s, t in zip(staged, staged_tiers, strict=True))
    rest = n_full + sum(s % bs for s in staged)
    slots = prefix + len(frozen) * bs + n_full + sum(staged)
    pool = 2 * (acct.blocks(prefix) + acct.blocks(rest)) * acct.half_block_bytes
    return pool + codec + slots * acct.meta_bytes_per_slot + acct.fixed_bytes


def decide_precision(pos: Tensor, tiers: Tensor, conf: Tensor, length: int, prev_length: int,
                     cfg: TierConfig, acct: KVAccounting, target: int, prev_window: int | None,
                     base: int, frozen_end: int) -> Tensor:
    """New tiers [U, n] at ``length``. Slots [0, base) are a shared prefix, [base, frozen_end) frozen
    blocks; ``cfg.window`` is the effective recent window."""
    kept = chain_of(cfg)
    slot = torch.arange(tiers.shape[-1])[None, :].expand_as(tiers)
    rewritable = slot >= frozen_end
    alive = tiers != Tier.DISCARD
    prot = protected_mask(pos, length, cfg.sinks, cfg.window) & rewritable
    was_window = prev_length - (cfg.window if prev_window is None else prev_window)
    exiting = alive & ~prot & rewritable & (pos >= max(cfg.sinks, was_window))
    out = tiers.clone()
    if exiting.any():
        wanted = threshold_chain(conf, cfg)
        cum = [equal_count(exiting & (wanted <= j)) for j in range(len(kept))]
        per_tier = [c - p for c, p in zip(cum, [0] + cum[:-1], strict=True)]
        out = assign_chain(conf, out, exiting, per_tier, kept)
    cand = rewritable & ~prot & (out != Tier.DISCARD)
    counts = [equal_count(cand & (out == t)) for t in kept]
    n_prot = equal_count(prot & alive)
    bs = acct.block_size
    starts = list(range(base, frozen_end, bs))
    # Frozen blocks' chain tiers and mean confidences, and the candidates' confidence profile (best
    # first), read back as one list: the per-block reads were a tenth of a decision.
    masked = torch.where(cand, conf, torch.full_like(conf, -math.inf))
    profile = masked.sort(dim=-1, descending=True).values[:, :sum(counts)].mean(0)
    block_tiers = chain_index(out[0, base:frozen_end:bs], kept)
    block_means = conf[:, base:frozen_end].reshape(conf.shape[0], -1, bs).mean((0, 2))
    host = torch.cat([block_tiers.double(), block_means.double(), profile.double()]).tolist()
    nb = len(starts)
    frozen, block_conf = tuple(int(j) for j in host[:nb]), tuple(host[nb:2 * nb])

    def fits(c: list[int], blocks: list[int]) -> bool:
        tiers_of = [kept[j] if j < len(kept) else Tier.DISCARD for j in blocks]
        return held_bytes(acct, base, tiers_of, n_prot + c[0], c[1:], kept[1:]) <= target

    if fits(counts, list(frozen)):
        return out
    new_counts, new_frozen = walk(host[2 * nb:], counts, step_weights(cfg, acct), fits, block_conf, frozen,
                                  last_tier_cap(cfg, len(kept), bs))
    if new_counts != counts:
        out = assign_chain(conf, out, cand, new_counts, kept)
    for s, j, was in zip(starts, new_frozen, frozen, strict=True):
        if j != was:  # a frozen block holds one tier throughout
            out[:, s:s + bs] = kept[j] if j < len(kept) else Tier.DISCARD
    return out
