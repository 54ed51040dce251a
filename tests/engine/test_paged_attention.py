"""Paged attention against the dense masked reference over the same cached positions."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.attention.paged import PagedAttention
from confkv_engine.cache.kv_cache import CacheSpec, KVCache, SeqKV
from confkv_engine.model.llama import dense_causal_attention

L, HQ, HKV, D, BS = 2, 6, 2, 8, 4


def _setup(num_blocks: int = 64, in_place: bool = False) -> tuple[KVCache, PagedAttention]:
    spec = CacheSpec(L, HKV, D, BS, torch.float32, torch.device("cpu"))
    cache = KVCache(spec, num_blocks)
    return cache, PagedAttention(cache, HQ, in_place=in_place)


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


@pytest.mark.parametrize("in_place", [False, True], ids=["gather", "in_place"])
@pytest.mark.parametrize("order", ["decode_first", "mixed"])
def test_mixed_prefill_and_decode_batch_matches_dense(order: str, in_place: bool) -> None:
    cache, backend = _setup(in_place=in_place)
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


@pytest.mark.parametrize("split", [True, False], ids=["split", "masked"])
def test_both_prefill_kernels_match_dense(split: bool) -> None:
    """Split prefill (causal own part + unmasked cached part, combined by log-sum-exp) and the single
    masked call both equal the dense reference, in chunks with and without cached slots."""
    cache, backend = _setup()
    backend.split = split
    gen = torch.Generator().manual_seed(3)
    seqs = [SeqKV() for _ in range(3)]
    history = [[([], []) for _ in range(L)] for _ in seqs]
    for num_new in ([17, 9, 13], [1, 6, 1], [5, 1, 1], [1, 1, 1]):
        for out, ref in _step(cache, backend, seqs, num_new, history, gen):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert [p.mask is None for p in backend.prefills] == [split] * len(backend.prefills)


def test_bf16_without_upcast_stays_within_bf16_rounding_of_fp32() -> None:
    """q, K and V go to the kernel in bf16 (it accumulates in fp32): the result is the fp32 one up to
    bf16 rounding of inputs and output, on every path."""
    spec = CacheSpec(L, HKV, D, BS, torch.bfloat16, torch.device("cpu"))
    cache = KVCache(spec, 64)
    backend = PagedAttention(cache, HQ)
    gen = torch.Generator().manual_seed(5)
    seqs = [SeqKV(), SeqKV()]
    history = [[([], []) for _ in range(L)] for _ in seqs]
    for num_new in ([11, 7], [1, 5], [1, 1]):
        for s, n in zip(seqs, num_new, strict=True):
            cache.reserve(s, n)
        pos = torch.cat([torch.arange(s.num_slots, s.num_slots + n)
                         for s, n in zip(seqs, num_new, strict=True)])
        backend.begin_step(seqs, num_new, pos)
        t = sum(num_new)
        q, k, v = (torch.randn(t, h, D, generator=gen).bfloat16() for h in (HQ, HKV, HKV))
        out = backend.attend(0, q, k, v)
        refs, start = [], 0
        for i, n in enumerate(num_new):
            hk, hv = history[i][0]
            hk.append(k[start:start + n].float())
            hv.append(v[start:start + n].float())
            refs.append(dense_causal_attention(q[start:start + n].float(), torch.cat(hk), torch.cat(hv)))
            start += n
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), torch.cat(refs), atol=2e-2, rtol=2e-2)
        backend.end_step()


@pytest.mark.parametrize("num_new", [[3, 1, 6], [1, 1, 1]], ids=["mixed", "decode"])
def test_write_plan_is_each_tokens_slot_through_its_table(num_new: list[int]) -> None:
    cache, _ = _setup()
    seqs = [SeqKV() for _ in range(3)]
    for s, n in zip(seqs, [5, 1, 8], strict=True):  # one ends on a block boundary
        cache.reserve(s, n)
        cache.commit(s, n)
    for s, n in zip(seqs, num_new, strict=True):
        cache.reserve(s, n)
    plan = cache.plan_writes(seqs, num_new, torch.arange(sum(num_new)))
    slots = [(s, slot) for s, n in zip(seqs, num_new, strict=True)
             for slot in range(s.num_slots, s.num_slots + n)]
    assert plan.k_index.tolist() == [s.k_blocks[i // BS] * BS + i % BS for s, i in slots]
    assert plan.v_index.tolist() == [s.v_blocks[i // BS] * BS + i % BS for s, i in slots]
    assert cache.pos[0, plan.k_index, 0].tolist() == list(range(sum(num_new)))
