"""The paged attention kernels against the gathering reference, on random block tables that mix pool
blocks and side (decoded compressed) blocks, KEY_ONLY stand-ins, ragged lengths, decode rows and
prefill chunks, GQA ratios 1 / 3 / 8, head dims 64 / 128, fp32 / bf16 / fp16.

The Triton kernel runs under ``TRITON_INTERPRET=1`` (CPU): the interpreter executes the same kernel
source a GPU compiles, numpy doing the arithmetic, so the cases are small (it is slow).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from confkv_engine.attention.kernels.batch import PagedBatch
from confkv_engine.attention.kernels.cpu import paged_attention_cpu
from confkv_engine.attention.kernels.reference import paged_attention_reference

BS = 16
TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@pytest.fixture(scope="module")
def triton_kernel():
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton and the kernel load: set before both
    try:
        pytest.importorskip("triton")
        module = importlib.import_module("confkv_engine.attention.kernels.triton_paged")
        yield importlib.reload(module).paged_attention_triton
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def random_case(seed: int, hkv: int, g: int, d: int, dtype: torch.dtype, q_lens: list[int],
                cached: list[int], window: int | None = None):
    """Pool, side tensor, stand-ins, queries and a batch whose tables mix pool and side blocks at
    random and whose sequences have KEY_ONLY runs at random."""
    gen = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(cached, q_lens, strict=True)]
    need = [-(-n // BS) for n in lens]
    nb, ns = 2 * sum(need) + 3, sum(need) + 1
    pool = torch.randn(nb, BS, hkv, d, generator=gen).to(dtype)
    side = torch.randn(ns, BS, hkv, d, generator=gen).to(dtype)
    ids = torch.randperm(nb + ns, generator=gen).tolist()
    k_tables, v_tables, key_only = [], [], []
    for n, blocks in zip(lens, need, strict=True):
        k_tables.append([ids.pop() for _ in range(blocks)])
        v_tables.append([ids.pop() for _ in range(blocks)])
        start = int(torch.randint(0, max(1, n // 2), (1,), generator=gen))
        key_only.append((start, int(torch.randint(0, n - start, (1,), generator=gen))))
    batch = PagedBatch.build(k_tables, v_tables, lens, q_lens, key_only, BS, torch.device("cpu"), window)
    q = torch.randn(sum(q_lens), hkv * g, d, generator=gen).to(dtype)
    stand = torch.randn(len(lens), hkv, d, generator=gen)
    return q, pool, side, stand, batch


CASES = [  # (hkv, G, D, dtype, q_lens, cached, window)
    (2, 1, 64, torch.float32, [1, 1, 1], [37, 5, 80], None),
    (1, 3, 128, torch.bfloat16, [1, 1], [100, 16], None),
    (1, 8, 64, torch.float16, [1, 1, 1], [63, 1, 40], None),
    (2, 3, 64, torch.float32, [9, 1, 20], [0, 50, 17], None),
    (1, 8, 128, torch.bfloat16, [1, 12], [70, 33], None),
    (1, 3, 64, torch.float32, [1, 7], [90, 40], 24),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"hkv{c[0]}-g{c[1]}-d{c[2]}-{str(c[3])[6:]}-q{c[4]}")
def test_triton_kernel_equals_reference(triton_kernel, case) -> None:
    q, pool, side, stand, batch = random_case(1, *case)
    want_out, want_lse = paged_attention_reference(q, pool, batch, side, stand)
    out, lse = triton_kernel(q, pool, batch, side, stand)
    tol = TOL[q.dtype]
    assert out.dtype == q.dtype
    assert (out.float() - want_out.float()).abs().max() <= tol
    assert (lse - want_lse).abs().max() <= tol


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"hkv{c[0]}-g{c[1]}-d{c[2]}-{str(c[3])[6:]}-q{c[4]}")
def test_cpu_kernel_equals_reference(case) -> None:
    q, pool, side, stand, batch = random_case(2, *case)
    want_out, want_lse = paged_attention_reference(q, pool, batch, side, stand)
    out, lse = paged_attention_cpu(q, pool, batch, side, stand)
    tol = TOL[q.dtype]
    assert (out.float() - want_out.float()).abs().max() <= tol
    assert (lse - want_lse).abs().max() <= tol


def test_decode_splits_combine_exactly(triton_kernel) -> None:
    """A long decode row is cut into several splits (flash-decoding); combined, they equal one pass."""
    from confkv_engine.attention.kernels import triton_paged

    q, pool, side, stand, batch = random_case(3, 1, 3, 64, torch.float32, [1], [40 * BS])
    assert triton_paged._splits(batch, 3) > 1
    want_out, want_lse = paged_attention_reference(q, pool, batch, side, stand)
    out, lse = triton_kernel(q, pool, batch, side, stand)
    assert (out - want_out).abs().max() <= 1e-3
    assert (lse - want_lse).abs().max() <= 1e-3


def test_window_must_hold_a_slot() -> None:
    with pytest.raises(ValueError, match="sliding window"):
        PagedBatch.build([[0]], [[1]], [3], [1], None, BS, torch.device("cpu"), window=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled kernel")
@pytest.mark.parametrize("case", CASES[1:], ids=lambda c: f"hkv{c[0]}-g{c[1]}-d{c[2]}-{str(c[3])[6:]}")
def test_compiled_triton_kernel_on_cuda(case) -> None:
    """The same kernel compiled for the GPU (where the engine chooses it) against the reference."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter is on in this process")
    from confkv_engine.attention.kernels.triton_paged import paged_attention_triton

    q, pool, side, stand, batch = random_case(4, *case)
    want_out, want_lse = paged_attention_reference(q, pool, batch, side, stand)
    dev = torch.device("cuda")
    on_dev = PagedBatch(*(getattr(batch, f).to(dev) for f in ("k_table", "v_table", "seq_lens", "q_start",
                                                                "q_len", "key_only")),
                        batch.max_q_len, batch.block_size, batch.window)
    out, lse = paged_attention_triton(q.to(dev), pool.to(dev), on_dev, side.to(dev), stand.to(dev))
    assert (out.float().cpu() - want_out.float()).abs().max() <= TOL[q.dtype]
    assert (lse.cpu() - want_lse).abs().max() <= TOL[q.dtype]


def test_layer_window_overrides_the_batch(triton_kernel) -> None:
    """A local layer's window passed per call equals a batch built with that window (Gemma 3's
    sliding-window layers share the step's batch with its global layers)."""
    q, pool, side, stand, windowed = random_case(5, 1, 3, 64, torch.float32, [1, 7], [90, 40], 24)
    plain = PagedBatch(windowed.k_table, windowed.v_table, windowed.seq_lens, windowed.q_start,
                       windowed.q_len, windowed.key_only, windowed.max_q_len, BS)
    want_out, want_lse = paged_attention_reference(q, pool, windowed, side, stand)
    for kernel in (triton_kernel, paged_attention_cpu, paged_attention_reference):
        out, lse = kernel(q, pool, plain, side, stand, window=24)
        assert (out - want_out).abs().max() <= 1e-3 and (lse - want_lse).abs().max() <= 1e-3
    full_out, _ = paged_attention_reference(q, pool, plain, side, stand)
    assert (full_out - want_out).abs().max() > 1e-2  # the window changes the result
