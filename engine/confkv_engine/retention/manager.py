"""``RetentionManager``: the engine-facing side of retention (one per engine and KV cache).

The engine (or a benchmark driving the cache directly) calls, per sequence:

1. ``config_for(kv_policy, kv_budget)`` once, when the request is admitted: the config it keeps for
   its whole life (a live policy change never alters a running request's reservation or chunks);
2. ``new_state(config)`` when the sequence (re)starts: its ``RetentionState`` (None = full cache);
   ``RetentionAttention.begin_step(..., states)`` / model forward / ``end_step`` as usual;
3. ``observe_logits(state, logits, first_position, successors)`` for the rows whose successors are
   known (sampling signal; skipped when the scorer does not use it), or ``signal_values`` and
   ``record_values`` around one read-back (the engine's ``core.step_signal``, for a step's rows of
   every sequence together);
4. ``after_step(seq_kv, state, num_computed)``: at decision points the policy runs and the
   sequence is compacted, freeing blocks in the same step.

Configuration comes from ``ConfKVSection`` (``config_from_section``), per request overridden by
``SamplingParams.kv_policy`` / ``kv_budget``; the defaults change only through ``set_defaults``.
The manager is also the scheduler's ``AdmissionPolicy`` (reservations and chunk alignment).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch
from torch import Tensor

from confkv_api.config import ConfKVSection
from confkv_engine.cache.kv_cache import KVCache, SeqKV
from confkv_engine.cache.usage import KVUsage
from confkv_engine.retention import budget, scorer
from confkv_engine.retention.compaction import apply_precision, apply_tiers, held_bytes
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.runtime import HeadShards, RetentionState, accounting, decision_interval
from confkv_engine.retention.scoring import score_batch, score_pending
from confkv_engine.retention.tiers import TierConfig, budget_target, chain_from_names, is_decision_point

# Pressure mode: the budget applies while fewer than this fraction of the pool's blocks are free.
PRESSURE_FREE_FRACTION = 0.1
# H2O ranks by the same normalised accumulated attention with its own best decay (tuning set).
H2O_DECAY = 0.999


def _peer_scorer(cfg: RetentionConfig) -> RetentionConfig:
    if cfg.policy == "h2o" and cfg.scorer.decay != H2O_DECAY:
        return replace(cfg, scorer=replace(cfg.scorer, decay=H2O_DECAY))
    return cfg


def _enforcing(policy: str, budget: float | None, budget_tokens: int | None) -> str:
    """A budget needs a policy to enforce it: with the default ``full`` it is conf-kv's (a user who
    passes only ``--kv-budget`` expects the cache to shrink, not the flag to be ignored)."""
    return "conf-kv" if policy == "full" and (budget is not None or budget_tokens is not None) else policy


def retained_chunk(section: ConfKVSection, prefill_chunk: int) -> int:
    """The longest prefill chunk of a sequence under a retention policy (``decisionInterval``, capped
    by the engine's chunk): pass it as the manager's ``prefill_chunk``."""
    return min(prefill_chunk, section.decision_interval)


def config_from_section(section: ConfKVSection, interval: int,
                        scorer_cfg: scorer.ScorerConfig | None = None) -> RetentionConfig:
    """``interval``: the manager's decision interval, the minimal window when ``window`` is unset."""
    th = section.confidence_thresholds
    window = section.window if section.window is not None else interval
    key_only, precisions = chain_from_names(section.tiers)
    return _peer_scorer(RetentionConfig(
        policy=_enforcing(section.kv_policy, section.budget, section.budget_tokens),
        tiers=TierConfig(high=th.high, medium=th.medium, sinks=section.sinks, window=window,
                         key_only=key_only, precisions=precisions,
                         precision_group=section.compression.group_size,
                         precision_window=TierConfig.precision_window if section.window is None else window),
        scorer=scorer_cfg or scorer.ScorerConfig(),
        budget=section.budget, budget_tokens=section.budget_tokens, budget_mode=section.budget_mode,
        budget_basis=section.budget_basis))


class RetainedRequest(Protocol):
    """What the manager reads of an engine request (``core.sequence.Sequence``)."""

    kv: SeqKV
    retention: RetentionConfig | None
    num_computed: int
    prefix_len: int  # tokens served from the prefix cache when the request was first admitted
    policy_state: RetentionState | None

    @property
    def prompt_len(self) -> int: ...

    @property
    def max_len(self) -> int: ...


class RetentionManager:
    def __init__(self, cache: KVCache, num_q_heads: int, defaults: RetentionConfig,
                 prefill_chunk: int, shards: HeadShards | None = None) -> None:
        """``shards``: under tensor parallelism, this rank's share of the KV heads (decisions are
        made over every rank's; ``RetentionState.decide``)."""
        spec = cache.spec
        self.cache = cache
        self.shards = shards
        self.group = num_q_heads // spec.num_kv_heads
        self.interval = decision_interval(spec.block_size, prefill_chunk)
        self.check(defaults)
        self._defaults = defaults
        self.blocks_freed = 0

    def check(self, cfg: RetentionConfig) -> None:
        """Raise ValueError when the engine cannot run ``cfg``: the recent window must hold the
        tokens appended between two decisions (one prefill chunk, rounded up to whole blocks)."""
        if cfg.uses_precision and self.cache.kv.element_size() == 1:
            raise ValueError("precision tiers (int8/int4/k4v2/int2) need a bfloat16, float16 or float32 KV "
                             "cache: an int8 or fp8 pool holds codes already")
        # A precision chain's window may be shorter: a token leaving it is quantized first, and the
        # walk prices dropping it against every other token.
        if cfg.policy != "full" and not cfg.uses_precision and cfg.tiers.window < self.interval:
            raise ValueError(f"the recent window ({cfg.tiers.window}) must hold a prefill chunk "
                             f"({self.interval} tokens) when kvPolicy is {cfg.policy!r}")

    def interval_for(self, cfg: RetentionConfig) -> int:
        """Decision interval of a sequence under ``cfg``: the engine's, or a precision chain's own
        shorter one (``TierConfig.precision_interval``, whole blocks). Its prefill chunks are cut to
        it, so a replay after preemption decides at the same lengths."""
        own = cfg.tiers.precision_interval
        if not cfg.uses_precision or own is None:
            return self.interval
        return min(self.interval, decision_interval(self.cache.spec.block_size, own))

    @property
    def defaults(self) -> RetentionConfig:
        return self._defaults

    def set_defaults(self, cfg: RetentionConfig) -> None:
        """Live policy change: requests admitted from now on use ``cfg``; running ones keep theirs
        (their decisions so far were made under it and demotion is one-way)."""
        self.check(cfg)
        self._defaults = cfg

    def config_for(self, kv_policy: str | None = None, kv_budget: float | None = None,
                   kv_tiers: tuple[str, ...] | None = None) -> RetentionConfig:
        # One replace: the policy and the budget are checked together, so a request may bring the
        # budget that its policy needs (h2o, streaming) to a server started without one.
        changes: dict[str, object] = {}
        if kv_tiers is not None:
            key_only, precisions = chain_from_names(kv_tiers)
            changes["tiers"] = replace(self.defaults.tiers, key_only=key_only, precisions=precisions)
        if kv_policy is not None:
            changes["policy"] = kv_policy
        if kv_budget is not None:
            changes.update(budget=kv_budget, budget_tokens=None)
            if kv_policy is None:  # a request budget on a full-cache server: conf-kv enforces it
                changes["policy"] = _enforcing(self.defaults.policy, kv_budget, None)
        cfg = replace(self.defaults, **changes) if changes else self.defaults
        return _peer_scorer(cfg) if kv_policy is not None else cfg

    def reserve_blocks(self, cfg: RetentionConfig, max_len: int) -> int | None:
        """Pool blocks a sequence under ``cfg`` can ever hold up to ``max_len`` tokens, or None when
        its budget does not bind (no budget, or one no smaller than the full cache): admission
        reserves the budget, not the full length. A decision leaves room for the next interval
        (``RetentionState._room_for_next_chunk``, against the budget at each length up to the next
        decision), so the sequence holds at most the budget at
        ``max_len`` (it only grows with the length) or, where the floor binds, sinks + the minimal
        window + one interval; in whole blocks (the null block KEY_ONLY points at is the cache's,
        reserved at start; the retention metadata is counted in the bytes but is not pool memory)."""
        if cfg.policy == "full" or (cfg.budget is None and cfg.budget_tokens is None):
            return None
        acct = accounting(self.cache, cfg)
        protected = min(max_len, cfg.tiers.floor_tokens)
        target = budget_target(acct, max_len, cfg.budget, cfg.budget_tokens, protected)
        if cfg.schedule is not None:  # a scheduled budget may rise above the fixed one
            target = int(target * cfg.schedule.peak_factor)
        interval = self.interval_for(cfg)
        chunk = acct.held_bytes(interval, interval) - acct.fixed_bytes
        target = max(target, acct.held_bytes(protected, protected) + chunk)
        blocks = -(-target // self.cache.spec.block_bytes)
        return blocks if blocks < self.cache.blocks_for_tokens(max_len) else None

    def reserved_headroom(self, seq: RetainedRequest) -> int | None:
        """Blocks a request may still take from its reservation (None: not reserved)."""
        if seq.retention is None:
            return None
        reserved = self.reserve_blocks(seq.retention, seq.max_len)
        if reserved is None:
            return None
        # Pool blocks' worth of bytes: a frozen precision-tier block is a slot in a shared arena host
        # block, not a pool block of its own (counting it as one would hide the request's headroom).
        held = -(-self.cache.seq_bytes(seq.kv) // self.cache.spec.block_bytes)
        return max(0, reserved - held)

    def chunk_alignment(self, seq: RetainedRequest) -> int:
        """Requests under a retention policy cut their prefill chunks at decision points (multiples
        of ``interval``), so a replay after preemption decides at the same lengths; others at blocks."""
        full = seq.retention is None or seq.retention.policy == "full"
        return self.cache.spec.block_size if full else self.interval_for(seq.retention)

    def chunk_limit(self, seq: RetainedRequest) -> int | None:
        """Requests under a retention policy prefill one decision interval at a time, so the policy
        acts after every ``interval`` tokens and the budget holds within one chunk."""
        full = seq.retention is None or seq.retention.policy == "full"
        return None if full else self.interval_for(seq.retention)

    def new_state(self, cfg: RetentionConfig, shared_slots: int = 0, protect: int = 0,
                  max_len: int | None = None) -> RetentionState | None:
        """A fresh state. ``shared_slots``: the sequence's first slots, shared through the prefix cache
        (immutable); ``protect``: positions kept FULL (the prefix shared at first admission);
        ``max_len``: the request's final length (prompt + max_tokens), the final budget basis's."""
        if cfg.policy == "full":
            return None
        spec = self.cache.spec
        world = 1 if self.shards is None else self.shards.world
        return RetentionState(cfg=cfg, acct=accounting(self.cache, cfg, world), shards=self.shards,
                              num_layers=spec.num_layers,
                              num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, group=self.group,
                              interval=self.interval_for(cfg), base=shared_slots,
                              protect=max(protect, shared_slots), max_len=max_len)

    def prepare(self, seq: RetainedRequest) -> RetentionState | None:
        """The state of a request about to run; a fresh one when it (re)starts (first run, or replay
        after preemption, which drops the state: the replay recomputes every decision under the same
        config and the same protected prefix)."""
        if seq.policy_state is None and seq.retention is not None:
            seq.policy_state = self.new_state(seq.retention, seq.kv.num_slots, seq.prefix_len, seq.max_len)
        return seq.policy_state

    def usage(self, seq: RetainedRequest) -> KVUsage:
        """Per-request ``usage``: peak pool bytes and tokens per tier (per (layer, KV head) unit)."""
        state: RetentionState | None = seq.policy_state
        if state is None:
            return KVUsage(peak_kv_bytes=seq.peak_kv_bytes, tokens_full=seq.num_computed)
        full, key_only, discarded = state.tier_counts(seq.num_computed)
        precise = {f"tokens_{name}": n for name, n in state.precision_counts().items()}
        return KVUsage(peak_kv_bytes=max(seq.peak_kv_bytes, state.peak_bytes), tokens_full=full,
                       tokens_key_only=key_only, tokens_discarded=discarded,
                       effective_kv_budget=state.effective_budget(seq.num_computed), **precise)

    def wants_logits(self, state: RetentionState | None) -> bool:
        if state is None:
            return False
        return state.cfg.sampling_weight > 0 or state.cfg.schedule is not None

    def needs_spread(self, state: RetentionState | None) -> bool:
        """Whether ``state`` reads the entropy or the margin, not the realised token's probability alone
        (``scorer.sampling_signal``'s ``spread``)."""
        if state is None:
            return False
        schedule = state.cfg.schedule
        reads = {state.cfg.scorer.sampling_kind} | ({schedule.signal} if schedule is not None else set())
        return reads != {"surprise"}

    def signal_values(self, state: RetentionState, signal: scorer.SamplingSignal) -> Tensor:
        """What ``state`` keeps of rows of the sampling signal, on their device: [1, m] confidences,
        with the budget schedule's uncertainties as a second row when it has one ([2, m])."""
        rows = [scorer.sampling_confidence(signal, state.cfg.scorer.sampling_kind)]
        if state.cfg.schedule is not None:
            rows.append(budget.uncertainty(signal, state.cfg.schedule.signal))
        return torch.stack(rows)

    def record_values(self, state: RetentionState, first_position: int, values: list[list[float]]) -> None:
        """Record ``signal_values`` read back, the first column predicting the token at ``first_position``."""
        if not values or not values[0]:
            return
        state.on_sampling(first_position, values[0])
        if state.cfg.schedule is not None:
            state.schedule.observe(values[1])

    def observe_signal(self, state: RetentionState, signal: scorer.SamplingSignal,
                       first_position: int) -> None:
        """Record rows of the sampling signal, the first predicting the token at ``first_position``."""
        self.record_values(state, first_position, self.signal_values(state, signal).tolist())

    def observe_logits(self, state: RetentionState, logits: Tensor, first_position: int,
                       successors: list[int]) -> None:
        """Row r of ``logits`` predicted the token at ``first_position + r`` (= ``successors[r]``)."""
        m = min(len(successors), logits.shape[0])
        nxt = torch.tensor(successors[:m], device=logits.device)
        self.observe_signal(state, scorer.sampling_signal(logits[:m], nxt, self.needs_spread(state)),
                            first_position)

    def under_pressure(self) -> bool:
        return self.cache.num_free < PRESSURE_FREE_FRACTION * self.cache.num_blocks

    def score_decisions(self, items: list[tuple[SeqKV, RetentionState | None, int]]) -> None:
        """Fold the recorded attention of every sequence of a step that reaches a decision point
        (``(kv, state, num_computed after the step)``), waiting on the device once for all of them;
        ``after_step`` then finds nothing left to score."""
        due = [(seq, st) for seq, st, n in items if st is not None and is_decision_point(n, st.interval)]
        if due:
            score_batch(self.cache, due)

    def after_step(self, seq: SeqKV, state: RetentionState | None, num_computed: int) -> int:
        """Apply the policy when ``num_computed`` is a decision point; returns blocks freed."""
        if state is None:
            return 0
        state.peak_bytes = max(state.peak_bytes, self.held_bytes(seq, state))
        if is_decision_point(num_computed, state.interval):
            score_pending(self.cache, seq, state)  # before the policy reads them (none left when
            # the engine scored the step's decisions together: score_decisions)
        new = state.decide(num_computed, self.under_pressure())
        if new is None:
            return 0
        apply = apply_precision if state.cfg.uses_precision else apply_tiers
        freed = apply(self.cache, seq, state, new)
        self.blocks_freed += freed
        return freed

    def held_bytes(self, seq: SeqKV, state: RetentionState | None) -> int:
        return held_bytes(self.cache, seq, state)

    def tier_bytes(self, pairs: list[tuple[SeqKV, RetentionState | None]]) -> dict[str, int]:
        """Pool bytes by tier over running sequences: K blocks covering only KEY_ONLY slots count as
        key_only, frozen precision-tier blocks as compressed (their codec bytes), every other block as
        full; metadata separately."""
        bs, bb = self.cache.spec.block_size, self.cache.spec.block_bytes
        out = {"full": 0, "key_only": 0, "compressed": 0, "metadata": 0}
        for seq, st in pairs:
            key_blocks = (st.n_key // bs) if st is not None else 0
            frozen = range(st.base // bs, st.key_start // bs) if st is not None else range(0)
            codec = sum(self.cache.store.nbytes(t[i]) for t in (seq.k_blocks, seq.v_blocks) for i in frozen)
            out["key_only"] += key_blocks * bb
            out["compressed"] += codec
            out["full"] += (self.cache.held_blocks(seq) - key_blocks - 2 * len(frozen)) * bb
            out["metadata"] += st.metadata_bytes() if st is not None else 0
        return out
