"""Paged attention on CPU without copying a context: the pool is read through views.

Per sequence, its table is cut into *pieces*: runs of consecutive blocks of one source (pool or
side), further cut where the KEY_ONLY range starts and ends and where the step's own slots begin.
Every piece is a strided view of the pool (no copy) that PyTorch's CPU flash kernel attends with
its log-sum-exp (``partial.attend_lse``: bf16 / fp16 accumulated in fp32, query heads grouped per KV
head so GQA reads K and V once); a KEY_ONLY piece contributes its log-sum-exp with the stand-in
as its output; the pieces combine exactly (``partial.combine``). The step's own slots of a prefill
chunk (at most the chunk's length) are read into a small tensor and attended with the causal kernel.

A sliding window is applied by starting the pieces at the first slot the query sees (decode); a
prefill chunk under a window is attended by the reference for that sequence (one copy of its
window), since a banded causal pattern has no mask-free CPU kernel.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor

from confkv_engine.attention import partial
from confkv_engine.attention.kernels.batch import PagedBatch
from confkv_engine.attention.kernels.reference import paged_attention_reference, read_slots

# (K source, K block, K block stride, V source, V block, V block stride, first slot, slots): whole
# blocks in arithmetic progression in both tables, or a part of one block.
Piece = tuple[int, int, int, int, int, int, int, int]
POOL, SIDE = 0, 1


def _source(blk: int, nb: int, has_side: bool) -> tuple[int, int]:
    return (SIDE, blk - nb) if blk >= nb and has_side else (POOL, blk)


def _runs(k_table: list[int], v_table: list[int], a: int, b: int, bs: int, nb: int,
          has_side: bool) -> list[Piece]:
    """Slots ``[a, b)`` as pieces: the longest runs of whole blocks whose K ids and V ids each step by
    a constant stride in one source (the engine reserves K and V blocks in pairs, so a chunk's K
    blocks are every other pool block), and parts of a block at the ends."""
    out: list[Piece] = []
    s = a
    while s < b:
        j = s // bs
        ks, kb = _source(k_table[j], nb, has_side)
        vs, vb = _source(v_table[j], nb, has_side)
        if s % bs or b - s < bs:
            end = min(b, (j + 1) * bs)
            out.append((ks, kb, 1, vs, vb, 1, s, end - s))
            s = end
            continue
        n, kst, vst = 1, 1, 1
        while (j + n + 1) * bs <= b:
            ks2, kb2 = _source(k_table[j + n], nb, has_side)
            vs2, vb2 = _source(v_table[j + n], nb, has_side)
            if n == 1:
                kst, vst = kb2 - kb, vb2 - vb
            if ks2 != ks or vs2 != vs or kst <= 0 or vst <= 0 or kb2 != kb + n * kst or vb2 != vb + n * vst:
                kst, vst = (kst, vst) if n > 1 else (1, 1)
                break
            n += 1
        out.append((ks, kb, kst, vs, vb, vst, s, n * bs))
        s += n * bs
    return out


def _plan(batch: PagedBatch, i: int, nb: int, has_side: bool) -> list[tuple[Piece, int]]:
    """Sequence ``i``'s pieces before its own slots, each with 1 if KEY_ONLY: the same in every
    layer, so computed once per step (kept in ``batch.memo``)."""
    key = ("cpu", i, nb, has_side, batch.window)
    if key not in batch.memo:
        n, tq, bs = int(batch.seq_lens[i]), int(batch.q_len[i]), batch.block_size
        lo = 0 if batch.window is None else max(0, n - batch.window)
        hi = n - tq if tq > 1 else n  # a decode row sees its own slot like any cached one
        ko = (int(batch.key_only[i, 0]), int(batch.key_only[i, 1]))
        k_table, v_table = batch.k_table[i].tolist(), batch.v_table[i].tolist()
        cuts = sorted({lo, hi, *(c for c in (ko[0], ko[0] + ko[1]) if lo < c < hi)}) if hi > lo else []
        batch.memo[key] = [(p, int(ko[1] > 0 and ko[0] <= a < ko[0] + ko[1]))
                           for a, b in zip(cuts, cuts[1:], strict=False)
                           for p in _runs(k_table, v_table, a, b, bs, nb, has_side)]
    return batch.memo[key]


def _read(source: Tensor, block: int, stride: int, first: int, n: int, bs: int) -> Tensor:
    """[nblk, Hkv, bs, D] (whole blocks ``block + k * stride``) or [1, Hkv, n, D] (part of a block):
    views, no copy."""
    if first % bs or n < bs:
        return source[block, first % bs:first % bs + n].transpose(0, 1)[None]
    st = source.stride()
    blocks = source.as_strided((n // bs, *source.shape[1:]), (stride * st[0], *st[1:]),
                               source.storage_offset() + block * st[0])
    return blocks.transpose(1, 2)


def _attend_pieces(qg: Tensor, pieces: list[tuple[Piece, int]], pool: Tensor, side: Tensor | None,
                   stand: Tensor | None, scale: float, bs: int) -> list[tuple[Tensor, Tensor]]:
    """qg [1, Hkv, G*T, D] against each piece: (out [1, Hkv, G*T, D], lse [1, Hkv, G*T]). A run of
    whole blocks is one batched call (one query copy per block, a broadcast view), its blocks
    combined by log-sum-exp."""
    sources = (pool, side)
    parts = []
    for (ks, kb, kst, vs, vb, vst, first, n), kind in pieces:
        keys = _read(cast(Tensor, sources[ks]), kb, kst, first, n, bs).to(qg.dtype)
        vals = keys if kind else _read(cast(Tensor, sources[vs]), vb, vst, first, n, bs).to(qg.dtype)
        out, lse = partial.attend_lse(qg.expand(keys.shape[0], -1, -1, -1), keys, vals, scale=scale)
        if keys.shape[0] > 1:
            total = torch.logsumexp(lse, 0, keepdim=True)
            out = (torch.exp(lse - total)[..., None] * out).sum(0, keepdim=True).to(qg.dtype)
            lse = total
        if kind and stand is not None:
            out = stand.to(qg.dtype)[None, :, None, :].expand_as(out)
        parts.append((out, lse))
    return parts


def _one(q: Tensor, pool: Tensor, side: Tensor | None, batch: PagedBatch, i: int,
         stand: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """Sequence ``i``'s rows: (out [T, Hq, D], lse [T, Hq])."""
    hkv, d = pool.shape[2], pool.shape[3]
    tq = int(batch.q_len[i])
    g = q.shape[1] // hkv
    qg = q.view(tq, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * tq, d)
    parts = _attend_pieces(qg, _plan(batch, i, pool.shape[0], side is not None), pool, side, stand, scale,
                           batch.block_size)
    if parts:
        merged = (partial.combine(parts) if len(parts) > 1 else parts[0][0],
                  torch.logsumexp(torch.stack([lse for _, lse in parts]), 0))
        parts = [(merged[0].view(hkv, g, tq, d).permute(2, 0, 1, 3).reshape(tq, hkv * g, d),
                  merged[1].view(hkv, g, tq).permute(2, 0, 1).reshape(tq, hkv * g))]
    if tq > 1:  # the chunk's own slots, causal
        parts.append(_own(q, pool, side, batch, i, stand, scale))
    if len(parts) == 1:
        return parts[0]
    return partial.combine(parts), torch.logsumexp(torch.stack([lse for _, lse in parts]), 0)


