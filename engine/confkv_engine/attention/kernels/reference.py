"""The reference paged attention: per sequence, gather its slots into a dense copy and compute the
softmax explicitly in fp32. Slow and simple on purpose; the kernels are tested against it."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from confkv_engine.attention.kernels.batch import PagedBatch


def read_slots(pool: Tensor, side: Tensor | None, table: Tensor, n: int) -> Tensor:
    """Slots ``[0, n)`` of one table: [n, Hkv, D] (a copy)."""
    nb, bs = pool.shape[0], pool.shape[1]
    ids = table[: -(-n // bs)].long()
    rows = [side[i - nb] if i >= nb and side is not None else pool[i] for i in ids.tolist()]
    return torch.stack(rows).flatten(0, 1)[:n]


def paged_attention_reference(q: Tensor, pool: Tensor, batch: PagedBatch, side: Tensor | None = None,
                              stand_in: Tensor | None = None,
                              scale: float | None = None, window: int | None = None) -> tuple[Tensor, Tensor]:
    """``PagedKernel`` by gathering: out [T, Hq, D] in q's dtype, lse [T, Hq] fp32."""
    batch = batch.with_window(window)
    t_all, hq, d = q.shape
    hkv = pool.shape[2]
    g = hq // hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros(t_all, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((t_all, hq), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(batch.num_seqs):
        n, start, tq = (int(batch.seq_lens[i]), int(batch.q_start[i]), int(batch.q_len[i]))
        keys = read_slots(pool, side, batch.k_table[i], n).float()  # [n, Hkv, D]
        vals = read_slots(pool, side, batch.v_table[i], n).to(q.dtype).float()
        ko_start, ko_count = (int(x) for x in batch.key_only[i])
        if ko_count and stand_in is not None:
            vals[ko_start:ko_start + ko_count] = stand_in[i].to(q.dtype).float()[None]
        qi = q[start:start + tq].float().view(tq, hkv, g, d)
        scores = torch.einsum("thgd,shd->thgs", qi, keys) * scale
        qpos = n - tq + torch.arange(tq, device=q.device)
        slots = torch.arange(n, device=q.device)
        visible = slots[None, :] <= qpos[:, None]
        if batch.window is not None:
            visible &= slots[None, :] > qpos[:, None] - batch.window
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, -1)  # [tq, Hkv, G]
        probs = torch.exp(scores - row_lse[..., None])
        out[start:start + tq] = torch.einsum("thgs,shd->thgd", probs, vals).reshape(tq, hq, d)
        lse[start:start + tq] = row_lse.reshape(tq, hq)
    return out.to(q.dtype), lse
