"""Compressed KV blocks in the paged cache: exact round trip through the arenas, byte ratios, pool
blocks freed at once, shared blocks, prefix hits and eviction of compressed entries, attention over
compressed blocks, and the background worker."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from confkv_engine.attention.paged import PagedAttention
from confkv_engine.cache.arena import block_codecs
from confkv_engine.cache.codec.blocks import decode_rows, encode_rows
from confkv_engine.cache.kv_cache import CacheSpec, EvictionSink, KVCache, SeqKV
from confkv_engine.cache.streams import PendingBytes
from confkv_engine.cache.tiered import freeze_blocks, requantize_block, tier_pair_bytes
from confkv_engine.core.compression import CompressionWorker

SMOLLM2 = (30, 3, 64)  # layers, KV heads, head_dim
BS = 16


def make_cache(num_blocks: int, dtype: torch.dtype = torch.float32, dims: tuple[int, int, int] = (2, 2, 32),
               prefix: bool = False, sink: EvictionSink | None = None) -> KVCache:
    spec = CacheSpec(dims[0], dims[1], dims[2], BS, dtype, torch.device("cpu"))
    return KVCache(spec, num_blocks, prefix_salt=b"test" if prefix else None, sink=sink)


def fill(cache: KVCache, seq: SeqKV, n: int, seed: int = 0) -> None:
    """Append ``n`` tokens of random K/V (keys with outlier channels, as after RoPE) to ``seq``."""
    spec = cache.spec
    cache.reserve(seq, n)
    plan = cache.plan_writes([seq], [n], torch.arange(seq.num_slots, seq.num_slots + n))
    gen = torch.Generator().manual_seed(seed)
    for layer in range(spec.num_layers):
        k = torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=gen)
        k[..., ::8] *= 10.0
        v = torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=gen)
        cache.kv_flat[layer].index_copy_(0, plan.k_index, k.to(spec.dtype))
        cache.kv_flat[layer].index_copy_(0, plan.v_index, v.to(spec.dtype))
    cache.commit(seq, n)


def blocks_of(cache: KVCache, table: list[int]) -> torch.Tensor:
    """Every layer of a table's blocks as stored now: [L, nb, bs, Hkv, D] (compressed decoded)."""
    plan = cache.gather_plan(table)
    return torch.stack([cache.gather(layer, plan) for layer in range(cache.spec.num_layers)])


def cached_chain(cache: KVCache, n_blocks: int) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor]]:
    """A finished request's ``n_blocks`` full blocks left in the prefix index (evictable): its tokens
    and its (K, V) blocks as stored."""
    a = SeqKV()
    fill(cache, a, n_blocks * BS)
    tokens = list(range(n_blocks * BS))
    cache.register(a, tokens)
    original = blocks_of(cache, a.k_blocks), blocks_of(cache, a.v_blocks)
    cache.free(a)
    return tokens, original


