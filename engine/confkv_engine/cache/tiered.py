"""Retention's precision tiers in the pool: a sequence's private blocks stored through the compressed
store, re-quantized to fewer bits, or dropped.

Retention (``retention.compaction``) lays a sequence out as ``[shared prefix][frozen][rewritable]``:
the *frozen* region is whole blocks, each holding slots of one precision tier (int8, int4, k4v2 or int2)
in every (layer, KV head), stored as negative handles in the same arenas the cache's compression
of cold blocks uses (``arena``, codec ``block_codecs``: keys per channel, values per token) and
decoded on read by the same gather (``KVCache.gather``). So attention needs no second dequant path.

Why these blocks are handled here and not by ``compress``: their K slots hold a different token
per (layer, head), so the handle keeps the positions (``CompressedStore.put(positions=...)``,
counted in the block's bytes), and every operation is on one sequence's *private* blocks: a block
with another holder (a shared prefix block, a prefix-cache entry) is refused, so a reader never
recompresses or demotes what it shares.
"""

from __future__ import annotations

from confkv_engine.cache.arena import block_codecs
from confkv_engine.cache.block_pool import is_compressed
from confkv_engine.cache.codec.blocks import CodecSpec, encode_rows
from confkv_engine.cache.layout import CacheSpec, SeqKV
from confkv_engine.cache.owner import BlockOwner as TieredCache

# (key bits, value bits) of a tier block: the two halves may differ (int4 keys with int2 values).
TierBits = tuple[int, int]


def tier_codecs(spec: CacheSpec, bits: TierBits, group: int) -> tuple[CodecSpec, CodecSpec]:
    """Per-layer (key, value) codecs of a tier block: the cache's compression codecs, keys at
    ``bits[0]`` and values at ``bits[1]``."""
    key_bits, value_bits = bits
    k, v = block_codecs(spec.block_size, spec.num_kv_heads, spec.head_dim, key_bits, group)
    if value_bits != key_bits:
        v = block_codecs(spec.block_size, spec.num_kv_heads, spec.head_dim, value_bits, group)[1]
    return k, v


def tier_pair_bytes(spec: CacheSpec, bits: TierBits, group: int) -> int:
    """Bytes of one K block plus one V block at ``bits``, all layers, the K block's positions included
    (what ``KVCache.seq_bytes`` counts for them)."""
    k, v = tier_codecs(spec, bits, group)
    positions = spec.num_layers * spec.block_size * spec.num_kv_heads * 4
    return (k.nbytes + v.nbytes) * spec.num_layers + positions


def _private(cache: TieredCache, blocks: list[int]) -> None:
    if any(b == cache.null_block or cache.store.ref(b) != 1 for b in blocks):
        raise ValueError("precision tiers act only on a sequence's private blocks (a shared block is "
                         "never recompressed or demoted by one of its readers)")


def freeze_blocks(cache: TieredCache, seq: SeqKV, start: int, bits: list[TierBits], group: int) -> int:
    """Store table entries ``start, start + 1, ...`` (K and V, private pool blocks) at ``bits[i]``.
    Stops at the first block the codec refuses (inf, nan, beyond fp16); returns the blocks stored."""
    bs = cache.spec.block_size
    for i, b in enumerate(bits):
        k_block, v_block = seq.k_blocks[start + i], seq.v_blocks[start + i]
        _private(cache, [k_block, v_block])
        if is_compressed(k_block) or is_compressed(v_block):
            raise ValueError("freeze_blocks takes pool blocks, not compressed ones")
        k_spec, v_spec = tier_codecs(cache.spec, b, group)
        try:  # copies: both pool blocks are freed before the arenas ask for a host
            k_rows = encode_rows(cache.kv[:, k_block], k_spec)
            v_rows = encode_rows(cache.kv[:, v_block], v_spec)
        except ValueError:
            return i
        positions = cache.pos[:, k_block * bs:(k_block + 1) * bs, :].clone()
        cache.free_blocks([k_block, v_block])
        seq.k_blocks[start + i] = cache.store.put(k_rows, k_spec, 1, None, lambda: cache.take_blocks(1)[0],
                                                  positions)
        seq.v_blocks[start + i] = cache.store.put(v_rows, v_spec, 1, None, lambda: cache.take_blocks(1)[0])
    return len(bits)


def requantize_block(cache: TieredCache, seq: SeqKV, index: int, bits: TierBits, group: int) -> None:
    """Re-encode the sequence's compressed block pair ``index`` at ``bits`` (a one-way demotion); a
    half already in its new codec (int4 keys of an int4 block going to k4v2) is left as it is."""
    _private(cache, [seq.k_blocks[index], seq.v_blocks[index]])
    specs = tier_codecs(cache.spec, bits, group)
    for table, spec in ((seq.k_blocks, specs[0]), (seq.v_blocks, specs[1])):
        handle = table[index]
        if not is_compressed(handle):
            raise ValueError("requantize_block takes compressed blocks")
        if cache.store.spec(handle) == spec:
            continue
        rows = encode_rows(cache.store.decode_block(handle), spec)
        positions = cache.store.positions(handle)
        cache.free_blocks([handle])
        table[index] = cache.store.put(rows, spec, 1, None, lambda: cache.take_blocks(1)[0], positions)


def drop_blocks(cache: TieredCache, seq: SeqKV, indices: list[int]) -> None:
    """Remove table entries ``indices`` (K and V) and their slots; later slots move down by whole
    blocks (positions of pool blocks travel with them)."""
    for i in sorted(set(indices), reverse=True):
        pair = [seq.k_blocks[i], seq.v_blocks[i]]
        _private(cache, pair)
        cache.free_blocks(pair)
        del seq.k_blocks[i], seq.v_blocks[i]
    seq.num_slots -= cache.spec.block_size * len(set(indices))
