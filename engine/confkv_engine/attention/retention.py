"""``RetentionAttention``: the paged backend plus what retention needs from attention.

The forward pass always runs the fused path of ``PagedAttention`` (``scaled_dot_product_attention``,
the same kernel the full cache and StreamingLLM use). Retention adds two things around it:

- **Attention signal, recomputed at decision points.** A fused kernel never materialises the
  probabilities, so a sequence under a scoring policy records its post-RoPE queries (a ring of at
  most one decision interval per layer, ``RetentionState.on_queries``). At the next decision point
  ``score_pending`` recomputes ``softmax(q K^T)`` for those queries against the sequence's cached
  keys and folds them into the decayed accumulators. This is exact, not an approximation: nothing
  is evicted between two decision points, so the keys a recorded query saw are exactly the cached
  keys whose position is not after it, and the decay is applied per query position, so folding a
  whole interval at once equals folding query by query. The cost is one batched ``q K^T`` over
  ``interval`` queries per decision instead of a softmax materialised at every step.
- **KEY_ONLY stand-in.** The values of a sequence's first ``n_key`` slots (KEY_ONLY; their V-table
  entries point at the shared null block) are replaced, in the gathered copy, by the unit's merged
  mean before the fused kernel runs, so the output is sum_FULL p_i v_i + (sum_KEY_ONLY p_j) v_mean
  with the exact softmax normalisation.

The ring holds ``interval x num_heads x head_dim`` activations per layer for each scoring
sequence (transient compute state, like the step's activations; it is not KV and is not counted
in the sequence's KV bytes).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from confkv_engine.attention.paged import PagedAttention, _Prefill
from confkv_engine.cache.kv_cache import KVCache, SeqKV
from confkv_engine.retention.runtime import RetentionState


class RetentionAttention(PagedAttention):
    def __init__(self, cache: KVCache, num_q_heads: int) -> None:
        super().__init__(cache, num_q_heads)
        self._dec_states: list[RetentionState | None] = []
        self._pre_states: list[RetentionState | None] = []
        self._pre_index: dict[int, int] = {}

    def begin_step(self, seqs: list[SeqKV], num_new: list[int], positions: Tensor,
                   states: list[RetentionState | None] | None = None) -> None:
        super().begin_step(seqs, num_new, positions)
        states = states or [None] * len(seqs)
        pos_cpu = positions.cpu()
        start = 0
        for st, n in zip(states, num_new, strict=True):
            if st is not None:
                st.on_append(pos_cpu[start:start + n])
            start += n
        self._dec_states = [st for st, n in zip(states, num_new, strict=True) if n == 1]
        self._pre_states = [st for st, n in zip(states, num_new, strict=True) if n > 1]
        self._pre_index = {id(p): i for i, p in enumerate(self.prefills)}

    def _attend_decode(self, layer: int, q: Tensor) -> Tensor:
        for i, st in enumerate(self._dec_states):
            if st is not None and st.wants_probs:
                st.on_queries(layer, q[i:i + 1])
        return super()._attend_decode(layer, q)

    def _attend_prefill(self, layer: int, p: _Prefill, q: Tensor) -> Tensor:
        st = self._pre_states[self._pre_index[id(p)]]
        if st is not None and st.wants_probs:
            st.on_queries(layer, q)
        return super()._attend_prefill(layer, p, q)

    def _decode_values(self, layer: int, vals: Tensor) -> Tensor:
        for i, st in enumerate(self._dec_states):
            if st is not None and st.n_key:
                vals[i, :, : st.n_key] = st.v_mean[layer].to(vals)[:, None, :]
        return vals

    def _prefill_values(self, layer: int, p: _Prefill, vals: Tensor) -> Tensor:
        st = self._pre_states[self._pre_index[id(p)]]
        if st is not None and st.n_key:
            vals[0, :, : st.n_key] = st.v_mean[layer].to(vals)[:, None, :]
        return vals


def score_pending(cache: KVCache, seq: SeqKV, state: RetentionState) -> None:
    """Fold the queries recorded since the last decision into ``state``'s accumulators (see the
    module docstring for why this equals scoring every step). Call before the policy decides."""
    recorded = state.take_queries()
    if recorded is None:
        return
    queries, q_pos = recorded  # per layer [T, Hq, D]; [T]
    spec, dev = cache.spec, cache.kv.device
    hkv, d, g, n, t = spec.num_kv_heads, spec.head_dim, state.group, state.num_slots, q_pos.numel()
    idx = cache.slot_index(seq.k_blocks, torch.arange(n, device=dev))  # [n]
    hidden = state.pos.to(dev)[:, :, None, :] > q_pos.to(dev)[None, None, :, None]  # [L, Hkv, T, n]
    for layer, q in enumerate(queries):
        keys = cache.kv_flat[layer, idx].transpose(0, 1).float()  # [Hkv, n, D]
        qg = q.float().view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * t, d)
        scores = torch.bmm(qg, keys.transpose(1, 2)).view(hkv, g, t, n) / math.sqrt(d)
        probs = scores.masked_fill(hidden[layer][:, None], float("-inf")).softmax(-1).sum(1)  # [Hkv, T, n]
        state.on_attention(layer, probs, q_pos)