def reference(cache: KVCache, blocks: torch.Tensor, bits: int, group: int = 64) -> tuple[torch.Tensor, ...]:
    """What the codec makes of uncompressed K and V blocks [L, nb, ...]: (keys, values) decoded."""
    kspec, vspec = block_codecs(BS, cache.spec.num_kv_heads, cache.spec.head_dim, bits, group,
                                cache.kv.element_size())
    out = []
    for spec, x in zip((kspec, vspec), blocks, strict=True):
        flat = x.reshape(-1, *spec.shape)
        out.append(decode_rows(encode_rows(flat, spec), spec, cache.spec.dtype).view_as(x))
    return tuple(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_is_the_codecs_exactly_and_the_ratio_is_its_bytes(dtype: torch.dtype, bits: int) -> None:
    cache = make_cache(40, dtype, SMOLLM2)
    seq = SeqKV()
    fill(cache, seq, 5 * BS + 3)
    before_k, before_v = blocks_of(cache, seq.k_blocks[:3]), blocks_of(cache, seq.v_blocks[:3])
    result = cache.compress_tables([seq], [3], bits, 64, limit=100)
    assert result.blocks == 6 and all(b < 0 for b in seq.k_blocks[:3] + seq.v_blocks[:3])
    assert all(b >= 0 for b in seq.k_blocks[3:] + seq.v_blocks[3:])
    ref_k, ref_v = reference(cache, torch.stack([before_k, before_v]), bits)
    assert torch.equal(blocks_of(cache, seq.k_blocks[:3]), ref_k)
    assert torch.equal(blocks_of(cache, seq.v_blocks[:3]), ref_v)
    # The uncompressed tail is untouched.
    assert seq.num_slots == 5 * BS + 3
    elem = torch.empty((), dtype=dtype).element_size()
    block = SMOLLM2[0] * BS * SMOLLM2[1] * SMOLLM2[2] * elem
    k_ratio = cache.store.nbytes(seq.k_blocks[0]) / block
    v_ratio = cache.store.nbytes(seq.v_blocks[0]) / block
    # Group parameters included (codec_spec docstring table): bf16 K dq6 0.550 / 0.300, V 0.531 / 0.281;
    # an fp32 pool keeps fp16 key parameters, K 0.625 / 0.375 of a bf16 block, half that of its own.
    expected = {(8, 2): (3378 / 6144, 0.53125), (4, 2): (1842 / 6144, 0.28125),
                (8, 4): (0.625 / 2, 0.53125 / 2), (4, 4): (0.375 / 2, 0.28125 / 2)}
    k_exp, v_exp = expected[(bits, elem)]
    assert k_ratio == pytest.approx(k_exp) and v_ratio == pytest.approx(v_exp)
    pair = cache.store.nbytes(seq.k_blocks[0]) + cache.store.nbytes(seq.v_blocks[0])
    assert cache.store.stored_bytes == 3 * pair


def test_a_k4v2_tier_block_is_int4_keys_and_int2_values_at_their_exact_bytes() -> None:
    cache = make_cache(20, torch.bfloat16, SMOLLM2)
    seq = SeqKV()
    fill(cache, seq, 2 * BS)
    original = torch.stack([blocks_of(cache, seq.k_blocks), blocks_of(cache, seq.v_blocks)])
    held = cache.seq_bytes(seq)
    assert freeze_blocks(cache, seq, 0, [(4, 2)], 64) == 1
    k4, _ = reference(cache, original, 4)
    _, v2 = reference(cache, original, 2)
    assert torch.equal(blocks_of(cache, seq.k_blocks[:1]), k4[:, :1])
    assert torch.equal(blocks_of(cache, seq.v_blocks[:1]), v2[:, :1])
    # The pool block pair (positions included) became the codecs' bytes plus the K block's positions.
    kspec, _ = block_codecs(BS, 3, 64, 4, 64, 2)
    _, vspec = block_codecs(BS, 3, 64, 2, 64, 2)
    positions = SMOLLM2[0] * BS * SMOLLM2[1] * 4
    pair = (kspec.nbytes + vspec.nbytes) * SMOLLM2[0] + positions
    assert tier_pair_bytes(cache.spec, (4, 2), 64) == pair
    assert held - cache.seq_bytes(seq) == 2 * cache.spec.block_bytes - pair
    # An int4 block demoted to k4v2 keeps its key handle (same codec) and re-encodes only its values.
    assert freeze_blocks(cache, seq, 1, [(4, 4)], 64) == 1
    k_handle, v_handle = seq.k_blocks[1], seq.v_blocks[1]
    int4_values = blocks_of(cache, [v_handle])
    requantize_block(cache, seq, 1, (4, 2), 64)
    assert seq.k_blocks[1] == k_handle and seq.v_blocks[1] != v_handle
    assert torch.equal(blocks_of(cache, seq.k_blocks[1:]), k4[:, 1:])
    _, int2_of_int4 = reference(cache, torch.stack([int4_values] * 2), 2)
    assert torch.equal(blocks_of(cache, seq.v_blocks[1:]), int2_of_int4)
    assert cache.seq_bytes(seq) == 2 * pair


def test_compression_frees_pool_blocks_another_sequence_uses_at_once() -> None:
    cache = make_cache(13)  # 12 usable blocks: one sequence of 6 blocks per table fills the pool
    a = SeqKV()
    fill(cache, a, 6 * BS, seed=1)
    assert cache.num_free == 0
    decoded_ref = reference(cache, torch.stack([blocks_of(cache, a.k_blocks[:4]),
                                                blocks_of(cache, a.v_blocks[:4])]), 8)
    result = cache.compress_tables([a], [4], 8, 64, limit=100)
    # fp32 blocks of 2 layers x 16 x 2 x 32: a K slot is 0.3125 of a block, a V slot 0.28125; each
    # arena (K, V) needs 2 hosts for 4 slots, so 8 blocks compressed free 4 pool blocks net.
    assert result.blocks == 8 and result.pool_blocks_freed == 4
    assert result.bytes_freed == 4 * cache.spec.block_bytes
    assert cache.num_free == 4 and cache.store.num_hosts == 4
    b = SeqKV()
    fill(cache, b, BS + 5, seed=2)  # 2 K + 2 V blocks: exactly what compression freed
    assert cache.num_free == 0
    assert torch.equal(blocks_of(cache, a.k_blocks[:4]), decoded_ref[0])  # the hosts were not reused
    assert torch.equal(blocks_of(cache, a.v_blocks[:4]), decoded_ref[1])
    cache.free(a)
    assert cache.store.num_hosts == 0 and len(cache.store) == 0  # the emptied arenas gave back their hosts
    cache.free(b)
    assert cache.pool.num_free == cache.num_blocks


def test_shared_blocks_are_compressed_only_with_every_holder_known() -> None:
    cache = make_cache(40, prefix=True)
    a = SeqKV()
    fill(cache, a, 4 * BS)
    tokens = list(range(4 * BS))
    cache.register(a, tokens)
    b = SeqKV()
    cache.attach(b, cache.match(tokens, 3), 0)
    fill(cache, b, BS, seed=3)
    shared = a.k_blocks[0]
    # b is not listed: a's first blocks have 3 references (a, b, the index) and stay as they are.
    assert cache.compress_tables([a], [2], 8, 64, limit=100).blocks == 0
    assert a.k_blocks[0] == shared
    result = cache.compress_tables([a, b], [2, 2], 8, 64, limit=100)
    assert result.blocks == 4
    assert a.k_blocks[:2] == b.k_blocks[:2] and a.k_blocks[0] < 0
    entry = cache.match(tokens, 3)[0]
    assert entry.k_block == a.k_blocks[0] and entry.v_block == a.v_blocks[0]
    assert cache.store.ref_count(a.k_blocks[0]) == 3
    assert cache.store.ref(b.k_blocks[0]) > 1  # shared compressed blocks are counted like pool blocks
    positions = cache.slot_positions(b)  # regenerated for the compressed blocks
    assert torch.equal(positions, torch.arange(b.num_slots, dtype=torch.int32).expand_as(positions))
    cache.free(a)
    cache.free(b)
    assert len(cache.eviction) == 4 and len(cache.store) == 4  # the index keeps the entries


class SpillRecorder:
    def __init__(self) -> None:
        self.payloads: dict[bytes, bytes] = {}

    def spill(self, entry, payload: PendingBytes, uses: int) -> None:
        self.payloads[entry.key] = payload.bytes()


def test_prefix_hit_and_eviction_of_compressed_cached_entries() -> None:
    sink = SpillRecorder()
    cache = make_cache(9, prefix=True, sink=sink)  # 8 usable blocks
    tokens, original = cached_chain(cache, 3)
    assert cache.num_free == 8 and len(cache.eviction) == 3
    assert cache.compress_cold(8, 64, cold_after=3600.0, limit=10).blocks == 0  # not cold yet
    result = cache.compress_cold(4, 64, cold_after=0.0, limit=10)
    assert result.blocks == 6 and result.pool_blocks_freed == 4  # 3 slots per arena, one host each
    # The hosts hold only evictable entries: evicting them would give the hosts back.
    assert cache.num_free == 8 and cache.store.num_hosts == 2
    entries = cache.match(tokens, 3)
    assert len(entries) == 3 and all(e.k_block < 0 and e.v_block < 0 for e in entries)
    assert cache.evictable_among(entries[:2]) == 2  # sharing them pins both hosts
    ref_k, ref_v = reference(cache, torch.stack(original), 4)
    b = SeqKV()
    cache.attach(b, entries[:2], 3 * BS)
    assert cache.num_free == 6
    assert torch.equal(blocks_of(cache, b.k_blocks), ref_k[:, :2])
    assert torch.equal(blocks_of(cache, b.v_blocks), ref_v[:, :2])
    fill(cache, b, BS + 1, seed=5)
    assert cache.num_free == 2
    cache.free(b)
    assert cache.num_free == 8 and len(cache.eviction) == 3
    # A request needing the whole pool evicts every compressed entry; the emptied arenas return hosts.
    c = SeqKV()
    fill(cache, c, 4 * BS, seed=6)
    assert len(cache.prefix) == 0 and len(cache.store) == 0 and cache.store.num_hosts == 0
    assert cache.num_free == 0
    # The disk store got the decoded blocks, in the layout of an uncompressed entry.
    first = torch.stack([ref_k[:, 0], ref_v[:, 0]]).contiguous().view(torch.uint8).numpy().tobytes()
    assert sink.payloads[entries[0].key] == first and len(sink.payloads) == 3


@pytest.mark.parametrize("from_codes,atol", [(False, 1e-6), (True, 1e-5)], ids=["decoded", "codes"])
def test_attention_over_compressed_blocks_equals_attention_over_the_dequantized_copy(from_codes: bool,
                                                                                     atol: float) -> None:
    hq = 4
    cache, dense = make_cache(60), make_cache(60)
    seqs = [SeqKV() for _ in range(3)]
    mirror = [SeqKV() for _ in range(3)]
    for i, (s, m) in enumerate(zip(seqs, mirror, strict=True)):
        fill(cache, s, (4 + i) * BS + 2 * i, seed=i)
        fill(dense, m, (4 + i) * BS + 2 * i, seed=i)
    cache.compress_tables(seqs, [2, 3, 4], 8, 32, limit=100)
    assert len(cache.store) == 2 * (2 + 3 + 4)
    for s, m in zip(seqs, mirror, strict=True):  # the reference holds the decoded blocks, uncompressed
        for table, mtable in ((s.k_blocks, m.k_blocks), (s.v_blocks, m.v_blocks)):
            decoded = blocks_of(cache, table)
            dense.kv[:, mtable] = decoded
    gen = torch.Generator().manual_seed(9)
    # Decode rows attend the compressed blocks from their codes (summed in another order) or decoded.
    backends = PagedAttention(cache, hq, from_codes=from_codes), PagedAttention(dense, hq)
    num_new = [1, 1, 5]  # two decode rows and a prefill chunk
    for c, group in ((cache, seqs), (dense, mirror)):
        for s, n in zip(group, num_new, strict=True):
            c.reserve(s, n)
    pos = torch.cat([torch.arange(s.num_slots, s.num_slots + n) for s, n in zip(seqs, num_new, strict=True)])
    for backend, group in zip(backends, (seqs, mirror), strict=True):
        backend.begin_step(group, num_new, pos)
    for layer in range(cache.spec.num_layers):
        t = sum(num_new)
        q, k, v = (torch.randn(t, n, 32, generator=gen) for n in (hq, 2, 2))
        out, ref = (b.attend(layer, q, k, v) for b in backends)
        torch.testing.assert_close(out, ref, rtol=0, atol=atol)
    for b in backends:
        b.end_step()


def test_worker_compresses_cold_blocks_and_stops_cleanly() -> None:
    cache = make_cache(20, prefix=True)
    a = SeqKV()
    fill(cache, a, 3 * BS)
    cache.register(a, list(range(3 * BS)))
    cache.free(a)
    lock = threading.Lock()

    def one_pass():
        with lock:
            return cache.compress_cold(8, 64, cold_after=0.0, limit=2)

    worker = CompressionWorker(one_pass, interval=0.01)
    worker.start()
    deadline = time.monotonic() + 60
    while len(cache.store) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.stop()
    assert not worker.running
    assert len(cache.store) == 6 and worker.total.blocks == 6
    assert worker.passes >= 3  # at most 2 blocks per pass
    passes = worker.passes
    time.sleep(0.05)
    assert worker.passes == passes  # stopped: no more passes


def test_bad_group_size_is_refused_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="groupSize 48 must divide head_dim 64"):
        block_codecs(16, 3, 64, 8, 48)


