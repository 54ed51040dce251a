"""Triton paged attention (CUDA; checked on CPU under ``TRITON_INTERPRET=1``).

One kernel serves decode and prefill chunks (``batch.PagedBatch``). A program owns one sequence, one
KV head, a tile of ``BLOCK_M`` query rows of that head's group (rows are (token, group member)
pairs, so GQA reads each K/V block once for all G query heads, never repeated) and one *split*:
a run of the sequence's blocks. It walks the block table of its split, loading each block where it
lies (a pool block, or a row of the step's side tensor of decoded compressed blocks), and keeps
an online softmax (flash attention). Decode uses several splits per sequence (flash-decoding: the
partial outputs and their log-sum-exps are combined exactly afterwards), so a few long sequences
still fill the GPU; a program never touches blocks past its sequence's length, so ragged batches
cost no padding. Causality and the sliding window are computed from slot numbers, no mask tensor.

fp32 inputs use IEEE dot products (no TF32), so fp32 matches the reference to 1e-3 or better.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from confkv_engine.attention.kernels.batch import PagedBatch

# Programs a decode step should offer the GPU before more splits stop helping (about 2 per SM on
# a large GPU); each split takes at least MIN_SPLIT_BLOCKS blocks so the combine stays cheap.
TARGET_PROGRAMS = 256
MIN_SPLIT_BLOCKS = 4
# Under the interpreter, ``range`` over tensor bounds converts a one-element array with ``int()``,
# which numpy 2.4 refuses, so the loop is a ``while`` there (it only asks for a truth value);
# compiled kernels keep ``range``, which Triton pipelines. See ``_dot`` for the other difference.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _load_block(pool_ptr, side_ptr, blk, num_pool, h, s_pb, s_ps, s_ph, x_pb, x_ps, x_ph,
                BS: tl.constexpr, D: tl.constexpr, HAS_SIDE: tl.constexpr):
    """Block ``blk`` of KV head ``h`` as [BS, D]: from the pool, or the side tensor past ``num_pool``."""
    offs_s = tl.arange(0, BS)
    offs_d = tl.arange(0, D)
    if HAS_SIDE:
        in_pool = blk < num_pool
        pool_blk = tl.where(in_pool, blk, 0)
        side_blk = tl.where(in_pool, 0, blk - num_pool)
        a = tl.load(pool_ptr + pool_blk.to(tl.int64) * s_pb + h * s_ph
                    + offs_s[:, None] * s_ps + offs_d[None, :])
        b = tl.load(side_ptr + side_blk.to(tl.int64) * x_pb + h * x_ph
                    + offs_s[:, None] * x_ps + offs_d[None, :])
        return tl.where(in_pool, a, b.to(a.dtype))
    return tl.load(pool_ptr + blk.to(tl.int64) * s_pb + h * s_ph + offs_s[:, None] * s_ps + offs_d[None, :])


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32; IEEE: exact fp32 products (fp32 inputs, and the interpreter, whose
    dot misreads 16-bit floats: there the inputs are widened first, which is what the GPU's fp32
    accumulation of their products computes)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _step(q, m_i, l_i, acc, j, pool_ptr, side_ptr, ktab_ptr, vtab_ptr, stand, qpos, ko_start, ko_end,
          sm_scale, num_pool, window, h, s_pb, s_ps, s_ph, x_pb, x_ps, x_ph, BS: tl.constexpr,
          D: tl.constexpr, HAS_SIDE: tl.constexpr, HAS_STAND: tl.constexpr, HAS_WINDOW: tl.constexpr,
          IEEE: tl.constexpr):
    """One block of the online softmax: folds table entry ``j`` into (m_i, l_i, acc)."""
    kb = tl.load(ktab_ptr + j)
    vb = tl.load(vtab_ptr + j)
    slots = j * BS + tl.arange(0, BS)
    k = _load_block(pool_ptr, side_ptr, kb, num_pool, h, s_pb, s_ps, s_ph, x_pb, x_ps, x_ph,
                    BS, D, HAS_SIDE).to(q.dtype)
    s = _dot(q, tl.trans(k), IEEE)
    visible = slots[None, :] <= qpos[:, None]
    if HAS_WINDOW:
        visible = visible & (slots[None, :] > qpos[:, None] - window)
    s = tl.where(visible, s * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_block(pool_ptr, side_ptr, vb, num_pool, h, s_pb, s_ps, s_ph, x_pb, x_ps, x_ph,
                    BS, D, HAS_SIDE).to(q.dtype)
    if HAS_STAND:
        key_only = (slots >= ko_start) & (slots < ko_end)
        v = tl.where(key_only[:, None], stand[None, :].to(q.dtype), v)
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def _paged_kernel(q_ptr, pool_ptr, side_ptr, ktab_ptr, vtab_ptr, lens_ptr, qstart_ptr, qlen_ptr,
                  konly_ptr, stand_ptr, out_ptr, lse_ptr,
                  sm_scale, num_pool, width, blocks_per_split, num_m, window,
                  s_qt, s_qh, s_pb, s_ps, s_ph, x_pb, x_ps, x_ph, s_on, s_ot, s_oh, s_ln, s_lt,
                  HKV: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BS: tl.constexpr,
                  D: tl.constexpr, HAS_SIDE: tl.constexpr, HAS_STAND: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, LOOP_WHILE: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1) // num_m
    m = tl.program_id(1) % num_m
    split = tl.program_id(2)
    q_len = tl.load(qlen_ptr + seq)
    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * G
    t = rows // G
    head = h * G + rows % G
    q_start = tl.load(qstart_ptr + seq)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + (q_start + t)[:, None].to(tl.int64) * s_qt + head[:, None] * s_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    seq_len = tl.load(lens_ptr + seq)
    cached = seq_len - q_len
    qpos = cached + t  # each row's own slot: it sees the slots up to it
    t_last = tl.minimum(q_len - 1, (m * BLOCK_M + BLOCK_M - 1) // G)
    lo = split * blocks_per_split
    hi = tl.minimum(lo + blocks_per_split, tl.cdiv(cached + t_last + 1, BS))
    if HAS_WINDOW:
        lo = tl.maximum(lo, (cached + (m * BLOCK_M) // G - window + 1) // BS)
    ko_start = tl.load(konly_ptr + 2 * seq)
    ko_end = ko_start + tl.load(konly_ptr + 2 * seq + 1)
    stand = tl.load(stand_ptr + (seq * HKV + h) * D + offs_d) if HAS_STAND else tl.zeros([D], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if LOOP_WHILE:  # the interpreter cannot take tensor loop bounds with numpy 2.4 (see INTERPRET)
        j = lo
        while j < hi:
            m_i, l_i, acc = _step(q, m_i, l_i, acc, j, pool_ptr, side_ptr, ktab_ptr + seq * width,
                                  vtab_ptr + seq * width, stand, qpos, ko_start, ko_end, sm_scale, num_pool,
                                  window, h, s_pb, s_ps, s_ph, x_pb, x_ps, x_ph,
                                  BS, D, HAS_SIDE, HAS_STAND, HAS_WINDOW, IEEE)
            j += 1
    else:
        for j in range(lo, hi):
            m_i, l_i, acc = _step(q, m_i, l_i, acc, j, pool_ptr, side_ptr, ktab_ptr + seq * width,
                                  vtab_ptr + seq * width, stand, qpos, ko_start, ko_end, sm_scale, num_pool,
                                  window, h, s_pb, s_ps, s_ph, x_pb, x_ps, x_ph,
                                  BS, D, HAS_SIDE, HAS_STAND, HAS_WINDOW, IEEE)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    row = (q_start + t).to(tl.int64)
    tl.store(out_ptr + split * s_on + row[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :], out,
             mask=row_ok[:, None])
    tl.store(lse_ptr + split * s_ln + row * s_lt + head, lse, mask=row_ok)


def _splits(batch: PagedBatch, programs: int) -> int:
    """Splits per sequence: enough programs for the GPU, never splits under MIN_SPLIT_BLOCKS blocks."""
    if batch.max_q_len > 1:
        return 1
    most = max(1, batch.width // MIN_SPLIT_BLOCKS)
    return max(1, min(most, -(-TARGET_PROGRAMS // max(1, programs))))


def paged_attention_triton(q: Tensor, pool: Tensor, batch: PagedBatch, side: Tensor | None = None,
                           stand_in: Tensor | None = None,
                           scale: float | None = None, window: int | None = None) -> tuple[Tensor, Tensor]:
    """``PagedKernel`` in Triton: out [T, Hq, D] in q's dtype, lse [T, Hq] fp32."""
    batch = batch.with_window(window)
    t_all, hq, d = q.shape
    nb, bs, hkv, pd = pool.shape
    if pd != d or hq % hkv or pool.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged attention needs q [T, Hq, D] and a pool [NB, bs, Hkv, D] with a unit "
                         "last stride, Hq a multiple of Hkv")
    g = hq // hkv
    block_m = max(16, triton.next_power_of_2(min(batch.max_q_len * g, 64)))
    num_m = -(-batch.max_q_len * g // block_m)
    splits = _splits(batch, batch.num_seqs * hkv * num_m)
    per_split = -(-batch.width // splits)
    out = torch.empty(splits, t_all, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(splits, t_all, hq, dtype=torch.float32, device=q.device)
    side_t = side if side is not None else pool
    stand = stand_in.float().contiguous() if stand_in is not None else out
    _paged_kernel[(batch.num_seqs, hkv * num_m, splits)](
        q, pool, side_t, batch.k_table, batch.v_table, batch.seq_lens, batch.q_start, batch.q_len,
        batch.key_only, stand, out, lse,
        scale if scale is not None else 1.0 / math.sqrt(d), nb, batch.width, per_split, num_m,
        batch.window or 0,
        q.stride(0), q.stride(1), pool.stride(0), pool.stride(1), pool.stride(2),
        side_t.stride(0), side_t.stride(1), side_t.stride(2),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        HKV=hkv, G=g, BLOCK_M=block_m, BS=bs, D=d, HAS_SIDE=side is not None,
        HAS_STAND=stand_in is not None, HAS_WINDOW=batch.window is not None,
        IEEE=q.dtype == torch.float32 or INTERPRET, LOOP_WHILE=INTERPRET)
    if splits == 1:
        return out[0].to(q.dtype), lse[0]
    total = torch.logsumexp(lse, 0)
    weights = torch.exp(lse - torch.where(torch.isinf(total), 0.0, total)[None]).nan_to_num_(0.0)
    return (weights[..., None] * out).sum(0).to(q.dtype), total
