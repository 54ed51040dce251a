"""``RetentionAttention``: the paged backend plus what retention needs from attention.

The forward pass always runs the fused path of ``PagedAttention`` (``scaled_dot_product_attention``,
the same kernel the full cache and StreamingLLM use). Retention adds two things around it:

- **Attention signal, recomputed at decision points.** A fused kernel never materialises the
  probabilities, so a sequence under a scoring policy records its post-RoPE queries (a ring of at
  most one decision interval per layer, ``RetentionState.on_queries``). At the next decision point
  ``retention.scoring.score_pending`` recomputes ``softmax(q K^T)`` for those queries against the
  sequence's cached keys and folds them into the decayed accumulators. This is exact, not an
  approximation: nothing is evicted between two decision points, so the keys a recorded query saw
  are exactly the cached keys whose position is not after it, and the decay is applied per query
  position, so folding a whole interval at once equals folding query by query. The cost is one
  batched ``q K^T`` over ``interval`` queries per decision instead of a softmax at every step.
- **KEY_ONLY stand-in.** The values of a sequence's ``n_key`` KEY_ONLY slots (from ``key_start``,
  after its shared prefix and frozen precision-tier blocks, if any; their V-table
  entries point at the cache's null block) are replaced, in the gathered copy, by the unit's merged
  mean before the fused kernel runs, so the output is sum_FULL p_i v_i + (sum_KEY_ONLY p_j) v_mean
  with the exact softmax normalisation.

The ring holds ``interval x num_heads x head_dim`` activations per layer for each scoring
sequence (transient compute state, like the step's activations; it is not KV and is not counted
in the sequence's KV bytes).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from confkv_engine.attention.codes import CodesSplit, compacted
from confkv_engine.attention.paged import PagedAttention
from confkv_engine.attention.plans import DecodePlan, PrefillPlan
from confkv_engine.cache.kv_cache import KVCache, SeqKV


class RetainedSequence(Protocol):
    """What the backend needs of a sequence's retention state (``retention.runtime.RetentionState``)."""

    n_key: int  # slots [key_start, key_start + n_key) are KEY_ONLY (values stood in for by v_mean)
    v_mean: Tensor  # [L, Hkv, D] fp32 merged value of the KEY_ONLY tokens

    @property
    def key_start(self) -> int: ...

    @property
    def wants_probs(self) -> bool: ...

    def on_append(self, positions: Tensor) -> None: ...

    def on_queries(self, layer: int, q: Tensor) -> None: ...


class RetentionAttention(PagedAttention):
    def __init__(self, cache: KVCache, num_q_heads: int, max_gather_bytes: int | None = None,
                 in_place: bool | None = None, from_codes: bool | None = None,
                 native: bool | None = None) -> None:
        super().__init__(cache, num_q_heads, max_gather_bytes, in_place, from_codes, native)
        self._dec_states: list[RetainedSequence | None] = []
        self._states: list[RetainedSequence | None] = []

    def begin_step(self, seqs: list[SeqKV], num_new: list[int], positions: Tensor,
                   states: list[RetainedSequence | None] | None = None) -> None:
        states = states or [None] * len(seqs)
        self._states = states  # read by _key_only while the step is planned
        super().begin_step(seqs, num_new, positions)
        if any(st is not None for st in states):  # one read-back per step, and none without retention
            pos_cpu, start = positions.cpu(), 0
            for st, n in zip(states, num_new, strict=True):
                if st is not None:
                    st.on_append(pos_cpu[start:start + n])
                start += n
        self._dec_states = [states[i] for i in self.decode_index]
        self._states = states

    def _plain_values(self) -> bool:
        return all(st is None for st in self._states)

    def _attend_decode(self, layer: int, q: Tensor, plan: DecodePlan, window: int | None = None) -> Tensor:
        for i, st in enumerate(self._dec_states[plan.rows]):
            if st is not None and st.wants_probs:
                st.on_queries(layer, q[i:i + 1])
        return super()._attend_decode(layer, q, plan, window)

    def _attend_paged(self, layer: int, q: Tensor, window: int | None = None) -> Tensor:
        for i, st in enumerate(self._states):
            if st is not None and st.wants_probs:
                st.on_queries(layer, q[self.offsets[i]:self.offsets[i + 1]])
        return super()._attend_paged(layer, q, window)

    def _key_only(self) -> list[tuple[int, int]] | None:
        spans = [(st.key_start, st.n_key) if st is not None and st.n_key else (0, 0) for st in self._states]
        return spans if any(n for _, n in spans) else None

    def _stand_in(self, layer: int) -> Tensor | None:
        if not any(st is not None and st.n_key for st in self._states):
            return None
        spec = self.cache.spec
        out = torch.zeros(len(self._states), spec.num_kv_heads, spec.head_dim, device=self.cache.kv.device)
        for i, st in enumerate(self._states):
            if st is not None and st.n_key:
                out[i] = st.v_mean[layer].to(out)
        return out

    def _attend_prefill(self, layer: int, p: PrefillPlan, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._record_prefill(layer, p, q)
        return super()._attend_prefill(layer, p, q, k, v)

    def _attend_prefill_window(self, layer: int, p: PrefillPlan, q: Tensor, window: int) -> Tensor:
        self._record_prefill(layer, p, q)
        return super()._attend_prefill_window(layer, p, q, window)

    def _record_prefill(self, layer: int, p: PrefillPlan, q: Tensor) -> None:
        st = self._states[p.index]
        if st is not None and st.wants_probs:
            st.on_queries(layer, q)

    def _decode_values(self, layer: int, vals: Tensor, plan: DecodePlan) -> Tensor:
        bs = self.cache.spec.block_size
        for i, st in enumerate(self._dec_states[plan.rows]):
            if st is not None and st.n_key:
                start = plan.slot(i, st.key_start, bs)  # KEY_ONLY slots are pool slots, after the frozen ones
                vals[i, :, start:start + st.n_key] = st.v_mean[layer].to(vals)[:, None, :]
        return vals

    def _prefill_values(self, layer: int, p: PrefillPlan, vals: Tensor, split: CodesSplit | None) -> Tensor:
        st = self._states[p.index]
        if st is not None and st.n_key:
            bs = self.cache.spec.block_size
            start = st.key_start if split is None else compacted(split, 0, st.key_start, bs)
            vals[0, :, start:start + st.n_key] = st.v_mean[layer].to(vals)[:, None, :]
        return vals
