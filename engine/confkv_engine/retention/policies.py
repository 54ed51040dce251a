"""Retention policies as selection functions on the same inputs, selectable by name.

Every policy sees a ``SlotView`` of one sequence at a decision point (units = (layer, KV head)
pairs, ``[U, n]`` slot tensors) and returns the new tier of every slot. They differ only in how
they choose; the budget target (bytes) and the accounting are shared, so peers are compared at
the same byte budgets:

- ``full``: keeps everything.
- ``streaming`` (StreamingLLM): the ``sinks`` first tokens plus the most recent tokens that fit.
- ``h2o`` (Heavy-Hitter Oracle): per unit, half of the tokens that fit are the most recent, the
  other half the heavy hitters by normalised accumulated attention (``scorer.attention_signal``).
- ``conf-kv``: confidence tiers (``tiers.decide_tiers``); ``conf-kv-discard`` is the same with the
  KEY_ONLY tier disabled (the benchmark's "conf-kv without KEY_ONLY"). With precision tiers
  configured (``TierConfig.precisions``) conf-kv chooses each token's precision instead
  (``precision.decide_precision``); the peers ignore them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from confkv_engine.retention import scorer
from confkv_engine.retention.budget import BudgetSchedule
from confkv_engine.retention.precision import decide_precision
from confkv_engine.retention.tiers import KVAccounting, Tier, TierConfig, decide_tiers, share_confidence

POLICY_NAMES = ("full", "streaming", "h2o", "conf-kv", "conf-kv-discard")
BUDGET_BASES = ("final", "length")


@dataclass(frozen=True)
class RetentionConfig:
    """What a sequence's retention does. ``budget``: fraction of the full cache's bytes;
    ``budget_tokens``: bytes of that many full tokens; neither: no budget (thresholds only).

    ``budget_basis``: the length whose full cache ``budget`` is a fraction of. "final" (default): the
    request's final length, prompt + max_tokens, at every step: the bytes admission reserves for it
    (``RetentionManager.reserve_blocks``), which it may hold from its first token. "length": the
    current length, so a sequence holds ``budget`` x what it has so far and the rest of its
    reservation sits unused until it grows (the basis of the tuning tables; docs/retention.md,
    "Budget basis"). A state that does not know its final length (the offline drivers) takes the
    current one."""

    policy: str = "full"
    tiers: TierConfig = field(default_factory=TierConfig)
    scorer: scorer.ScorerConfig = field(default_factory=scorer.ScorerConfig)
    budget: float | None = None
    budget_tokens: int | None = None
    budget_mode: str = "always"
    budget_basis: str = "final"
    # Per-decision budget from the model's uncertainty (None: the fixed budget). Only acts with a
    # budget; see ``retention.budget``.
    schedule: BudgetSchedule | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown kv policy {self.policy!r}; choose one of {', '.join(POLICY_NAMES)}")
        if self.budget is not None and not 0 < self.budget <= 1:
            raise ValueError(f"kv budget must be in (0, 1], got {self.budget}")
        if self.budget is not None and self.budget_tokens is not None:
            raise ValueError("set at most one of budget and budget_tokens")
        if self.budget_mode not in ("always", "pressure"):
            raise ValueError(f"budget mode must be 'always' or 'pressure', got {self.budget_mode!r}")
        if self.budget_basis not in BUDGET_BASES:
            choices = ", ".join(BUDGET_BASES)
            raise ValueError(f"budget basis must be one of {choices}, got {self.budget_basis!r}")
        if self.policy in ("streaming", "h2o") and self.budget is None and self.budget_tokens is None:
            raise ValueError(f"kv policy {self.policy!r} needs a budget (kv_budget or kv_budget_tokens)")
        precise = self.policy.startswith("conf-kv")
        if self.tiers.precise != precise:
            # The precision chain (conf-kv's default tiers) is conf-kv's alone: the other policies keep
            # their own minimal window and floor (``TierConfig.min_window`` / ``floor_tokens`` read
            # ``chain``); the tiers stay configured for a request that switches to conf-kv.
            object.__setattr__(self, "tiers", replace(self.tiers, precise=precise))

    @property
    def scores_attention(self) -> bool:
        return self.policy == "h2o" or (self.policy.startswith("conf-kv") and self.sampling_weight < 1.0)

    @property
    def sampling_weight(self) -> float:
        """conf-kv's weight of the sampling signal: the precision chain's own, else the scorer's mode's
        (0 for the peers, which never read it)."""
        if not self.policy.startswith("conf-kv"):
            return 0.0
        return self.scorer.precision_sampling_weight if self.uses_precision else self.scorer.effective_weight

    @property
    def remembers(self) -> bool:
        """conf-kv keeping each token's remembered attention peak (``ScorerConfig.memory``)."""
        return self.policy.startswith("conf-kv") and self.scores_attention and self.scorer.memory > 0

    @property
    def uses_key_only(self) -> bool:
        return self.policy == "conf-kv" and self.tiers.uses_key_only

    @property
    def uses_precision(self) -> bool:
        """conf-kv choosing precisions (int8/int4/k4v2/int2) besides FULL and DISCARD."""
        return bool(self.tiers.chain)  # ``chain`` is empty under every other policy (__post_init__)

    @property
    def scale(self) -> float:
        """The attention confidence's scale: the precision chain's own, else the scorer's."""
        return self.scorer.precision_scale if self.uses_precision else self.scorer.scale

    @property
    def decay(self) -> float:
        """The attention signal's decay per query position: the precision chain's own, else the scorer's."""
        return self.scorer.precision_decay if self.uses_precision else self.scorer.decay

    def recent_window(self, acct: KVAccounting, target: int, limit: int | None = None) -> int:
        """conf-kv's always-FULL window: grows with the budget when one is set (window_fraction).
        ``limit`` (``window_limit``) keeps its start from moving back over tokens already tiered."""
        if self.budget is None and self.budget_tokens is None:
            return self.tiers.min_window
        window = self.tiers.effective_window(tokens_that_fit(target, acct), acct.block_size)
        return window if limit is None else min(window, limit)


