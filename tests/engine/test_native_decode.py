"""The native decode kernel (pool read in place) against the gathering path and the dense reference,
and the steps that must keep the gathering path."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.attention.kernels import native_decode
from confkv_engine.attention.paged import PagedAttention
from confkv_engine.attention.retention import RetentionAttention
from confkv_engine.cache.kv_cache import CacheSpec, KVCache, SeqKV
from confkv_engine.model.llama import dense_causal_attention

L, HQ, HKV, D, BS = 2, 6, 2, 32, 4
# Prompts, then decode steps: tables of one to six blocks, partly filled. One row alone has fewer
# (row, KV head) pairs than twice the threads of a 2-core machine: its slots are split in parts.
BATCHES = {"three_rows": [3, 17, 9], "one_row": [23]}

pytestmark = pytest.mark.skipif(not native_decode.available(),
                                reason="the native decode library is not built here (setup.py)")


def _run(dtype: torch.dtype, native: bool, window: int | None, lengths: list[int],
         steps: int = 4) -> list[torch.Tensor]:
    """Prefill ``lengths``, then ``steps`` decode steps of all three; the decode outputs of every
    layer, plus the dense reference's when ``native`` (appended after them)."""
    spec = CacheSpec(L, HKV, D, BS, dtype, torch.device("cpu"))
    cache = KVCache(spec, 96)
    backend = PagedAttention(cache, HQ, native=native)
    gen = torch.Generator().manual_seed(0)
    seqs = [SeqKV() for _ in lengths]
    history = [[([], []) for _ in range(L)] for _ in seqs]
    outs, refs = [], []
    for num_new in [lengths] + [[1] * len(seqs)] * steps:
        pos = torch.cat([torch.arange(s.num_slots, s.num_slots + n)
                         for s, n in zip(seqs, num_new, strict=True)])
        for s, n in zip(seqs, num_new, strict=True):
            cache.reserve(s, n)
        backend.begin_step(seqs, num_new, pos)
        assert (backend.native is not None) == (native and num_new[0] == 1)
        for layer in range(L):
            t = sum(num_new)
            q, k, v = (torch.randn(t, h, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV))
            out = backend.attend(layer, q, k, v, window=window)
            start = 0
            for i, n in enumerate(num_new):
                hk, hv = history[i][layer]
                hk.append(k[start:start + n])
                hv.append(v[start:start + n])
                if n == 1:
                    refs.append(dense_causal_attention(q[start:start + 1], torch.cat(hk), torch.cat(hv),
                                                       window))
                start += n
            if num_new[0] == 1:
                outs.append(out)
        backend.end_step()
    return outs + ([torch.cat(refs)] if native else [])


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("window", [None, 6], ids=["global", "window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_decode_matches_gather_and_dense(dtype: torch.dtype, window: int | None, batch: str) -> None:
    *native, ref = _run(dtype, True, window, BATCHES[batch])
    gathered = _run(dtype, False, window, BATCHES[batch])
    # fp32: the same sums in another order; bf16: both round one fp32 result to bf16 (one ulp apart at most).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    for mine, theirs in zip(native, gathered, strict=True):
        torch.testing.assert_close(mine, theirs, **tol)
    torch.testing.assert_close(torch.cat(native).float(), ref.float().view(-1, HQ, D), **tol)


def test_pools_and_steps_the_kernel_does_not_cover_keep_the_gathering_path() -> None:
    seq = SeqKV()
    for dtype, expected in ((torch.int8, False), (torch.float16, False), (torch.float32, True)):
        compute = torch.float16 if dtype == torch.float16 else torch.float32
        cache = KVCache(CacheSpec(L, HKV, D, BS, dtype, torch.device("cpu"), compute_dtype=compute), 16)
        assert PagedAttention(cache, HQ).native_ok is expected, dtype
    cache = KVCache(CacheSpec(L, HKV, D, BS, torch.float32, torch.device("cpu")), 16)
    cache.reserve(seq, 1)
    assert not PagedAttention(cache, HQ, native=False).native_ok

    class Retained:  # a sequence under retention: its values may be stood in for, its queries recorded
        n_key, key_start, wants_probs = 0, 0, False

        def on_append(self, positions: torch.Tensor) -> None: ...

    backend = RetentionAttention(cache, HQ)
    backend.begin_step([seq], [1], torch.zeros(1, dtype=torch.long), [Retained()])  # type: ignore[list-item]
    assert backend.native is None and backend.decode
    backend.begin_step([seq], [1], torch.zeros(1, dtype=torch.long), [None])
    assert backend.native is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_log_sum_exp_is_the_scaled_scores(dtype: torch.dtype) -> None:
    """``decode_attention_lse``: the same output as ``decode_attention`` and, per query head, the
    log-sum-exp of its scaled scores over its visible slots (what ``attention.codes`` merges into)."""
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(12, BS, HKV, D, generator=gen).to(dtype)
    tables = native_decode.DecodeTables.build([[3, 7, 1], [5], [0, 9, 2]], [[4, 8, 2], [6], [11, 10, 3]],
                                              [10, 2, 12], 0)
    q = torch.randn(3, HQ, D, generator=gen).to(dtype)
    out, lse = native_decode.decode_attention_lse(q, pool, tables)
    assert torch.equal(out, native_decode.decode_attention(q, pool, tables))
    for r in range(3):
        n = int(tables.lens[r])
        keys = pool[tables.k_table[r]].reshape(-1, HKV, D)[:n].float()  # [n, Hkv, D]
        scores = torch.einsum("hd,nhd->hn", q[r].float(), keys.repeat_interleave(HQ // HKV, 1)) / D ** 0.5
        assert (lse[r] - torch.logsumexp(scores, -1)).abs().max() < 1e-5
