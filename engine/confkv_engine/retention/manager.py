"""``RetentionManager``: the engine-facing side of retention (one per engine and KV cache).

The engine (or a benchmark driving the cache directly) calls, per sequence:

1. ``new_state(params)`` when the sequence (re)starts: its ``RetentionState`` (None = full cache);
2. ``RetentionAttention.begin_step(..., states)`` / model forward / ``end_step`` as usual;
3. ``observe_logits(state, logits, first_position, successors)`` for the rows whose successors are
   known (sampling signal; skipped when the scorer does not use it);
4. ``after_step(seq_kv, state, num_computed)``: at decision points the policy runs and the
   sequence is compacted, freeing blocks in the same step.

Configuration comes from ``ConfKVSection`` (``from_section``), per request overridden by
``SamplingParams.kv_policy`` / ``kv_budget``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from confkv_api.config import ConfKVSection
from confkv_engine.attention.retention import score_pending
from confkv_engine.cache.kv_cache import KVCache, SeqKV
from confkv_engine.core.outputs import KVUsage
from confkv_engine.retention import scorer
from confkv_engine.retention.compaction import NullBlock, apply_tiers, held_bytes
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.runtime import RetentionState, accounting, decision_interval, shared_blocks
from confkv_engine.retention.tiers import TierConfig, budget_target, is_decision_point

# Pressure mode: the budget applies while fewer than this fraction of the pool's blocks are free.
PRESSURE_FREE_FRACTION = 0.1
# H2O ranks by the same normalised accumulated attention with its own best decay (tuning set).
H2O_DECAY = 0.999


def _peer_scorer(cfg: RetentionConfig) -> RetentionConfig:
    if cfg.policy == "h2o" and cfg.scorer.decay != H2O_DECAY:
        return replace(cfg, scorer=replace(cfg.scorer, decay=H2O_DECAY))
    return cfg


def config_from_section(section: ConfKVSection,
                        scorer_cfg: scorer.ScorerConfig | None = None) -> RetentionConfig:
    th = section.confidence_thresholds
    return _peer_scorer(RetentionConfig(
        policy=section.kv_policy,
        tiers=TierConfig(high=th.high, medium=th.medium, sinks=section.sinks, window=section.window),
        scorer=scorer_cfg or scorer.ScorerConfig(),
        budget=section.budget, budget_tokens=section.budget_tokens, budget_mode=section.budget_mode))


class RetentionManager:
    def __init__(self, cache: KVCache, num_q_heads: int, defaults: RetentionConfig,
                 prefill_chunk: int) -> None:
        spec = cache.spec
        self.cache = cache
        self.defaults = defaults
        self.group = num_q_heads // spec.num_kv_heads
        self.interval = decision_interval(spec.block_size, prefill_chunk)
        if defaults.policy != "full" and defaults.tiers.window < prefill_chunk:
            raise ValueError(f"the recent window ({defaults.tiers.window}) must hold a prefill chunk "
                             f"({prefill_chunk})")
        self.null = NullBlock(cache)
        self.blocks_freed = 0

    def apply_section(self, section: ConfKVSection) -> None:
        """Live policy update (thresholds, sinks, window, budget, mode, policy): new and restarted
        sequences use it; running ones keep the config they started with (their decisions so far
        were made under it and demotion is one-way)."""
        cfg = config_from_section(section, self.defaults.scorer)
        if cfg.policy != "full" and cfg.tiers.window < self.interval:
            raise ValueError(f"window ({cfg.tiers.window}) must hold a prefill chunk ({self.interval})")
        self.defaults = cfg

    def config_for(self, kv_policy: str | None = None, kv_budget: float | None = None) -> RetentionConfig:
        # One replace: the policy and the budget are checked together, so a request may bring the
        # budget that its policy needs (h2o, streaming) to a server started without one.
        changes: dict[str, object] = {}
        if kv_policy is not None:
            changes["policy"] = kv_policy
        if kv_budget is not None:
            changes.update(budget=kv_budget, budget_tokens=None)
        cfg = replace(self.defaults, **changes) if changes else self.defaults
        return _peer_scorer(cfg) if kv_policy is not None else cfg

    def reserve_blocks(self, cfg: RetentionConfig, max_len: int) -> int | None:
        """Pool blocks a sequence under ``cfg`` can ever hold up to ``max_len`` tokens, or None when
        its budget does not bind (no budget, or one no smaller than the full cache): admission
        reserves the budget, not the full length. The budget at ``max_len`` (it only grows with the
        length), in whole blocks, plus one prefill chunk (K and V) appended before the next decision,
        plus the shared null block for KEY_ONLY."""
        if cfg.policy == "full" or (cfg.budget is None and cfg.budget_tokens is None):
            return None
        acct = accounting(self.cache, cfg)
        protected = min(max_len, cfg.tiers.sinks + cfg.tiers.window)
        target = budget_target(acct, max_len, cfg.budget, cfg.budget_tokens, protected)
        bs, bb = self.cache.spec.block_size, self.cache.spec.block_bytes
        blocks = -(-target // bb) + 2 * self.interval // bs + (1 if cfg.uses_key_only else 0)
        return blocks if blocks < self.cache.blocks_for_tokens(max_len) else None

    def headroom(self, seq) -> int | None:
        """Blocks an engine ``Sequence`` may still take from its reservation (None: not reserved)."""
        params = seq.params
        cfg = self.config_for(params.kv_policy, params.kv_budget)
        reserved = self.reserve_blocks(cfg, seq.prompt_len + params.max_tokens)
        if reserved is None:
            return None
        held = len(seq.kv.k_blocks) + sum(1 for b in seq.kv.v_blocks if b != self.null.id)
        return max(0, reserved - held)

    def new_state(self, cfg: RetentionConfig) -> RetentionState | None:
        if cfg.policy == "full":
            return None
        spec = self.cache.spec
        return RetentionState(cfg=cfg, acct=accounting(self.cache, cfg), num_layers=spec.num_layers,
                              num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, group=self.group,
                              interval=self.interval)

    def prepare(self, seq) -> RetentionState | None:
        """The state of an engine ``Sequence`` about to run; a fresh one when it (re)starts at 0
        (first run, or replay after preemption: the replay recomputes every decision)."""
        if seq.num_computed == 0:
            params = seq.params
            seq.policy_state = self.new_state(self.config_for(params.kv_policy, params.kv_budget))
        return seq.policy_state

    def usage(self, seq) -> KVUsage:
        """Per-request ``usage``: peak pool bytes and tokens per tier (per (layer, KV head) unit)."""
        state: RetentionState | None = seq.policy_state
        if state is None:
            return KVUsage(peak_kv_bytes=seq.peak_kv_bytes, tokens_full=seq.num_computed)
        full, key_only, discarded = state.tier_counts(seq.num_computed)
        return KVUsage(peak_kv_bytes=max(seq.peak_kv_bytes, state.peak_bytes), tokens_full=full,
                       tokens_key_only=key_only, tokens_discarded=discarded)

    def align_for(self, seq) -> int:
        """Scheduler chunk alignment for an engine ``Sequence``: sequences under a retention policy
        cut their chunks at decision points (multiples of ``interval``), others at blocks."""
        policy = seq.params.kv_policy or self.defaults.policy
        return self.interval if policy != "full" else self.cache.spec.block_size

    def wants_logits(self, state: RetentionState | None) -> bool:
        return (state is not None and state.cfg.policy.startswith("conf-kv")
                and state.cfg.scorer.effective_weight > 0)

    def observe_logits(self, state: RetentionState, logits: Tensor, first_position: int,
                       successors: list[int]) -> None:
        """Row r of ``logits`` predicted the token at ``first_position + r`` (= ``successors[r]``)."""
        m = min(len(successors), logits.shape[0])
        if m == 0:
            return
        sig = scorer.sampling_signal(logits[:m], torch.tensor(successors[:m], device=logits.device))
        conf = scorer.sampling_confidence(sig, state.cfg.scorer.sampling_kind)
        state.on_sampling(first_position, conf.cpu().tolist())

    def under_pressure(self) -> bool:
        pool = self.cache.pool
        return pool.num_free < PRESSURE_FREE_FRACTION * pool.num_blocks

    def after_step(self, seq: SeqKV, state: RetentionState | None, num_computed: int) -> int:
        """Apply the policy when ``num_computed`` is a decision point; returns blocks freed."""
        if state is None:
            return 0
        state.peak_bytes = max(state.peak_bytes, self.held_bytes(seq, state))
        if is_decision_point(num_computed, self.interval):
            score_pending(self.cache, seq, state)  # before the policy reads the accumulators
        if shared_blocks(self.cache, seq, self.null.id):
            return 0  # prefix-cache rule: shared/hashed blocks are immutable
        new = state.decide(num_computed, self.under_pressure())
        if new is None:
            return 0
        freed = apply_tiers(self.cache, seq, state, new, self.null)
        self.blocks_freed += freed
        return freed

    def held_bytes(self, seq: SeqKV, state: RetentionState | None) -> int:
        return held_bytes(self.cache, seq, state, self.null)

    def tier_bytes(self, pairs: list[tuple[SeqKV, RetentionState | None]]) -> dict[str, int]:
        """Pool bytes by tier over running sequences: K blocks covering only KEY_ONLY slots count as
        key_only, every other block (and the null block) as full; metadata separately."""
        bs, bb = self.cache.spec.block_size, self.cache.spec.block_bytes
        out = {"full": 0, "key_only": 0, "metadata": 0}
        for seq, st in pairs:
            key_blocks = (st.n_key // bs) if st is not None else 0
            v_real = sum(1 for b in seq.v_blocks if b != self.null.id)
            out["key_only"] += key_blocks * bb
            out["full"] += (len(seq.k_blocks) - key_blocks + v_real) * bb
            out["metadata"] += st.metadata_bytes() if st is not None else 0
        if self.null.id is not None:
            out["full"] += bb
        return out