@dataclass
class SlotView:
    """One sequence at a decision point. pos/tiers/acc/norm/c_samp (and peak) are [U, n]."""

    pos: Tensor
    tiers: Tensor
    acc: Tensor
    norm: Tensor
    c_samp: Tensor
    length: int
    prev_length: int
    group: int
    prev_window: int | None = None
    heads: int = 1  # KV heads per layer (units are ordered layer-major)
    fixed: int = 0  # positions below this are a shared prefix: kept FULL whatever the policy
    base: int = 0  # slots [0, base) hold the shared prefix
    frozen_end: int = 0  # slots [base, frozen_end) are frozen precision-tier blocks
    peak: Tensor | None = None  # the remembered attention (``scorer.update_peak``), when conf-kv keeps it


def window_limit(length: int, prev_length: int, prev_window: int | None) -> int | None:
    """Largest window whose start is not before the previous decision's: tokens that left the window
    were tiered once, unit by unit, and must not become protected again (a target that jumps up,
    as a budget schedule's or pressure mode's can, would otherwise pull them back in)."""
    return None if prev_window is None else prev_window + length - prev_length


def tokens_that_fit(target: int, acct: KVAccounting) -> int:
    """Most FULL tokens whose K and V blocks (and metadata) fit ``target`` bytes."""
    per_block = 2 * acct.half_block_bytes + acct.block_size * acct.meta_bytes_per_slot
    n = max(0, (target - acct.fixed_bytes) // per_block) * acct.block_size
    while acct.held_bytes(n + 1, n + 1) <= target:
        n += 1
    return n


def select_full(view: SlotView, cfg: RetentionConfig, acct: KVAccounting, target: int) -> Tensor:
    return view.tiers.clone()


def select_streaming(view: SlotView, cfg: RetentionConfig, acct: KVAccounting, target: int) -> Tensor:
    n_keep = tokens_that_fit(target, acct)
    recent = max(n_keep - cfg.tiers.sinks, 0)
    keep = (view.pos < cfg.tiers.sinks) | (view.pos >= view.length - recent)
    return _discard_rest(view.tiers, keep)


def select_h2o(view: SlotView, cfg: RetentionConfig, acct: KVAccounting, target: int) -> Tensor:
    n_keep = tokens_that_fit(target, acct)
    recent = n_keep // 2
    is_recent = (view.pos >= view.length - recent) | (view.pos < view.fixed)
    alive = view.tiers != Tier.DISCARD
    heavy_n = n_keep - int(is_recent[0].sum()) if is_recent.numel() else 0
    att = scorer.attention_signal(view.acc, view.norm)
    score = torch.where(alive & ~is_recent, att, torch.full_like(att, -1.0))
    keep = is_recent.clone()
    if heavy_n > 0:
        top = score.topk(min(heavy_n, score.shape[-1]), dim=-1).indices
        keep.scatter_(-1, top, True)
    return _discard_rest(view.tiers, keep & alive)


def select_conf_kv(view: SlotView, cfg: RetentionConfig, acct: KVAccounting, target: int) -> Tensor:
    conf = scorer.confidence(view.acc, view.norm, view.c_samp, view.length, view.group, cfg.scorer, view.peak,
                             scale=cfg.scale, weight=cfg.sampling_weight)
    conf = share_confidence(conf, cfg.tiers.granularity, view.heads)
    if cfg.uses_precision:
        return decide_precision(view.pos, view.tiers, conf, view.length, view.prev_length,
                                replace(cfg.tiers, window=cfg.recent_window(acct, target)), acct, target,
                                view.prev_window, view.base, view.frozen_end)
    key_only = cfg.tiers.key_only and cfg.policy == "conf-kv"
    limit = window_limit(view.length, view.prev_length, view.prev_window)
    tier_cfg = replace(cfg.tiers, window=cfg.recent_window(acct, target, limit), key_only=key_only)
    return decide_tiers(view.pos, view.tiers, conf, view.length, view.prev_length, tier_cfg, acct, target,
                        view.prev_window)


def _discard_rest(tiers: Tensor, keep: Tensor) -> Tensor:
    out = tiers.clone()
    out[~keep] = Tier.DISCARD
    return out


Selector = Callable[[SlotView, RetentionConfig, KVAccounting, int], Tensor]
SELECTORS: dict[str, Selector] = {
    "full": select_full,
    "streaming": select_streaming,
    "h2o": select_h2o,
    "conf-kv": select_conf_kv,
    "conf-kv-discard": select_conf_kv,
}


def select(view: SlotView, cfg: RetentionConfig, acct: KVAccounting, target: int) -> Tensor:
    """New tiers [U, n] for the policy named in ``cfg`` (DISCARD = free the slot)."""
    return SELECTORS[cfg.policy](view, cfg, acct, target)
