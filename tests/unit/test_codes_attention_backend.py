"""The paged backend's decode rows with compressed blocks attended from their codes (``attention.codes``)
equal the same rows gathered with their compressed blocks decoded: frozen blocks of several codec pairs
(int4, k4v2, int2, int8) in one row, a row without any, a row whose frozen block comes first, a
KEY_ONLY range after the frozen blocks (its stand-in lands on the compacted slots), GQA 1 and 3, head
dims 64 and 128, fp32 and bf16 pools, and a sliding-window layer (the whole table, gathered); slots
straddling pool blocks that are not neighbours, and a split reused across steps."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.attention.retention import RetentionAttention
from confkv_engine.cache.codec import native
from confkv_engine.cache.kv_cache import SeqKV
from confkv_engine.cache.tiered import freeze_blocks
from tests.unit.test_cache_compression import BS, fill, make_cache

pytestmark = pytest.mark.skipif(not native.available(), reason="the native codec library is not built")
LAYERS, HEADS = 2, 2


class _KeyOnly:
    """A retention state with a KEY_ONLY range and no scoring (what the backend reads of one)."""

    wants_probs = False

    def __init__(self, start: int, n: int, dim: int) -> None:
        self.key_start, self.n_key = start, n
        self.v_mean = torch.randn(LAYERS, HEADS, dim)

    def on_append(self, positions: torch.Tensor) -> None:
        pass

    def on_queries(self, layer: int, q: torch.Tensor) -> None:
        pass


def _frozen_rows(blocks: int, dtype: torch.dtype, dim: int):
    """Three sequences: frozen blocks of four codec pairs then a KEY_ONLY range; none; one frozen
    block first then a KEY_ONLY range. Returns the cache, the sequences and their states."""
    cache = make_cache(blocks, dtype, dims=(LAYERS, HEADS, dim))
    seqs = [SeqKV(), SeqKV(), SeqKV()]
    for i, n in enumerate((7 * BS + 5, 2 * BS + 3, 4 * BS)):
        fill(cache, seqs[i], n, seed=i)
    assert freeze_blocks(cache, seqs[0], 1, [(4, 4), (4, 2), (2, 2), (8, 8)], 32) == 4
    assert freeze_blocks(cache, seqs[2], 0, [(4, 4)], 32) == 1
    return cache, seqs, [_KeyOnly(5 * BS + 3, BS + 2, dim), None, _KeyOnly(BS, 5, dim)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dim", [64, 128])
def test_decode_from_codes_equals_decode_then_attend(dtype, tol, group, dim) -> None:
    torch.manual_seed(dim + group)
    cache, seqs, states = _frozen_rows(120, dtype, dim)
    for s in seqs:
        cache.reserve(s, 1)
    positions = torch.tensor([s.num_slots for s in seqs])
    q = torch.randn(len(seqs), HEADS * group, dim).to(dtype)
    k, v = torch.randn(len(seqs), HEADS, dim), torch.randn(len(seqs), HEADS, dim)
    outs = {}
    for from_codes in (False, True):
        backend = RetentionAttention(cache, HEADS * group, from_codes=from_codes)
        backend.begin_step(seqs, [1] * len(seqs), positions, states)
        assert (backend.decode[0].codes is not None) == from_codes
        outs[from_codes] = [backend.attend(layer, q, k, v, window).float()
                            for layer in range(LAYERS) for window in (None, 40)]
    for want, got in zip(outs[False], outs[True], strict=True):
        assert (want - got).abs().max() <= tol


def _decode(backend: RetentionAttention, seqs: list[SeqKV], q: torch.Tensor,
            kv: torch.Tensor) -> list[torch.Tensor]:
    positions = torch.tensor([s.num_slots for s in seqs])
    backend.begin_step(seqs, [1] * len(seqs), positions, [None] * len(seqs))
    return [backend.attend(layer, q, kv[0], kv[1]).float() for layer in range(LAYERS)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_slots_straddling_hosts_apart_and_a_split_reused_across_steps(dtype, tol) -> None:
    """Two rows freezing blocks in turn: each arena's hosts are blocks both rows freed, not neighbours in
    the pool, so some slots straddle two of them and are read in two pieces. A second step, after one
    row froze one more block, reuses the other row's split and rebuilds the changed one: both steps
    equal decode-then-attend."""
    torch.manual_seed(11)
    cache = make_cache(160, dtype, dims=(LAYERS, HEADS, 64))
    seqs = [SeqKV(), SeqKV()]
    for i, n in enumerate((26 * BS + 7, 24 * BS)):
        fill(cache, seqs[i], n, seed=i)
    for j in range(20):
        assert freeze_blocks(cache, seqs[j % 2], 1 + j // 2, [(4, 4)], 32) == 1
    q, kv = torch.randn(len(seqs), HEADS * 3, 64).to(dtype), torch.randn(2, 2, len(seqs), HEADS, 64)
    codes_backend = RetentionAttention(cache, HEADS * 3, from_codes=True)
    for step in range(2):
        if step:
            assert freeze_blocks(cache, seqs[0], 11, [(4, 4)], 32) == 1
        for s in seqs:
            cache.reserve(s, 1)
        want = _decode(RetentionAttention(cache, HEADS * 3, from_codes=False), seqs, q, kv[step])
        got = _decode(codes_backend, seqs, q, kv[step])
        groups = codes_backend.decode[0].codes.groups
        assert any(g.k_reads.tails is not None or g.v_reads.tails is not None for g in groups)
        for a, b in zip(want, got, strict=True):
            assert (a - b).abs().max() <= tol
        codes_backend.end_step()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dim", [64, 128])
def test_prefill_chunks_from_codes_equal_decode_then_attend(dtype, tol, group, dim) -> None:
    """Prefill chunks of three sequences with frozen blocks (several codec pairs; one row with a
    KEY_ONLY range after them, its stand-in on the compacted slots) and one without: the cached
    part's compressed blocks from codes, T x G queries per KV head, equal the gathered and decoded
    table, in global and sliding-window layers."""
    torch.manual_seed(dim + group + 1)
    cache, seqs, states = _frozen_rows(160, dtype, dim)
    chunks = [9, 16, 5]
    for s, n in zip(seqs, chunks, strict=True):
        cache.reserve(s, n)
    positions = torch.cat([torch.arange(s.num_slots, s.num_slots + n)
                           for s, n in zip(seqs, chunks, strict=True)])
    rows = sum(chunks)  # a chunk's queries, keys and values in the model's dtype
    q, k, v = (torch.randn(rows, h, dim).to(dtype) for h in (HEADS * group, HEADS, HEADS))
    outs = {}
    for from_codes in (False, True):
        backend = RetentionAttention(cache, HEADS * group, from_codes=from_codes)
        backend.begin_step(seqs, chunks, positions, states)
        with_codes = [p.codes is not None for p in backend.prefills]
        assert with_codes == [from_codes, False, from_codes]  # the second row has no frozen block
        outs[from_codes] = [backend.attend(layer, q, k, v, window).float()
                            for layer in range(LAYERS) for window in (None, 40)]
    for want, got in zip(outs[False], outs[True], strict=True):
        assert (want - got).abs().max() <= tol
