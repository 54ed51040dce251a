"""Per-sequence retention state and the I/O that applies a policy to the paged cache.

``RetentionState`` mirrors, for each K slot of every unit (layer, KV head), the token's absolute
position, its tier and its attention accumulators, plus the per-position sampling confidence and
the per-unit merged value of KEY_ONLY tokens. The backend (``attention.retention``) records each
step's queries and ``scoring.score_pending`` feeds the attention probabilities of every layer at
decision points, where the manager's ``after_step`` then applies the policy and the cache rewrites
the sequence's slots.

Slot layout once KEY_ONLY exists (every unit has the same counts, so tables stay rectangular):
K slots ``[0, n_key)`` hold KEY_ONLY keys, ``[n_key, n)`` FULL keys (sinks and window included),
each region in position order; V slot s still belongs to K slot s, and the V-table entries that
cover only KEY_ONLY slots point at the cache's reserved *null block* instead of a real one.
Reads of those slots are replaced by the merged mean in the backend; writes never go there (new
tokens are appended at the end). So freeing a V block is just swapping its table entry for the
null block, and the pool's own counts stay exact.

Precision tiers (``precision``): slots ``[base, base + frozen)`` are whole blocks stored through the
compressed store (``cache.tiered``), one precision tier per block; KEY_ONLY (its own chain, never
with precision tiers) starts after them, at ``key_start``.

Where the state lives: the per-slot mirrors (positions, tiers, accumulators) are host tensors in
capacity-backed buffers (``slots.SlotColumns``), appended and rewritten in place and grown by
doubling, so a decode step copies nothing old; the recorded queries stay on the model's device in a
preallocated ring (``slots.QueryRing``). The device never waits on them inside the forward pass:
the backend reads a step's positions back once for every sequence, and at a decision step
``scoring.score_batch`` queues every sequence's attention probabilities into pinned host buffers and
waits once, feeding the host accumulators. The policy then runs on the host, on tensors of
``units x slots`` numbers, small next to the KV they govern (``units x slots x head_dim`` per K and V
on the device), and only its slot order goes back to the cache.

Prefix-cache rule: a prefix shared through the prefix cache is the immutable region ``[0, base)``;
retention decides and rewrites only the slots after it (``KVCache.rewrite`` refuses shared blocks),
so it only ever changes a request's private blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import Tensor

from confkv_engine.cache.kv_cache import KVCache
from confkv_engine.cache.tiered import tier_pair_bytes
from confkv_engine.retention import policies, scorer
from confkv_engine.retention.budget import ScheduleState
from confkv_engine.retention.policies import RetentionConfig, SlotView
from confkv_engine.retention.slots import PEAK_BYTES, QueryRing, SlotColumns
from confkv_engine.retention.tiers import (
    PRECISION_TIERS,
    TIER_BITS,
    KVAccounting,
    Tier,
    budget_target,
    is_decision_point,
)


def decision_interval(block_size: int, prefill_chunk: int) -> int:
    """Decisions at multiples of this (a multiple of the block size holding one prefill chunk)."""
    return -(-max(prefill_chunk, block_size) // block_size) * block_size


def accounting(cache: KVCache, cfg: RetentionConfig, shards: int = 1) -> KVAccounting:
    """Pool bytes of a sequence: K and V blocks (block_bytes includes the pool's position ints),
    plus this state's per-slot metadata and merged values (fp32), for every unit. ``shards``:
    the tensor-parallel degree, to count every rank's KV heads (the bytes TP = 1 would count)."""
    spec = cache.spec
    if shards > 1:
        spec = replace(spec, num_kv_heads=spec.num_kv_heads * shards)
    units = spec.num_layers * spec.num_kv_heads
    meta = units * (4 + 4 + 1) + 4 if cfg.policy != "streaming" else 0  # acc, norm, tier; c_samp
    if cfg.remembers:
        meta += units * PEAK_BYTES  # the remembered peak
    fixed = units * (spec.head_dim + 1) * 4 if cfg.uses_key_only else 0
    pairs = tuple((int(PRECISION_TIERS[p]), tier_pair_bytes(spec, TIER_BITS[PRECISION_TIERS[p]],
                                                            cfg.tiers.precision_group))
                  for p in cfg.tiers.chain)
    return KVAccounting(spec.block_size, spec.block_bytes, meta if cfg.policy != "full" else 0, fixed, pairs)


class HeadShards(Protocol):
    """This rank's share of the KV heads under tensor parallelism (``parallel.retention``)."""

    world: int

    def gather(self, x: Tensor) -> Tensor:
        """[L, h, n] on every rank -> [L, world * h, n], the same on every rank."""
        ...

    def local(self, x: Tensor) -> Tensor:
        """[L, world * h, n] -> this rank's [L, h, n]."""
        ...


@dataclass
class RetentionState:
    cfg: RetentionConfig
    acct: KVAccounting
    num_layers: int
    num_kv_heads: int
    head_dim: int
    group: int
    interval: int
    slots: SlotColumns = field(init=False)  # pos, tiers, acc, norm, peak per slot (see ``slots``)
    v_mean: Tensor = field(init=False)
    v_weight: Tensor = field(init=False)
    c_samp: list[float] = field(default_factory=list)
    last_query: list[int] = field(default_factory=list)
    prev_decision: int = 0
    n_key: int = 0
    peak_bytes: int = 0
    first_eviction: int | None = None  # length at the first decision that changed a tier
    prev_window: int | None = None  # recent window at the previous decision
    q_ring: QueryRing = field(init=False)  # per layer: queries since the last decision
    # Slots [0, base) hold a prefix shared through the prefix cache when the state was created:
    # immutable and never moved; KEY_ONLY slots are [base, base + n_key). Positions below ``protect``
    # (the prefix the request shared when it was first admitted; >= base) are always FULL: the
    # policies see them as sinks, so a replay that recomputes part of the prefix decides alike.
    base: int = 0
    protect: int = 0
    schedule: ScheduleState = field(default_factory=ScheduleState)  # the budget schedule's account
    frozen: int = 0  # slots [base, base + frozen): whole blocks of precision tiers (compressed)
    # Tensor parallelism: this rank holds some KV heads; decisions see every rank's (see ``decide``).
    shards: HeadShards | None = None
    max_len: int | None = None  # the request's final length (``RetentionConfig.budget_basis``)

    def __post_init__(self) -> None:
        self.slots = SlotColumns(self.num_layers, self.num_kv_heads, self.base, self.base + self.interval)
        if max(self.base, self.protect) > self.cfg.tiers.sinks:
            sinks = max(self.base, self.protect)
            self.cfg = replace(self.cfg, tiers=replace(self.cfg.tiers, sinks=sinks))
        self.v_mean = torch.zeros(self.num_layers, self.num_kv_heads, self.head_dim)
        self.v_weight = torch.zeros(self.num_layers, self.num_kv_heads)
        self.last_query = [-1] * self.num_layers
        self.q_ring = QueryRing(self.num_layers, self.interval)

    # Views of the first ``num_slots`` columns of the capacity-backed buffers: in-place writes
    # through them update the state; a rewrite of the slots goes through ``keep_slots``.
    @property
    def pos(self) -> Tensor:
        return self.slots.pos

    @property
    def tiers(self) -> Tensor:
        return self.slots.tiers

    @property
    def acc(self) -> Tensor:
        return self.slots.acc

    @property
    def norm(self) -> Tensor:
        return self.slots.norm

    @property
    def peak(self) -> Tensor:
        return self.slots.peak

    @property
    def num_slots(self) -> int:
        return self.slots.size

    def keep_slots(self, order: Tensor, tiers: Tensor | None = None) -> None:
        """Keep the slot columns ``order`` [L, Hkv, m] (per unit, in that order) of every mirror,
        taking the tiers from ``tiers`` (the new ones) when given (``SlotColumns.keep``)."""
        self.slots.keep(order, tiers)

    @property
    def key_start(self) -> int:
        """First KEY_ONLY slot: after the shared prefix and the frozen precision-tier blocks."""
        return self.base + self.frozen

    @property
    def wants_probs(self) -> bool:
        return self.cfg.scores_attention

    def may_register_hash(self) -> bool:
        """Prefix-cache rule: once a tier changed, the sequence's KV no longer depends on its tokens
        alone, so no block computed from then on may be registered under a token-only hash."""
        return self.first_eviction is None

    # ---- feeding ------------------------------------------------------------------------------
    def on_append(self, positions: Tensor) -> None:
        """New tokens (absolute ``positions`` [T], a host tensor: the backend reads a step's positions
        back once for every sequence) were appended to every unit as FULL."""
        self.slots.append(positions)
        if self.wants_probs:
            self.q_ring.add_positions(positions)

    def on_queries(self, layer: int, q: Tensor) -> None:
        """Post-RoPE queries [T, Hq, D] of this step at ``layer``, scored at the next decision."""
        self.q_ring.add(layer, q)

    def take_queries(self) -> tuple[list[Tensor], Tensor] | None:
        """The recorded queries (per layer [T, Hq, D], views of the ring: consume them before the
        next step records) and positions [T]; empties the ring."""
        return self.q_ring.take()

    def on_attention(self, layer: int, probs: Tensor, query_pos: Tensor) -> None:
        """probs [Hkv, T, S] (summed over the query heads of each KV head) for this layer, and the
        queries' positions [T], both on the host (as the accumulators)."""
        self.last_query[layer] = self._fold(layer, probs, query_pos, self.last_query[layer])

    def on_attention_layers(self, probs: Tensor, query_pos: Tensor) -> None:
        """``on_attention`` for every layer: probs [L, Hkv, T, S]. One fold over all layers when they
        have seen the same queries (always, as the engine records them), else layer by layer."""
        last = self.last_query[0]
        if not self.layers_agree:
            for layer in range(probs.shape[0]):
                self.on_attention(layer, probs[layer], query_pos)
            return
        self.last_query = [self._fold(slice(None), probs, query_pos, last)] * len(self.last_query)

    def _fold(self, layers: int | slice, probs: Tensor, query_pos: Tensor, last: int) -> int:
        """Fold probs into the accumulators (and the peak) of ``layers``; returns the new last query."""
        s, query_pos = probs.shape[-1], query_pos.long()
        m = scorer.attention_mass(probs, self.pos[layers, :, :s], query_pos,
                                  scorer.query_weights(query_pos, self.cfg.decay), self.peak_filter)
        return self._fold_mass(layers, m, query_pos, last)

    def _fold_mass(self, layers: int | slice, m: scorer.AttentionMass, query_pos: Tensor, last: int) -> int:
        s = m.mass.shape[-1]
        new = scorer.fold_mass(self.acc[layers, :, :s], self.norm[layers, :, :s], m, int(query_pos[-1]), last,
                               self.cfg.decay)
        if self.cfg.remembers:
            fade = self.cfg.scorer.memory_decay ** (new - last) if last >= 0 else 1.0
            scorer.raise_peak(self.peak[layers, :, :s], m, self.group, fade)
        return new

    @property
    def peak_filter(self) -> scorer.PeakFilter | None:
        """Which queries raise the remembered peak (None when the policy keeps none)."""
        sc = self.cfg.scorer
        return scorer.PeakFilter(sc.memory_distance, sc.memory_reach) if self.cfg.remembers else None

    @property
    def layers_agree(self) -> bool:
        """Whether every layer has folded the same queries (always, as the engine records them)."""
        return all(q == self.last_query[0] for q in self.last_query)

    def on_attention_mass(self, m: scorer.AttentionMass, query_pos: Tensor) -> None:
        """Fold a chunk's mass [L, Hkv, S] of every layer (``layers_agree`` must hold)."""
        if not self.layers_agree:
            raise ValueError("the layers have folded different queries: fold their probabilities in turn")
        new = self._fold_mass(slice(None), m, query_pos, self.last_query[0])
        self.last_query = [new] * len(self.last_query)

    def on_sampling(self, first_position: int, confidences: list[float]) -> None:
        """Sampling confidence of the tokens at ``first_position``, ``first_position + 1``..."""
        need = first_position + len(confidences)
        if len(self.c_samp) < need:
            self.c_samp.extend([scorer.NEUTRAL_SAMPLING] * (need - len(self.c_samp)))
        self.c_samp[first_position:need] = confidences

    # ---- accounting ---------------------------------------------------------------------------
    def metadata_bytes(self) -> int:
        return self.num_slots * self.acct.meta_bytes_per_slot + self.acct.fixed_bytes

    def tier_counts(self, num_computed: int) -> tuple[int, int, int]:
        """(FULL, KEY_ONLY, DISCARD) tokens per unit (the same in every unit); precision-tier tokens
        are not FULL (``precision_counts``)."""
        n = self.num_slots
        compressed = sum(self.precision_counts().values())
        return n - self.n_key - compressed, self.n_key, max(num_computed - n, 0)

    def precision_counts(self) -> dict[str, int]:
        """Tokens per unit at each precision tier (frozen and staged), by tier name."""
        row = self.tiers[0, 0] if self.tiers.numel() else self.tiers.reshape(-1)
        return {name: int((row == tier).sum()) for name, tier in PRECISION_TIERS.items()
                if name in self.cfg.tiers.chain}

    def frozen_block_tiers(self) -> list[int]:
        bs = self.acct.block_size
        return [int(self.tiers[0, 0, s]) for s in range(self.base, self.key_start, bs)]

    def _c_samp(self, length: int) -> Tensor:
        return torch.tensor(self.c_samp + [scorer.NEUTRAL_SAMPLING] * max(0, length - len(self.c_samp)))

    def _view(self, length: int) -> SlotView:
        """Units flattened: [L * Hkv, n] (policies see units, not layers and heads)."""
        c = self._c_samp(length)
        n = self.num_slots
        return SlotView(pos=self.pos.reshape(-1, n), tiers=self.tiers.reshape(-1, n),
                        acc=self.acc.reshape(-1, n), norm=self.norm.reshape(-1, n),
                        peak=self.peak.reshape(-1, n) if self.cfg.remembers else None,
                        c_samp=c[self.pos].reshape(-1, n), length=length, prev_length=self.prev_decision,
                        group=self.group, prev_window=self.prev_window, heads=self.num_kv_heads,
                        fixed=max(self.base, self.protect), base=self.base, frozen_end=self.key_start)

    def target_bytes(self, length: int, under_pressure: bool) -> int:
        cfg = self.cfg
        if cfg.budget_mode == "pressure" and not under_pressure:
            return budget_target(self.acct, length, None, None, 0)
        protected = min(length, cfg.tiers.floor_tokens)
        return budget_target(self.acct, self.basis_length(length), cfg.budget, cfg.budget_tokens, protected)

    def basis_length(self, length: int) -> int:
        """The length whose full cache a fractional budget is taken of (``budget_basis``)."""
        if self.cfg.budget_basis == "final" and self.max_len is not None:
            return max(length, self.max_len)
        return length

    def effective_budget(self, length: int) -> float | None:
        """What the budget allows at ``length`` (under pressure, if it waits for it) over the full
        cache's bytes at the basis length (``basis_length``): the requested fraction unless the floor
        raised it; None without a budget."""
        cfg = self.cfg
        if (cfg.budget is None and cfg.budget_tokens is None) or length <= 0:
            return None
        full = self.acct.full_bytes(self.basis_length(length))
        return round(self.target_bytes(length, under_pressure=True) / full, 4)

    def decision_target(self, length: int, under_pressure: bool) -> int:
        """What a decision at ``length`` fits the sequence into (before a budget schedule moves it):
        the budget, less the room for the next interval where a budget applies."""
        if not self._budgeted(under_pressure):
            return self.target_bytes(length, under_pressure)
        return self._room_for_next_chunk(length, under_pressure)

    def _budgeted(self, under_pressure: bool) -> bool:
        cfg = self.cfg
        budgeted = cfg.budget is not None or cfg.budget_tokens is not None
        return budgeted and (cfg.budget_mode == "always" or under_pressure)

    def _room_for_next_chunk(self, length: int, under_pressure: bool) -> int:
        """A decision leaves room for the interval appended before the next one, so the sequence
        never holds more than its budget (down to the floor of sinks + minimal window): the peak
        bytes a request reports and admission reserves are the budget itself, not budget + a chunk.
        The room is taken against the budget at each length the interval passes through, not at
        ``length``: after ``k`` appended tokens the sequence may hold the budget at ``length + k``,
        which grows with the length under a per-length budget (by ``f`` x a FULL token per token),
        so the decision keeps that growth instead of leaving it unused (tuning text, every cell:
        docs/notes/retention-journal.md, "Room against the budget ahead")."""
        fixed = self.acct.fixed_bytes
        room = min(self.target_bytes(length + k, under_pressure) - (self.acct.held_bytes(k, k) - fixed)
                   for k in range(self.interval + 1))
        protected = min(length, self.cfg.tiers.floor_tokens)
        return max(room, self.acct.held_bytes(protected, protected))

    def _schedules(self, under_pressure: bool) -> bool:
        """Whether the budget schedule sets this decision's target (it needs a budget that applies)."""
        cfg = self.cfg
        budgeted = cfg.budget is not None or cfg.budget_tokens is not None
        return cfg.schedule is not None and budgeted and (cfg.budget_mode == "always" or under_pressure)

    def _fixed_would_hold(self, fixed: int, length: int) -> int:
        """Bytes the fixed budget would hold after this decision: the whole tokens fitting ``fixed``,
        or all ``length`` tokens while they fit. The schedule's account is kept against this, so
        block rounding and a phase with nothing to evict are not savings, and a sequence that saved
        earlier (and so holds fewer tokens now) is still measured against the fixed budget."""
        n = min(policies.tokens_that_fit(fixed, self.acct), length)
        return self.acct.held_bytes(n, n)

    def _scheduled_target(self, fixed: int, reference: int, length: int) -> int:
        """The budget schedule's target (``retention.budget``) around the fixed one."""
        cfg = self.cfg
        if cfg.schedule is None:
            return fixed
        floor = self.acct.held_bytes(*(2 * [min(length, cfg.tiers.floor_tokens)]))
        return self.schedule.target(cfg.schedule, fixed, floor, reference)

    def _select(self, length: int, target: int) -> Tensor:
        """The policy's new tiers for this state's units. Under tensor parallelism the policy sees
        every rank's units (gathered; identical on all ranks, so each rank decides the same and keeps
        its own heads' part) and ``acct`` counts them all: the decision equals the one TP = 1 makes."""
        if self.shards is None:
            return policies.select(self._view(length), self.cfg, self.acct, target).view_as(self.tiers)
        cols = (self.pos, self.tiers, self.acc, self.norm, self.peak)
        pos, tiers, acc, norm, peak = (self.shards.gather(t) for t in cols)
        n, c = self.num_slots, self._c_samp(length)
        view = replace(self._view(length), heads=pos.shape[1], pos=pos.reshape(-1, n),
                       tiers=tiers.reshape(-1, n), acc=acc.reshape(-1, n), norm=norm.reshape(-1, n),
                       peak=peak.reshape(-1, n) if self.cfg.remembers else None, c_samp=c[pos].reshape(-1, n))
        new = policies.select(view, self.cfg, self.acct, target).view_as(tiers)
        return self.shards.local(new)

    def decide(self, length: int, under_pressure: bool = False) -> Tensor | None:
        """New tiers at a decision point, or None when nothing changes."""
        if self.cfg.policy == "full" or not is_decision_point(length, self.interval):
            return None
        fixed = self.decision_target(length, under_pressure)
        scheduled = self._schedules(under_pressure)
        reference = self._fixed_would_hold(fixed, length) if scheduled else fixed
        target = self._scheduled_target(fixed, reference, length) if scheduled else fixed
        new = self._select(length, target)
        limit = policies.window_limit(length, self.prev_decision, self.prev_window)
        self.prev_decision = length
        self.prev_window = self.cfg.recent_window(self.acct, target, limit)
        if scheduled:
            kept = int((new != Tier.DISCARD).sum(-1).flatten()[0])
            key_only = int((new == Tier.KEY_ONLY).sum(-1).flatten()[0])
            self.schedule.record(reference, self.acct.held_bytes(kept, kept - key_only))
        if torch.equal(new, self.tiers):
            return None
        if self.first_eviction is None:
            self.first_eviction = length
        return new
