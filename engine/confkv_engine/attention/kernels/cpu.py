"""Paged attention on CPU: decode rows read the pool through views, without copying a context.

Per decode row, its table is cut into *pieces*: runs of consecutive blocks of one source (pool or
side), further cut where the KEY_ONLY range starts and ends. Every piece is a strided view of the
pool (no copy) that PyTorch's CPU flash kernel attends with its log-sum-exp (``partial.attend_lse``:
bf16 / fp16 accumulated in fp32, query heads grouped per KV head so GQA reads K and V once); a
KEY_ONLY piece contributes its log-sum-exp with the stand-in as its output; the pieces combine
exactly (``partial.combine``).

A prefill chunk is attended as the gathering path attends it (``paged.PagedAttention``): its own
slots with the causal kernel and the slots cached before it read into one tensor and attended in
one call, the two combined by log-sum-exp. Why read them: the chunk's queries amortise the copy
(one read of the context per chunk and layer, against one flash call and one [G*T, D] partial
output per piece, i.e. per 16-token block, when attended piece by piece), and the same calls on the
same values give the gathering path's bits. That matters beyond rounding: the keys and values a
chunk writes are what the precision tiers later quantize, and a value a rounding error away from a
code boundary takes the neighbouring code (a whole quantization step). With pieces, a run of SmolLM2
with int4 -> int2 tiers changed 4 of the 51,840 bytes of one frozen int4 value block and its decode
logprobs drifted 2.4e-4 from the gathering path's; with the same calls, every code and prompt
logprob agree.

A sliding window is applied by starting the pieces at the first slot the query sees (decode); a
prefill chunk under a window is attended by the reference for that sequence (one copy of its
window), since a banded causal pattern has no mask-free CPU kernel.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from confkv_engine.attention import partial
from confkv_engine.attention.kernels.batch import PagedBatch
from confkv_engine.attention.kernels.reference import paged_attention_reference, read_slots

# (source: 0 pool, 1 side, 2 read into a small tensor; first flat slot in it; slots; 1 if KEY_ONLY)
Piece = tuple[int, int, int, int]
POOL, SIDE, READ = 0, 1, 2


def _pieces(nb: int, has_side: bool, table: list[int], lo: int, hi: int, ko: tuple[int, int],
            bs: int) -> list[Piece]:
    """Slots ``[lo, hi)`` of a table as runs of one source, cut at the KEY_ONLY bounds."""
    cuts = sorted({lo, hi, *(c for c in (ko[0], ko[0] + ko[1]) if lo < c < hi)})
    out: list[Piece] = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        kind = int(ko[1] > 0 and ko[0] <= a < ko[0] + ko[1])
        s = a
        while s < b:
            blk = table[s // bs]
            src, base = (SIDE, blk - nb) if blk >= nb and has_side else (POOL, blk)
            run_end = (s // bs + 1) * bs
            while run_end < b and table[run_end // bs] == table[run_end // bs - 1] + 1 and \
                    (table[run_end // bs] >= nb) == (blk >= nb):
                run_end += bs
            end = min(run_end, b)
            out.append((src, base * bs + s % bs, end - s, kind))
            s = end
    return out


def _align(k_pieces: list[Piece], nb: int, has_side: bool, v_table: list[int], lo: int,
           bs: int) -> list[Piece]:
    """V pieces cut at the K pieces' slots (the two tables' runs may differ); a K piece over two V
    runs reads its values into a small tensor (``READ``; rare: K and V blocks are reserved in pairs)."""
    out: list[Piece] = []
    start = lo
    for _, _, n, _ in k_pieces:
        sub = _pieces(nb, has_side, v_table, start, start + n, (0, 0), bs)
        out.append(sub[0] if len(sub) == 1 else (READ, start, n, 0))
        start += n
    return out


def _plan(batch: PagedBatch, i: int, nb: int, has_side: bool) -> tuple[list[Piece], list[Piece]]:
    """Decode row ``i``'s K and V pieces (its own slot included, like any cached one): the same in
    every layer, so computed once per step (kept in ``batch.memo``)."""
    key = ("cpu", i, nb, has_side, batch.window)
    if key not in batch.memo:
        n, bs = int(batch.seq_lens[i]), batch.block_size
        lo = 0 if batch.window is None else max(0, n - batch.window)
        ko = (int(batch.key_only[i, 0]), int(batch.key_only[i, 1]))
        k_table, v_table = batch.k_table[i].tolist(), batch.v_table[i].tolist()
        k_p = _pieces(nb, has_side, k_table, lo, n, ko, bs)
        batch.memo[key] = (k_p, _align(k_p, nb, has_side, v_table, lo, bs))
    return batch.memo[key]


def _view(src: int, first: int, n: int, pool: Tensor, side: Tensor | None, table: Tensor) -> Tensor:
    """A piece's slots [n, Hkv, D]: a view of the pool or side tensor, or (READ) a small copy."""
    hkv, d = pool.shape[2], pool.shape[3]
    if src == READ:
        return read_slots(pool, side, table, first + n)[first:]
    source = pool if src == POOL else side
    assert source is not None
    return source.view(-1, hkv, d)[first:first + n]


