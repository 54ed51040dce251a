"""Paged attention against the dense masked reference over the same cached positions."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.attention.paged import PagedAttention
from confkv_engine.cache.kv_cache import CacheSpec, KVCache, SeqKV
from confkv_engine.model.llama import dense_causal_attention

L, HQ, HKV, D, BS = 2, 6, 2, 8, 4


def _setup(num_blocks: int = 64) -> tuple[KVCache, PagedAttention]:
    spec = CacheSpec(L, HKV, D, BS, torch.float32, torch.device("cpu"))
    cache = KVCache(spec, num_blocks)
    return cache, PagedAttention(cache, HQ)


def _step(cache, backend, seqs, num_new, history, gen):
    """Run one step on every layer; returns per layer the backend output [T, HQ, D] and the
    dense reference computed from ``history`` (per seq, per layer: all k/v so far)."""
    pos = torch.cat([torch.arange(s.num_slots, s.num_slots + n) for s, n in zip(seqs, num_new, strict=True)])
    for s, n in zip(seqs, num_new, strict=True):
        cache.reserve(s, n)
    backend.begin_step(seqs, num_new, pos)
    results = []
    for layer in range(L):
        t = sum(num_new)
        q = torch.randn(t, HQ, D, generator=gen)
        k = torch.randn(t, HKV, D, generator=gen)
        v = torch.randn(t, HKV, D, generator=gen)
        out = backend.attend(layer, q, k, v)
        refs, start = [], 0
        for i, n in enumerate(num_new):
            hk, hv = history[i][layer]
            hk.append(k[start:start + n])
            hv.append(v[start:start + n])
            refs.append(dense_causal_attention(q[start:start + n], torch.cat(hk), torch.cat(hv)))
            start += n
        results.append((out, torch.cat(refs)))
    backend.end_step()
    return results


@pytest.mark.parametrize("order", ["decode_first", "mixed"])
def test_mixed_prefill_and_decode_batch_matches_dense(order: str) -> None:
    cache, backend = _setup()
    gen = torch.Generator().manual_seed(0)
    seqs = [SeqKV() for _ in range(4)]
    history = [[([], []) for _ in range(L)] for _ in seqs]
    # Prefill in uneven chunks, then a step mixing decodes with a prefill chunk.
    _step(cache, backend, seqs, [5, 9, 1, 13], history, gen)
    _step(cache, backend, seqs[:2], [3, 4], history[:2], gen)
    num_new = [1, 1, 6, 1] if order == "decode_first" else [6, 1, 1, 7]
    for out, ref in _step(cache, backend, seqs, num_new, history, gen):
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # Pure decode fast path.
    for out, ref in _step(cache, backend, seqs, [1, 1, 1, 1], history, gen):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert [s.num_slots for s in seqs] == [len(torch.cat(h[0][0])) for h in history]


def test_slots_record_absolute_positions() -> None:
    cache, backend = _setup()
    seq = SeqKV()
    gen = torch.Generator().manual_seed(1)
    _step(cache, backend, [seq], [7], [[([], []) for _ in range(L)]], gen)
    pos = cache.slot_positions(seq)
    assert pos.shape == (L, HKV, 7)
    assert pos.tolist() == [[list(range(7))] * HKV] * L