def _own(q: Tensor, pool: Tensor, side: Tensor | None, batch: PagedBatch, i: int,
         stand: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """A prefill chunk against its own slots (read: at most the chunk), causal."""
    n, tq = int(batch.seq_lens[i]), int(batch.q_len[i])
    g, cached = q.shape[1] // pool.shape[2], n - tq
    ko = (int(batch.key_only[i, 0]), int(batch.key_only[i, 1]))
    keys = read_slots(pool, side, batch.k_table[i], n)[cached:].to(q.dtype)
    vals = read_slots(pool, side, batch.v_table[i], n)[cached:].to(q.dtype)
    slots = torch.arange(cached, n)
    own_ko = (slots >= ko[0]) & (slots < ko[0] + ko[1])
    if stand is not None and bool(own_ko.any()):
        vals[own_ko] = stand.to(q.dtype)
    kh, vh = (x.repeat_interleave(g, dim=1).transpose(0, 1)[None] for x in (keys, vals))
    out, lse = partial.attend_lse(q.transpose(0, 1)[None], kh, vh, causal=True, scale=scale)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def paged_attention_cpu(q: Tensor, pool: Tensor, batch: PagedBatch, side: Tensor | None = None,
                        stand_in: Tensor | None = None,
                        scale: float | None = None, window: int | None = None) -> tuple[Tensor, Tensor]:
    """``PagedKernel`` on CPU: out [T, Hq, D] in q's dtype, lse [T, Hq] fp32."""
    batch = batch.with_window(window)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    outs, lses = [], []
    for i in range(batch.num_seqs):
        start, tq = int(batch.q_start[i]), int(batch.q_len[i])
        if batch.window is not None and tq > 1:
            one = PagedBatch(batch.k_table[i:i + 1], batch.v_table[i:i + 1], batch.seq_lens[i:i + 1],
                             torch.zeros(1, dtype=torch.int32), batch.q_len[i:i + 1], batch.key_only[i:i + 1],
                             tq, batch.block_size, batch.window)
            out, lse = paged_attention_reference(q[start:start + tq], pool, one, side,
                                                 None if stand_in is None else stand_in[i:i + 1], scale)
        else:
            out, lse = _one(q[start:start + tq], pool, side, batch, i,
                            None if stand_in is None else stand_in[i], scale)
        outs.append(out.to(q.dtype))
        lses.append(lse.float())
    return torch.cat(outs), torch.cat(lses)