def test_hosts_freed_by_a_preemption_come_back_zeroed_and_a_replay_attends_over_them_cleanly() -> None:
    """A preemption frees a sequence's frozen precision-tier blocks; the emptied arenas hand their hosts
    back to the pool, and the next sequence gets them as K/V blocks whose unwritten slots attention
    reads (masked). Codec bytes there read as NaN in an fp32 pool and would make the row NaN."""
    hq = 4
    cache, dense = make_cache(9), make_cache(9)  # 8 usable blocks, the null block is 0
    a = SeqKV()
    fill(cache, a, 2 * BS)
    assert (a.k_blocks, a.v_blocks) == ([1, 2], [3, 4])
    cache.kv[:, 3] = torch.tensor([0.0, 0.0, 1.0, 1.0]).repeat(8)  # int8 codes 0, 0, 255, 255: NaN words
    assert freeze_blocks(cache, a, 0, [(8, 8)], 32) == 1
    hosts = {spec.axis: arena.hosts for spec, arena in cache.store.arenas.items()}
    assert hosts == {0: [5], 2: [6]}  # K and V arenas, one host each, taken after the freed 1 and 3
    assert not torch.isfinite(cache.kv[:, 6]).all()  # the V host's codec bytes, read as fp32
    cache.free(a)  # what a preemption does (``Scheduler.requeue_front``)
    assert len(cache.store) == 0 and cache.store.num_hosts == 0
    assert cache.pool.free_block_ids() == [7, 8, 1, 3, 2, 5, 4, 6]  # each arena's host after its table
    assert not cache.kv[:, [5, 6]].any()  # zeroed when the arenas emptied
    b, ref = SeqKV(), SeqKV()
    fill(cache, b, 3 * BS + 1, seed=3)
    fill(dense, ref, 3 * BS + 1, seed=3)
    assert (b.k_blocks, b.v_blocks) == ([7, 8, 1, 3], [2, 5, 4, 6])  # its last V block was the V host
    gen = torch.Generator().manual_seed(4)
    backends = PagedAttention(cache, hq), PagedAttention(dense, hq)
    for c, s, backend in ((cache, b, backends[0]), (dense, ref, backends[1])):
        c.reserve(s, 1)
        backend.begin_step([s], [1], torch.tensor([s.num_slots]))
    for layer in range(cache.spec.num_layers):
        q, k, v = (torch.randn(1, n, 32, generator=gen) for n in (hq, 2, 2))
        out, expected = (backend.attend(layer, q, k, v) for backend in backends)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_a_hit_on_compressed_entries_decodes_them_back_into_pool_blocks_when_admission_has_room() -> None:
    cache = make_cache(9, prefix=True)  # 8 usable blocks
    tokens, original = cached_chain(cache, 3)
    assert cache.compress_cold(4, 64, cold_after=0.0, limit=10).blocks == 6
    ref_k, ref_v = reference(cache, torch.stack(original), 4)
    # A reader that shares the compressed entries with no room to spare reads them through the codec.
    reader = SeqKV()
    cache.attach(reader, cache.match(tokens, 3)[:1], 0)
    assert reader.k_blocks[0] < 0 and reader.v_blocks[0] < 0
    # Room for two blocks: the first entry is shared (it stays), the second is decoded into the
    # two free pool blocks, and the third stays compressed.
    b = SeqKV()
    cache.attach(b, cache.match(tokens, 3), 0, spare=2)
    # Handles: the chain's tail was released first, so compressed first (-1, -2), its head last
    # (-5, -6, shared by the reader); the middle entry (-3, -4) comes back as pool blocks 3 and 6.
    assert (b.k_blocks, b.v_blocks) == ([-5, 3, -1], [-6, 6, -2])
    assert b.k_blocks[0] == reader.k_blocks[0] and b.v_blocks[0] == reader.v_blocks[0]
    entry = cache.match(tokens, 3)[1]
    assert (entry.k_block, entry.v_block) == (b.k_blocks[1], b.v_blocks[1])  # the index holds them too
    assert cache.store.ref(entry.k_block) == 2 and cache.store.ref(entry.v_block) == 2
    assert len(cache.store) == 4
    # The decoded blocks hold what the codec held, and the K block its positions again.
    assert torch.equal(blocks_of(cache, b.k_blocks), ref_k)
    assert torch.equal(blocks_of(cache, b.v_blocks), ref_v)
    assert torch.equal(cache.slot_positions(b), torch.arange(3 * BS).expand_as(cache.slot_positions(b)))
