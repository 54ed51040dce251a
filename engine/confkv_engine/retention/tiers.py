"""Tier decisions and budget enforcement: pure functions over per-unit slot tensors.

A *unit* is one (layer, KV head): each keeps its own token set, so tensors are [U, n] (n cached
slots per unit, absolute positions in ``pos``). Every unit holds the *same number* of slots per tier
(its own choice of tokens, a shared count): that keeps the pool rectangular, so a block holds the
same slot index for every unit and the bytes a sequence holds are exact whole blocks.

Rules:
- Sinks (first ``sinks`` positions) and the recent window (last ``window`` positions, window >= the
  prefill chunk) are always FULL.
- When a token leaves the window it is tiered once by its confidence: ``>= high`` FULL,
  ``[medium, high)`` KEY_ONLY, ``< medium`` DISCARD (KEY_ONLY disabled: ``>= medium`` stays FULL).
  Each unit applies the thresholds to its own confidences; the shared counts are the rounded means
  of the per-unit counts and each unit keeps its own highest-confidence tokens up to them.
- When the budget binds, the lowest-confidence token is demoted one tier at a time
  (FULL -> KEY_ONLY -> DISCARD); demotion is one-way (a tier never rises).
- Decisions happen only at block-aligned lengths (the caller's job; ``is_decision_point``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

from confkv_api.config import check_tiers


class Tier(IntEnum):
    FULL = 0
    KEY_ONLY = 1
    DISCARD = 2
    # Precision tiers (``precision``): K and V stored through the cache's codec at fewer bits.
    INT8 = 3
    INT4 = 4
    INT2 = 5
    K4V2 = 6  # keys at int4, values at int2: int2 keys are what this model does not tolerate


# Highest precision first (the order a chain must follow).
PRECISION_TIERS = {"int8": Tier.INT8, "int4": Tier.INT4, "k4v2": Tier.K4V2, "int2": Tier.INT2}
# (key bits, value bits) of each precision tier's codec.
TIER_BITS = {Tier.INT8: (8, 8), Tier.INT4: (4, 4), Tier.K4V2: (4, 2), Tier.INT2: (2, 2)}


@dataclass(frozen=True)
class KVAccounting:
    """Bytes a sequence holds in the pool, counted as the pool counts them.

    ``half_block_bytes``: one block of K (or of V) for all units (block_size x layers x KV heads x
    head_dim x element size). K and V are allocated separately: a sequence with ``n_k`` key slots
    of which the last ``n_v`` have values holds ceil(n_k/B) K blocks and the V blocks of the table
    entries that cover at least one value slot. ``meta_bytes_per_slot``
    (scores, positions, tiers for all units) and ``fixed_bytes`` (merged values; 0 for policies that
    keep none) are added on top.
    """

    block_size: int
    half_block_bytes: int
    meta_bytes_per_slot: int = 0
    fixed_bytes: int = 0
    # (tier, bytes of one K + V block pair at that precision, positions included), per precision tier
    pair_bytes: tuple[tuple[int, int], ...] = ()

    def tier_pair_bytes(self, tier: int) -> int:
        """Bytes of one K + V block pair of ``tier``: two pool blocks for FULL, the codec's otherwise."""
        if tier == Tier.FULL:
            return 2 * self.half_block_bytes
        for t, n in self.pair_bytes:
            if t == tier:
                return n
        raise ValueError(f"no byte cost known for tier {Tier(tier).name}")

    def blocks(self, n: int) -> int:
        return -(-n // self.block_size)

    def held_bytes(self, n_k: int, n_v: int) -> int:
        # KEY_ONLY slots are the first n_k - n_v K slots; only V-table entries covering nothing
        # but them are freed, so a partial block shared with FULL slots still holds V.
        v_blocks = self.blocks(n_k) - (n_k - n_v) // self.block_size
        data = (self.blocks(n_k) + v_blocks) * self.half_block_bytes
        return data + n_k * self.meta_bytes_per_slot + self.fixed_bytes

    def full_bytes(self, length: int) -> int:
        """What the full cache holds at ``length`` tokens (K and V blocks, no retention metadata)."""
        return 2 * self.blocks(length) * self.half_block_bytes


def chain_from_names(names: list[str] | tuple[str, ...]) -> tuple[bool, tuple[str, ...]]:
    """``confkv.tiers`` / ``kv_tiers`` (the kept tiers, highest first; DISCARD is implied) as
    (key_only, precisions) of a ``TierConfig``. Raises ValueError for a chain ``check_tiers`` refuses."""
    kept = check_tiers(list(names))[1:]
    return kept == ["key_only"], tuple(n for n in kept if n != "key_only")


GRANULARITIES = ("head", "layer", "token")
FREEZE_ORDERS = ("position", "confidence")


def share_confidence(conf: Tensor, granularity: str, heads: int) -> Tensor:
    """conf [U, n] with units ordered (layer, head): averaged so that every head of a layer
    ("layer") or every unit ("token") ranks its slots alike. Their slots hold the same positions
    in the same order as long as the sequence always used this granularity."""
    if granularity == "head" or conf.numel() == 0:
        return conf
    u, n = conf.shape
    if granularity == "layer":
        return conf.view(u // heads, heads, n).mean(1, keepdim=True).expand(-1, heads, -1).reshape(u, n)
    return conf.mean(0, keepdim=True).expand(u, n)


@dataclass(frozen=True)
class TierConfig:
    high: float = 0.9
    medium: float = 0.7
    sinks: int = 4
    # The minimal recent window: the served default (one 32-token decision interval).
    window: int = 32
    key_only: bool = True
    # The recent window grows to this fraction of the tokens the budget holds (0: fixed window;
    # 0.5 tuned on tokens [6144, 12288), see docs/notes/retention-journal.md).
    window_fraction: float = 0.5
    # Budget demotion order. None: the literal one-tier-at-a-time walk (KEY_ONLY, ranked below FULL
    # by the thresholds, is discarded first). A share s: the lowest FULL token goes to KEY_ONLY while
    # KEY_ONLY holds less than s of the kept candidates, otherwise the lowest KEY_ONLY is discarded.
    key_share: float | None = None
    # Who chooses its own tokens: every (layer, KV head) unit ("head"), every layer with its heads
    # alike ("layer", confidence averaged over the heads), or the sequence ("token", averaged over
    # all units). Measured in docs/retention.md (Granularity).
    granularity: str = "head"
    # Precision tiers between FULL and DISCARD, highest first (e.g. ("int4", "int2")); empty: the
    # FULL / KEY_ONLY / DISCARD chain. See ``precision``.
    precisions: tuple[str, ...] = ()
    # Relative loss of a token at int8 / int4 / k4v2 / int2 (FULL 0, DISCARD 1): what the budget walk
    # trades against bytes (``precision.step_weights``); tuned on tokens [6144, 12288) against a bf16
    # cache: int2 at 0.3 made int2 cheaper per byte than dropping, so the walk put nearly every token
    # at int2 (+4.9% at f = 0.25 where 0.5-0.9 gave -0.05%; see docs/notes/retention-journal.md). k4v2
    # sits between int4 and int2: 0.15 beat 0.05 in the int4, k4v2, int2 chain (0.1-0.3 decide alike);
    # losses measured per tier (every token at that tier, as a fraction of dropping every token: int4
    # ~0, k4v2 0.019, int2 0.08) put most tokens at int2 and lost on prose.
    precision_loss: tuple[float, float, float, float] = (0.002, 0.02, 0.15, 0.8)
    # Precision chain only: a token leaving the window with confidence below this goes straight to the
    # last precision tier; 0 (default): never, only the budget walk demotes past the first precision
    # tier (thresholds sending low-attention tokens to int2 with room to spare cost +1.8% at f = 0.125).
    last_tier_below: float = 0.0
    # Precision chain only (two precision tiers or more): the most the last tier (int2) may hold, as a
    # share of the tokens kept outside the window; the walk stops demoting into it at the cap and
    # drops instead. None: no cap. With int2 priced under ~0.42 of a drop the walk puts nearly every
    # token there, over it nearly none; the cap sets the share in between.
    last_tier_share: float | None = None
    # Precision chain only: the recent window's share of the tokens the budget holds (the FULL-only
    # chain's ``window_fraction``); 0: the minimal window, every other token is the walk's to price.
    precision_window_fraction: float = 0.0
    # Precision chain only: the minimal always-FULL recent window (None: ``window``, the other
    # chains' minimal one). It may be shorter than a decision interval: a token leaving it early is
    # quantized, and dropped only where the walk prices that lowest; the recent FULL tokens are a
    # third of a small budget's bytes (tuned on tokens [6144, 12288): docs/notes/retention-journal.md;
    # 16 first, then 8 with the quantized floor and the 16-token interval, then 2 with k4v2 in the chain,
    # on four tuning windows per text, at both budgets on both texts).
    precision_window: int | None = 2
    # Precision chain only: the recent tokens (after the sinks) whose FULL bytes the budget's floor
    # holds where f x full is below it (early in a sequence under a per-length budget); the walk
    # spends them on the FULL window and on older tokens at the precision tiers. None: the minimal
    # window (sinks + window FULL, every older token dropped there). 48 with the 16-token interval
    # below peaks at the FULL chains' floor (4 + 32 + 32 tokens' bytes) and won on the tuning text
    # at both budgets (docs/notes/retention-journal.md, "A quantized floor").
    precision_floor: int | None = 48
    # Precision chain only: its own decision interval (tokens; None: the engine's), capped by the
    # engine's and rounded up to whole blocks (``RetentionManager.interval_for``): decisions twice as
    # often leave room for half as many FULL tokens between them, at the price of prefilling a
    # budgeted sequence in chunks of this size. 16 won on the tuning text at both budgets.
    precision_interval: int | None = 16
    # Value group of the codec (keys: min(group, block_size)); the cache compression's groupSize.
    precision_group: int = 64
    # Precision chain only: which staged tokens of a tier fill its next frozen blocks, and in what
    # order: "position" (oldest first) or "confidence" (highest attention signal first, so a frozen
    # block holds tokens of like confidence and the lowest stay staged, individually droppable).
    freeze_order: str = "position"
    # Whether ``precisions`` apply (``chain``): the precision chain is conf-kv's alone, so
    # ``RetentionConfig`` turns it off for the other policies; the chain stays configured, and a
    # request that picks conf-kv on a server whose default is ``full`` or a peer gets it back.
    precise: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.medium < self.high <= 1.0:
            raise ValueError(f"need 0 <= medium < high <= 1, got medium={self.medium} high={self.high}")
        for name in ("precision_floor", "precision_interval"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sinks < 0 or min(self.window, self.min_window) < 1:
            raise ValueError(f"sinks must be >= 0 and the windows >= 1, got {self.sinks}, {self.window}, "
                             f"{self.precision_window}")
        if self.key_share is not None and not 0.0 < self.key_share < 1.0:
            raise ValueError(f"key_share must be in (0, 1), got {self.key_share}")
        if self.granularity not in GRANULARITIES:
            choices = ", ".join(GRANULARITIES)
            raise ValueError(f"granularity must be one of {choices}, got {self.granularity!r}")
        for name in ("window_fraction", "precision_window_fraction"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.freeze_order not in FREEZE_ORDERS:
            choices = ", ".join(FREEZE_ORDERS)
            raise ValueError(f"freeze_order must be one of {choices}, got {self.freeze_order!r}")
        if self.last_tier_share is not None and not 0.0 <= self.last_tier_share <= 1.0:
            raise ValueError(f"last_tier_share must be in [0, 1], got {self.last_tier_share}")
        if not 0.0 <= self.last_tier_below <= self.high:
            raise ValueError(f"need 0 <= last_tier_below <= high, got {self.last_tier_below}")
        self._check_precisions()

    def _check_precisions(self) -> None:
        unknown = [p for p in self.precisions if p not in PRECISION_TIERS]
        if unknown:
            choices = ", ".join(PRECISION_TIERS)
            raise ValueError(f"unknown precision tier {unknown[0]!r}; choose from {choices}")
        order = [list(PRECISION_TIERS).index(p) for p in self.precisions]
        if order != sorted(set(order)):
            raise ValueError(f"precision tiers must be distinct and highest first, got "
                             f"{list(self.precisions)}")
        loss = self.precision_loss
        increasing = all(0.0 < a < b < 1.0 for a, b in zip(loss, loss[1:], strict=False))
        if len(loss) != len(PRECISION_TIERS) or not increasing:
            raise ValueError(f"precision_loss ({', '.join(PRECISION_TIERS)}) must increase within (0, 1), "
                             f"got {loss}")

    @property
    def chain(self) -> tuple[str, ...]:
        """The precision tiers in force: ``precisions`` where they apply (``precise``), else none."""
        return self.precisions if self.precise else ()

    @property
    def uses_key_only(self) -> bool:
        """KEY_ONLY is the FULL / KEY_ONLY / DISCARD chain's; with precision tiers it is dominated (a
        KEY_ONLY token costs half a FULL one, more than int8 keeping its value: docs/retention.md)."""
        return self.key_only and not self.chain

    @property
    def min_window(self) -> int:
        """The minimal always-FULL recent window of this chain."""
        if self.chain and self.precision_window is not None:
            return self.precision_window
        return self.window

    @property
    def floor_tokens(self) -> int:
        """Tokens whose FULL bytes the budget's floor holds: the sinks and the minimal window, or for a
        precision chain with ``precision_floor`` that many recent tokens' bytes, spent by the walk on
        the FULL window and on older tokens at its precision tiers."""
        extra = self.precision_floor if self.chain and self.precision_floor is not None else 0
        return self.sinks + max(self.min_window, extra)

    def effective_window(self, budget_tokens: int, block_size: int) -> int:
        """The always-FULL recent window: the minimal one, or a block-aligned share of the budget."""
        fraction = self.precision_window_fraction if self.chain else self.window_fraction
        share = int(fraction * budget_tokens) // block_size * block_size
        return max(self.min_window, share)


def is_decision_point(length: int, interval: int) -> bool:
    """Policies act only when the length is a multiple of ``interval`` (a multiple of the block size)."""
    return length > 0 and length % interval == 0


def protected_mask(pos: Tensor, length: int, sinks: int, window: int) -> Tensor:
    return (pos < sinks) | (pos >= length - window)


def budget_target(
    acct: KVAccounting, length: int, fraction: float | None, tokens: int | None, protected_tokens: int
) -> int:
    """max(f x full bytes, bytes of sinks + window) in bytes; ``tokens`` budgets count full tokens."""
    floor = acct.held_bytes(protected_tokens, protected_tokens)
    if tokens is not None:
        return max(acct.full_bytes(tokens), floor)
    if fraction is None:  # no budget: everything the sequence can hold, metadata included
        return max(acct.held_bytes(length, length), floor)
    return max(int(fraction * acct.full_bytes(length)), floor)


def threshold_tiers(conf: Tensor, cfg: TierConfig) -> Tensor:
    tiers = torch.full_like(conf, Tier.DISCARD, dtype=torch.int8)
    if cfg.key_only:
        tiers[(conf >= cfg.medium) & (conf < cfg.high)] = Tier.KEY_ONLY
        tiers[conf >= cfg.high] = Tier.FULL
    else:
        tiers[conf >= cfg.medium] = Tier.FULL
    return tiers


def fit_counts(n_prot: int, n_full: int, n_key: int, target: int, acct: KVAccounting) -> tuple[int, int]:
    """Walk the demotion order until the sequence fits ``target`` bytes.

    The counts are shared by all units, so they follow the order of a unit whose KEY_ONLY tokens
    rank below its FULL ones (the thresholds' order): KEY_ONLY tokens are discarded first, then the
    lowest FULL goes to KEY_ONLY and, still lowest, is discarded next. Which tokens hold the counts
    is then decided per unit by confidence (``assign_by_rank``), so a unit whose KEY_ONLY token now
    outranks a FULL one demotes that FULL token instead, as the one-tier-at-a-time rule would.
    """
    def fits(f: int, k: int) -> bool:
        return acct.held_bytes(n_prot + f + k, n_prot + f) <= target

    if fits(n_full, n_key):
        return n_full, n_key
    for k in range(n_key - 1, -1, -1):
        if fits(n_full, k):
            return n_full, k
    # Counts now go (f, 0) -> (f-1, 1) -> (f-1, 0) -> ...: bytes shrink monotonically.
    for f in range(n_full - 1, -1, -1):
        if fits(f, 1):
            return f, 1
        if fits(f, 0):
            return f, 0
    return 0, 0


def fit_counts_shared(n_prot: int, n_full: int, n_key: int, target: int, acct: KVAccounting,
                      share: float) -> tuple[int, int]:
    """Demotion walk that keeps up to ``share`` of the kept candidates as KEY_ONLY (see TierConfig)."""
    f, k = n_full, n_key
    while acct.held_bytes(n_prot + f + k, n_prot + f) > target and f + k > 0:
        if f > 0 and (k == 0 or k < share * (f + k)):
            f, k = f - 1, k + 1
        else:
            k -= 1
    return f, k


def rank_desc(conf: Tensor, eligible: Tensor) -> Tensor:
    """Rank (0 = highest confidence) of each eligible slot within its unit; ineligible get n."""
    n = conf.shape[-1]
    key = torch.where(eligible, conf, torch.full_like(conf, -math.inf))
    order = key.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(n).expand_as(order).contiguous())
    return torch.where(eligible, ranks, torch.full_like(ranks, n))


def assign_by_rank(conf: Tensor, tiers: Tensor, eligible: Tensor, n_full: int, n_key: int) -> Tensor:
    """Per unit: keep FULL for the ``n_full`` best current-FULL slots, KEY_ONLY for the next ``n_key``
    (best of the rest of FULL and KEY_ONLY), DISCARD for the remaining eligible slots. One-way."""
    out = tiers.clone()
    full_rank = rank_desc(conf, eligible & (tiers == Tier.FULL))
    keep_full = full_rank < n_full
    rest = eligible & ~keep_full & (tiers != Tier.DISCARD)
    key_rank = rank_desc(conf, rest)
    out[eligible & ~keep_full] = Tier.DISCARD
    out[rest & (key_rank < n_key)] = Tier.KEY_ONLY
    out[keep_full] = Tier.FULL
    return out


def equal_count(mask: Tensor) -> int:
    """Shared per-unit count: the rounded mean over units of a per-unit count."""
    return int(round(mask.sum(-1).double().mean().item())) if mask.numel() else 0


def decide_tiers(
    pos: Tensor, tiers: Tensor, conf: Tensor, length: int, prev_length: int, cfg: TierConfig,
    acct: KVAccounting, target: int, prev_window: int | None = None,
) -> Tensor:
    """One conf-kv decision for [U, n] slots at ``length`` (last decision at ``prev_length``, when
    the window was ``prev_window``, default ``cfg.window``)."""
    prot = protected_mask(pos, length, cfg.sinks, cfg.window)
    alive = tiers != Tier.DISCARD
    was_window = prev_length - (cfg.window if prev_window is None else prev_window)
    exiting = alive & ~prot & (pos >= max(cfg.sinks, was_window))
    out = tiers.clone()
    if exiting.any():
        wanted = threshold_tiers(conf, cfg)
        e_full = equal_count(exiting & (wanted == Tier.FULL))
        e_key = equal_count(exiting & (wanted != Tier.DISCARD)) - e_full
        out = assign_by_rank(conf, out, exiting, e_full, e_key)
    cand = (out != Tier.DISCARD) & ~prot
    n_full = equal_count(cand & (out == Tier.FULL))
    n_key = equal_count(cand & (out == Tier.KEY_ONLY))
    n_prot = equal_count(prot & alive)
    if cfg.key_share is None or not cfg.key_only:
        f, k = fit_counts(n_prot, n_full, n_key, target, acct)
    else:
        f, k = fit_counts_shared(n_prot, n_full, n_key, target, acct, cfg.key_share)
    if (f, k) != (n_full, n_key):
        out = assign_by_rank(conf, out, cand, f, k)
    return out