def _attend_pieces(qg: Tensor, pieces: tuple[list[Piece], list[Piece]], pool: Tensor, side: Tensor | None,
                   v_table: Tensor, stand: Tensor | None, scale: float) -> list[tuple[Tensor, Tensor]]:
    """qg [1, Hkv, G*T, D] against each piece: (out [1, Hkv, G*T, D], lse [1, Hkv, G*T])."""
    parts = []
    for (ks, k0, n, kind), (vs, v0, _, _) in zip(*pieces, strict=True):
        keys = _view(ks, k0, n, pool, side, v_table).transpose(0, 1)[None].to(qg.dtype)
        vals = keys if kind else _view(vs, v0, n, pool, side, v_table).transpose(0, 1)[None].to(qg.dtype)
        out, lse = partial.attend_lse(qg, keys, vals, scale=scale)
        if kind and stand is not None:
            out = stand.to(qg.dtype)[None, :, None, :].expand_as(out)
        parts.append((out, lse))
    return parts


def _one(q: Tensor, pool: Tensor, side: Tensor | None, batch: PagedBatch, i: int,
         stand: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """Sequence ``i``'s rows: (out [T, Hq, D], lse [T, Hq])."""
    hkv, d = pool.shape[2], pool.shape[3]
    tq = int(batch.q_len[i])
    if tq > 1:
        return _chunk(q, pool, side, batch, i, stand, scale)
    g = q.shape[1] // hkv
    qg = q.view(tq, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * tq, d)
    parts = _attend_pieces(qg, _plan(batch, i, pool.shape[0], side is not None), pool, side,
                           batch.v_table[i], stand, scale)
    out = partial.combine(parts) if len(parts) > 1 else parts[0][0]
    lse = torch.logsumexp(torch.stack([lse for _, lse in parts]), 0)
    return out.view(hkv, g, tq, d).permute(2, 0, 1, 3).reshape(tq, hkv * g, d), lse.view(hkv, g, tq).permute(
        2, 0, 1).reshape(tq, hkv * g)


def _chunk(q: Tensor, pool: Tensor, side: Tensor | None, batch: PagedBatch, i: int,
           stand: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """A prefill chunk: its own slots (causal) and its sequence's cached slots, each in one call, as
    the gathering path attends them (see the module docstring for why the cached slots are read)."""
    own = _own(q, pool, side, batch, i, stand, scale)
    if int(batch.seq_lens[i]) == int(batch.q_len[i]):
        return own
    old = _cached(q, pool, side, batch, i, stand, scale)
    return partial.combine([own, old]), torch.logsumexp(torch.stack([own[1], old[1]]), 0)


def _cached(q: Tensor, pool: Tensor, side: Tensor | None, batch: PagedBatch, i: int,
            stand: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """A prefill chunk against the slots cached before it, read into one tensor, every slot visible."""
    hkv, d = pool.shape[2], pool.shape[3]
    n, tq = int(batch.seq_lens[i]), int(batch.q_len[i])
    g, cached = q.shape[1] // hkv, n - tq
    keys = read_slots(pool, side, batch.k_table[i], cached).to(q.dtype)
    vals = read_slots(pool, side, batch.v_table[i], cached).to(q.dtype)
    ko_start, ko_count = int(batch.key_only[i, 0]), int(batch.key_only[i, 1])
    if stand is not None and ko_count:
        vals[ko_start:ko_start + ko_count] = stand.to(q.dtype)
    qg = q.view(tq, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * tq, d)
    out, lse = partial.attend_lse(qg, keys.transpose(0, 1)[None], vals.transpose(0, 1)[None], scale=scale)
    return (out.view(hkv, g, tq, d).permute(2, 0, 1, 3).reshape(tq, hkv * g, d),
            lse.view(hkv, g, tq).permute(2, 0, 1).reshape(tq, hkv * g))


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
