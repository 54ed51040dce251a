"""A decision's attention signal computed several layers at a time (``retention.scoring``): the keys of
a mixed table (pool and compressed blocks) read for several layers at once as K^T
(``read_keys_transposed``, compressed keys decoded channel-major by the native library, or
gathered token-major and transposed without it) equal the per-layer ``read_table``; the
probabilities equal a plain softmax over the visible keys; folding all layers at once equals folding
them one at a time."""

from __future__ import annotations

import math

import pytest
import torch

from confkv_engine.cache.codec import native
from confkv_engine.cache.codec.blocks import decode_keys_transposed, decode_rows, encode_rows
from confkv_engine.cache.codec.spec import CodecSpec
from confkv_engine.cache.kv_cache import KVCache, SeqKV
from confkv_engine.cache.layout import CacheSpec
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.runtime import RetentionState
from confkv_engine.retention.scorer import ScorerConfig
from confkv_engine.retention.scoring import attention_probs
from confkv_engine.retention.tiers import KVAccounting

CPU = torch.device("cpu")
native_only = pytest.mark.skipif(not native.available(), reason="the native decoder was not built here")


@native_only
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(("group", "params"), [(16, "fp16"), (16, "dq6"), (8, "dq6")])
def test_channel_major_key_decode_is_the_token_major_decode_transposed(bits, group, params) -> None:
    torch.manual_seed(bits + group)
    spec = CodecSpec((16, 3, 64), bits, 0, group, params)
    rows = encode_rows(torch.randn(5, 16, 3, 64) * 3 + 1, spec)
    want = decode_rows(rows, spec).view(5, 16, 192)  # token-major, the reference
    out = torch.full((2, 192, 4 * 16), 7.0)  # 2 layers x 4 table rows
    dst = torch.tensor([1, 2, -1, 4, 7])  # layer 0 rows 1, 2; block 2 skipped; layer 1 rows 0, 3
    assert decode_keys_transposed(rows, spec, out, dst)
    blocks = out.view(2, 192, 4, 16)
    for i, d in enumerate(dst.tolist()):
        if d >= 0:
            assert torch.equal(blocks[d // 4, :, d % 4], want[i].t())
    assert torch.equal(blocks[0, :, 0], torch.full((192, 16), 7.0))  # no block goes there
    assert torch.equal(blocks[0, :, 3], torch.full((192, 16), 7.0))


@native_only
def test_channel_major_decode_refuses_values_and_rows_past_the_output() -> None:
    values = CodecSpec((16, 3, 64), 4, 2, 64)
    rows = encode_rows(torch.randn(2, 16, 3, 64), values)
    assert not decode_keys_transposed(rows, values, torch.empty(1, 192, 32), torch.tensor([0, 1]))
    keys = CodecSpec((16, 3, 64), 4, 0, 16)
    rows = encode_rows(torch.randn(2, 16, 3, 64), keys)
    with pytest.raises(ValueError, match="past"):
        decode_keys_transposed(rows, keys, torch.empty(1, 192, 32), torch.tensor([0, 2]))


def _mixed_cache(dtype: torch.dtype) -> tuple[KVCache, SeqKV]:
    """3 layers, 64 tokens in 4 blocks, the first two blocks' keys and values compressed (int4) but
    in an int8 pool (its blocks hold codes already: nothing is compressed, its scales apply)."""
    cache = KVCache(CacheSpec(3, 2, 32, 16, dtype, CPU, compute_dtype=torch.float32), 16)
    seq = SeqKV()
    cache.reserve(seq, 64)
    gen = torch.Generator().manual_seed(3)
    plan = cache.plan_writes([seq], [64], torch.arange(64))
    for layer in range(3):
        cache.write(layer, plan, torch.randn(64, 2, 32, generator=gen), torch.randn(64, 2, 32, generator=gen))
    cache.commit(seq, 64)
    compressed = dtype != torch.int8
    assert cache.compress_tables([seq], [2], 4, 64, limit=4).blocks == 4 * compressed
    assert [b < 0 for b in seq.k_blocks] == [compressed, compressed, False, False]
    return cache, seq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_keys_read_for_several_layers_equal_the_per_layer_reads(dtype: torch.dtype) -> None:
    cache, seq = _mixed_cache(dtype)
    want = torch.stack([cache.read_table(seq.k_blocks, layer, 60) for layer in (1, 2)])  # [2, 60, Hkv, D]
    kt = cache.read_keys_transposed(seq.k_blocks, range(1, 3), 60)
    assert kt.shape == (2, 2, 32, 60) and kt.dtype == torch.float32
    assert torch.equal(kt, want.permute(0, 2, 3, 1))
    assert kt.reshape(4, 32, 60).data_ptr() == kt.data_ptr()  # the matmul's view, no copy


def test_keys_transposed_without_the_library_are_gathered_and_transposed(monkeypatch) -> None:
    cache, seq = _mixed_cache(torch.float32)
    want = torch.stack([cache.read_table(seq.k_blocks, layer, 60) for layer in (1, 2)])
    monkeypatch.setattr(native, "covers", lambda *a: False)
    assert torch.equal(cache.read_keys_transposed(seq.k_blocks, range(1, 3), 60), want.permute(0, 2, 3, 1))


def test_probabilities_are_the_softmax_over_the_visible_keys_summed_per_kv_head() -> None:
    gen = torch.Generator().manual_seed(0)
    nl, t, hkv, g, d, n = 2, 3, 2, 3, 8, 10
    q = torch.randn(nl, t, hkv * g, d, generator=gen)
    keys = torch.randn(nl, n, hkv, d, generator=gen)
    key_pos = torch.arange(n).expand(nl, hkv, n)
    q_pos = torch.tensor([7, 8, 9])
    hidden = key_pos[:, :, None, :] > q_pos[None, None, :, None]  # keys 8, 9 are later than query 7
    got = attention_probs(q, keys.permute(0, 2, 3, 1), hidden[..., 6:], 6, torch.empty(nl * hkv, g * t, n))
    for layer in range(nl):
        for h in range(hkv):
            for i in range(t):
                s = q[layer, i, h * g:(h + 1) * g] @ keys[layer, :, h].T / math.sqrt(d)  # [g, n]
                s[:, hidden[layer, h, i]] = -math.inf
                assert torch.allclose(got[layer, h, i], s.softmax(-1).sum(0), atol=1e-6)
    assert torch.allclose(got.sum(-1), torch.full((nl, hkv, t), float(g)))


def _state(remember: bool) -> RetentionState:
    cfg = RetentionConfig(policy="conf-kv", scorer=ScorerConfig(memory=1.0 if remember else 0.0,
                                                                memory_distance=1, memory_decay=0.5))
    state = RetentionState(cfg=cfg, acct=KVAccounting(block_size=1, half_block_bytes=10), num_layers=3,
                           num_kv_heads=2, head_dim=4, group=2, interval=8)
    state.on_append(torch.arange(6))
    return state


@pytest.mark.parametrize("remember", [False, True])
def test_folding_every_layer_at_once_equals_folding_them_in_turn(remember: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    chunks = [(torch.rand(3, 2, 2, 6, generator=gen), torch.tensor([4, 5])),
              (torch.rand(3, 2, 3, 6, generator=gen), torch.tensor([6, 8, 9]))]
    together, in_turn = _state(remember), _state(remember)
    for probs, q_pos in chunks:
        together.on_attention_layers(probs, q_pos)
        for layer in range(3):
            in_turn.on_attention(layer, probs[layer], q_pos)
    assert together.last_query == in_turn.last_query == [9, 9, 9]
    for name in ("acc", "norm", "peak"):
        assert torch.equal(getattr(together, name), getattr(in_turn, name)), name
    assert remember == bool(together.peak.abs().sum() > 0)


def test_layers_that_saw_different_queries_are_folded_one_at_a_time() -> None:
    gen = torch.Generator().manual_seed(2)
    probs = torch.rand(3, 2, 1, 6, generator=gen)
    uneven, ref = _state(True), _state(True)
    for state in (uneven, ref):
        state.on_attention(0, probs[0], torch.tensor([3]))  # layer 0 alone has seen query 3
    uneven.on_attention_layers(probs, torch.tensor([5]))
    for layer in range(3):
        ref.on_attention(layer, probs[layer], torch.tensor([5]))
    assert uneven.last_query == [5, 5, 5]
    assert torch.equal(uneven.acc, ref.acc) and torch.equal(uneven.peak, ref.peak)
