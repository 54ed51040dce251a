"""``RetentionAttention``: the paged backend plus what retention needs from attention.

For a step whose sequences all run the full policy this is exactly ``PagedAttention`` (fused
``scaled_dot_product_attention``). For a sequence under a retention policy it computes the
softmax explicitly, which gives two things the fused kernel hides:

- the attention signal: the probabilities each cached key receives, summed over the query heads
  of its KV head, handed to the sequence's ``RetentionState`` for every layer and query;
- the KEY_ONLY stand-in: the values of the sequence's first ``n_key`` slots (KEY_ONLY, their V
  entries point at the null block) are replaced by the unit's merged mean before ``probs @ V``,
  so the output is sum_FULL p_i v_i + (sum_KEY_ONLY p_j) v_mean with the exact normalisation.

On GPU with a fused kernel (FlashAttention/SDPA never materialise probabilities) the signal would
be recomputed instead: at each decision point, one extra ``softmax(q K^T)`` over the last
``interval`` queries of the sequence (kept in a small per-sequence ring of post-RoPE queries), which
folds the same per-query decayed terms into the accumulators because decay is applied per query
position. That costs interval/decode-steps extra QK work, i.e. one decode step's attention per
query, and leaves the fused kernel untouched; the KEY_ONLY term is a rank-1 correction
(``lse``-weighted) added to the fused output. This CPU build takes the explicit path.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..kv_cache import KVCache, SeqKV
from ..paged_attention import PagedAttention, _Prefill
from .runtime import RetentionState


class RetentionAttention(PagedAttention):
    def __init__(self, cache: KVCache, num_q_heads: int) -> None:
        super().__init__(cache, num_q_heads)
        self._dec_states: list[RetentionState | None] = []
        self._pre_states: list[RetentionState | None] = []
        self._dec_pos: Tensor | None = None
        self._pre_pos: list[Tensor] = []

    def begin_step(self, seqs: list[SeqKV], num_new: list[int], positions: Tensor,
                   states: list[RetentionState | None] | None = None) -> None:
        super().begin_step(seqs, num_new, positions)
        states = states or [None] * len(seqs)
        offsets = [0]
        for n in num_new:
            offsets.append(offsets[-1] + n)
        pos_cpu = positions.cpu()
        for st, a, b in zip(states, offsets[:-1], offsets[1:], strict=True):
            if st is not None:
                st.on_append(pos_cpu[a:b])
        self._dec_states = [st for st, n in zip(states, num_new, strict=True) if n == 1]
        starts = offsets[:-1]
        dec_starts = [int(pos_cpu[a]) for a, n in zip(starts, num_new, strict=True) if n == 1]
        self._dec_pos = torch.tensor(dec_starts, dtype=torch.long)
        self._pre_states = [st for st, n in zip(states, num_new, strict=True) if n > 1]
        self._pre_pos = [pos_cpu[a:b] for a, b, n in zip(starts, offsets[1:], num_new, strict=True) if n > 1]
        self._pre_index = {id(p): i for i, p in enumerate(self.prefills)}

    @staticmethod
    def _active(st: RetentionState | None) -> bool:
        return st is not None and (st.wants_probs or st.n_key > 0)

    def _attend_decode(self, layer: int, q: Tensor) -> Tensor:
        if not any(self._active(s) for s in self._dec_states):
            return super()._attend_decode(layer, q)
        b, hq, d = q.shape
        blocks = self.cache.kv[layer]
        hkv = blocks.shape[2]
        keys = blocks.index_select(0, self.dec_k_table).view(b, self.dec_width, hkv, d).transpose(1, 2)
        vals = blocks.index_select(0, self.dec_v_table).view(b, self.dec_width, hkv, d).transpose(1, 2)
        vals = vals.float()
        for i, st in enumerate(self._dec_states):
            if st is not None and st.n_key:
                vals[i, :, : st.n_key] = st.v_mean[layer].to(vals.device)[:, None, :]
        if self.dec_lens_lh is None:
            mask = self.dec_mask
        else:
            slots = torch.arange(self.dec_width, device=q.device)
            lens = self.dec_lens_lh[:, layer, :]
            mask = self._additive(slots[None, None, :] < lens[..., None])[:, :, None, :]
        qg = q.view(b, hkv, self.group, d)[:, :, :, None, :]  # [B, Hkv, G, 1, D]
        out, probs = _explicit(qg, keys[:, :, None], vals[:, :, None], mask[:, :, None])
        for i, st in enumerate(self._dec_states):
            if st is not None and st.wants_probs:
                s = st.num_slots
                st.on_attention(layer, probs[i, :, :, :, :s].sum(1), self._dec_pos[i:i + 1])
        return out.reshape(b, hq, d).to(q.dtype)

    def _attend_prefill(self, layer: int, p: _Prefill, q: Tensor) -> Tensor:
        i = self._pre_index[id(p)]
        st = self._pre_states[i]
        if not self._active(st):
            return super()._attend_prefill(layer, p, q)
        t, hq, d = q.shape
        blocks = self.cache.kv[layer]
        hkv, g = blocks.shape[2], self.group
        keys = blocks.index_select(0, p.k_table).view(-1, hkv, d)[: p.ctx].transpose(0, 1)  # [Hkv, S, D]
        vals = blocks.index_select(0, p.v_table).view(-1, hkv, d)[: p.ctx].transpose(0, 1).float()
        if st.n_key:
            vals[:, : st.n_key] = st.v_mean[layer].to(vals.device)[:, None, :]
        mask = p.mask
        if mask is None:
            limit = p.before[layer][:, None] + torch.arange(t, device=q.device)[None, :]
            visible = torch.arange(p.ctx, device=q.device)[None, None, :] <= limit[..., None]
            mask = self._additive(visible).repeat(1, g, 1)[None]
        qg = q.view(t, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, T, D]
        m = mask[0].view(mask.shape[1], g, t, p.ctx)  # [1 or Hkv, G, T, ctx]
        out, probs = _explicit(qg, keys[:, None], vals[:, None], m)
        if st.wants_probs:
            st.on_attention(layer, probs.sum(1), self._pre_pos[i])
        return out.permute(2, 0, 1, 3).reshape(t, hq, d).to(q.dtype)


def _explicit(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """softmax(q k^T / sqrt(d) + mask) v in fp32; returns (out, probs). Broadcasts leading dims."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    probs = (scores + mask.float()).softmax(-1)
    return torch.matmul(probs, v), probs
