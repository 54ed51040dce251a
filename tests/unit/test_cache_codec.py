"""KV block codec: error bounds per bits, exact packing, constant groups, bytes layout and sizes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from confkv_engine.cache.arena import MAX_RUNS, Arena, row_runs
from confkv_engine.cache.codec.bitpack import pack, pack6, unpack, unpack6
from confkv_engine.cache.codec.blocks import EncodedBlock, decode, decode_rows, encode, encode_rows
from confkv_engine.cache.codec.group_quant import quantize
from confkv_engine.cache.codec.spec import CodecSpec, encoded_nbytes, key_spec, value_spec
from confkv_engine.cache.kv_cache import CacheSpec, KVCache

SMOLLM2_BLOCK = (30, 16, 3, 64)  # [L, block_size, Hkv, D]
SMALL_BLOCK = (2, 16, 2, 32)


def kv_like(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Gaussian block with per-channel offsets and a few outlier channels (as post-RoPE keys)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    channel_scale = torch.ones(shape[-1])
    channel_scale[:: max(shape[-1] // 4, 1)] = 20.0
    return x * channel_scale + torch.randn(shape[-1], generator=gen)


def group_ranges(x: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    """max - min of every group, broadcast back over the block (the reference for the bound)."""
    moved = x.float().movedim(spec.axis, -1)
    g = moved.reshape(*moved.shape[:-1], -1, spec.group)
    rng = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)).expand_as(g)
    return rng.reshape(moved.shape).movedim(-1, spec.axis)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize(("axis", "group"), [(1, 16), (1, 8), (3, 32), (3, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_within_half_a_step_of_the_group_range(
        bits: int, axis: int, group: int, dtype: torch.dtype) -> None:
    x = kv_like(SMALL_BLOCK).to(dtype)
    block = encode(x, bits, axis, group)
    y = decode(block, torch.float32)
    assert y.shape == x.shape and y.dtype == torch.float32
    half_step = group_ranges(x, block.spec) / (2 * ((1 << bits) - 1))
    err = (y - x.float()).abs()
    # fp16 scales are rounded up: at most 2**-10 relative on the step, plus fp32 arithmetic.
    assert (err <= half_step * (1 + 2**-9) + 1e-5).all()
    assert err.max() > 0  # the data is not on the grid: the bound is not vacuous
    y_model = decode(block, dtype)
    assert y_model.dtype == dtype
    rel = 2**-8 if dtype == torch.bfloat16 else 2**-11
    assert ((y_model.float() - y).abs() <= y.abs() * rel + 1e-6).all()


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_fp16_rounding_of_min_and_scale_never_clamps_an_element(bits: int) -> None:
    """Far from zero, fp16 spacing (0.5 at 1000) exceeds the group's range: min rounds down, scale up."""
    gen = torch.Generator().manual_seed(bits)
    x = 1000.3 + 0.01 * torch.rand(6, 16, generator=gen)
    x[:3] *= -1
    block = encode(x, bits, axis=1, group=16)
    assert (block.mins.float() <= x.amin(1, keepdim=True)).all()
    step = block.scales.float()  # [6, 1]
    top = block.mins.float() + step * ((1 << bits) - 1)
    assert (top >= x.amax(1, keepdim=True)).all()
    assert ((decode(block) - x).abs() <= step / 2 + 1e-4).all()


def _dq6_check(x: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    """dq6 invariants on every group of ``x``; returns the decode error [groups..., group]."""
    block = encode(x, spec.bits, spec.axis, spec.group, "dq6")
    headers = block.params[0].float()  # [*rows, 3]: top, floor, step
    g = x.float().movedim(spec.axis, -1).reshape(*spec.groups_shape, spec.group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales, mins = block.scales, block.mins
    levels = (1 << spec.bits) - 1
    assert (mins <= lo).all() and (mins + levels * scales >= hi).all()
    row = (*spec.rows_shape, 1, 1)
    top, step = headers[..., 0].reshape(row), headers[..., 2].reshape(row)
    widest = 2 ** (1 / 8) * (hi - lo + step) / levels * (1 + 2**-9) + 1e-7  # one scale code coarser
    assert ((scales <= widest) | (scales <= top * 2 ** (-63 / 8) * (1 + 1e-6))).all()
    y = decode(block).float().movedim(spec.axis, -1).reshape(g.shape)
    err = (y - g).abs()
    assert (err <= scales[..., None] / 2 * (1 + 2**-9) + 1e-5 + g.abs() * 2**-23).all()  # fp32 ulps
    return err


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dq6_keys_stay_on_the_grid_within_half_a_step_of_a_near_tight_scale(bits: int, dtype) -> None:
    x = kv_like(SMOLLM2_BLOCK, seed=bits).to(dtype)
    err = _dq6_check(x, key_spec(SMOLLM2_BLOCK, bits))
    assert err.max() > 0
    fp16 = decode(encode(x, bits, 1, 16)) - x.float()
    dq6 = decode(encode(x, bits, 1, 16, "dq6")) - x.float()
    assert dq6.pow(2).mean() < 1.3 * fp16.pow(2).mean()  # 6-bit parameters cost little


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_dq6_groups_far_from_zero_and_constant_groups_keep_the_bound(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    far = 1000.3 + 0.01 * torch.rand(2, 16, 3, 64, generator=gen)
    far[:, :, :, :32] *= -1  # one row spans -1000..1000: its min step is about 32
    _dq6_check(far, key_spec(tuple(far.shape), bits))
    const = torch.zeros(SMALL_BLOCK)
    const[0, :, 0, 3] = 1.5
    const[1, :, 1] = -3.125
    _dq6_check(const, key_spec(SMALL_BLOCK, bits))
    zeros = torch.zeros(SMALL_BLOCK)
    assert torch.equal(decode(encode(zeros, bits, 1, 16, "dq6")), zeros)


def test_six_bit_codes_pack_four_per_three_bytes_low_bits_first() -> None:
    assert pack6(torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)).tolist() == [
        [(1 | 2 << 6) & 255, (2 >> 2 | 3 << 4) & 255, (3 >> 4 | 4 << 2) & 255]]
    codes = torch.randint(0, 64, (3, 5, 7), dtype=torch.uint8)
    packed = pack6(codes)
    assert packed.shape == (3, 5, 6)  # 7 codes -> 2 words of 4
    assert torch.equal(unpack6(packed, 7), codes)


def test_keys_grouped_per_channel_beat_per_token_on_outlier_channels() -> None:
    keys = kv_like(SMOLLM2_BLOCK)
    per_channel = decode(encode(keys, 4, axis=1, group=16))
    per_token = decode(encode(keys, 4, axis=3, group=64))
    err_channel = (per_channel - keys).pow(2).mean()
    err_token = (per_token - keys).pow(2).mean()
    assert err_channel < 0.2 * err_token


def test_values_on_the_grid_are_recovered_exactly() -> None:
    for bits in (8, 4, 2):
        levels = (1 << bits) - 1
        codes = torch.randint(0, levels + 1, (4, 3, 16), generator=torch.Generator().manual_seed(bits))
        codes[..., 0], codes[..., 1] = 0, levels  # every group spans the full range
        x = -2.0 + 0.25 * codes.float()
        block = encode(x, bits, axis=2, group=16)
        assert torch.equal(unpack(block.codes, bits).reshape(codes.shape), codes.to(torch.uint8))
        assert torch.equal(decode(block), x)


def test_constant_groups_decode_exactly_with_zero_scale() -> None:
    x = torch.zeros(SMALL_BLOCK)
    x[0] = 1.5
    x[1, :, 1] = -3.125
    for bits in (8, 4, 2):
        block = encode(x, bits, axis=1, group=16)
        assert torch.equal(decode(block), x)
        assert (block.scales == 0).all()
    assert torch.equal(decode(encode(torch.full((2, 8), 7.0), 2, axis=-1, group=4)), torch.full((2, 8), 7.0))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_packing_round_trip_is_exact(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (5, 7, 16), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (5, 7, 16 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits), codes)


def test_packing_puts_the_first_code_in_the_low_bits() -> None:
    assert pack(torch.tensor([[0xA, 0x5]], dtype=torch.uint8), 4).tolist() == [[0x5A]]
    assert pack(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).tolist() == [[1 | 2 << 2 | 3 << 4]]


@pytest.mark.parametrize(("bits", "axis", "group"), [(8, 1, 16), (4, 1, 8), (2, 3, 32), (4, 3, 16)])
def test_bytes_round_trip_is_exact_and_sized_exactly(bits: int, axis: int, group: int) -> None:
    x = kv_like(SMALL_BLOCK, seed=3).to(torch.bfloat16)
    block = encode(x, bits, axis, group)
    buf = block.to_bytes()
    assert buf.dtype == torch.uint8 and buf.shape == (encoded_nbytes(SMALL_BLOCK, bits, axis, group),)
    back = EncodedBlock.from_bytes(buf, block.spec)
    assert torch.equal(back.to_bytes(), buf)
    assert torch.equal(decode(back, torch.bfloat16), decode(block, torch.bfloat16))


def test_odd_code_bytes_are_padded_and_still_round_trip() -> None:
    spec = CodecSpec((3, 5), bits=8, axis=1, group=5)
    assert (spec.codes_nbytes, spec.nbytes) == (15, 16 + 4 * 3)
    x = torch.arange(15.0).reshape(3, 5) / 7
    rows = encode_rows(x.unsqueeze(0).repeat(2, 1, 1), spec)
    assert rows.shape == (2, 28)
    assert torch.equal(decode_rows(rows, spec)[1], decode(encode(x, 8, 1, 5)))


# dq6 keys: per (layer, head) one 6-byte header and 64 channels x 2 six-bit codes (96 bytes).
@pytest.mark.parametrize(("spec", "expected"), [
    (key_spec(SMOLLM2_BLOCK, 8), 92160 + 90 * (6 + 96)),
    (key_spec(SMOLLM2_BLOCK, 4), 46080 + 90 * (6 + 96)),
    (key_spec(SMOLLM2_BLOCK, 2), 23040 + 90 * (6 + 96)),
    (key_spec(SMOLLM2_BLOCK, 8, params="fp16"), 92160 + 4 * 5760),
    (key_spec(SMOLLM2_BLOCK, 4, params="fp16"), 46080 + 4 * 5760),
    (value_spec(SMOLLM2_BLOCK, 8), 92160 + 4 * 1440),
    (value_spec(SMOLLM2_BLOCK, 4), 46080 + 4 * 1440),
    (value_spec(SMOLLM2_BLOCK, 2), 23040 + 4 * 1440),
    (value_spec(SMOLLM2_BLOCK, 4, group=32), 46080 + 4 * 2880),
])
def test_encoded_size_is_exact_for_the_smollm2_block(spec: CodecSpec, expected: int) -> None:
    x = kv_like(SMOLLM2_BLOCK)
    assert spec.nbytes == expected
    assert encode(x, spec.bits, spec.axis, spec.group, spec.params).to_bytes().numel() == expected


def test_byte_ratios_against_the_model_dtype_block() -> None:
    """The table in the docstring of ``cache.codec_spec``; prints it (pytest -s)."""
    elems = 30 * 16 * 3 * 64
    bf16, fp32 = 2 * elems, 4 * elems
    layouts = (("K g16 dq6", lambda b: key_spec(SMOLLM2_BLOCK, b)),
               ("K g16 fp16", lambda b: key_spec(SMOLLM2_BLOCK, b, params="fp16")),
               ("V g64", lambda b: value_spec(SMOLLM2_BLOCK, b)),
               ("V g32", lambda b: value_spec(SMOLLM2_BLOCK, b, 32)))
    for name, make in layouts:
        ratios = {bits: make(bits).nbytes for bits in (8, 4, 2)}
        print(name, " ".join(f"int{b}: {n / bf16:.4f}x bf16 {n / fp32:.4f}x fp32" for b, n in ratios.items()))
    for make in (key_spec, value_spec):  # both meet the targets at bf16, scales included
        assert make(SMOLLM2_BLOCK, 8).nbytes <= 0.55 * bf16
        assert make(SMOLLM2_BLOCK, 4).nbytes <= 0.30 * bf16
    assert [key_spec(SMOLLM2_BLOCK, b).nbytes / bf16 for b in (8, 4, 2)] == [0.5498046875, 0.2998046875,
                                                                           0.1748046875]
    # fp16 parameters on 16-token key groups miss both: 4 bytes of scale + min per group.
    assert key_spec(SMOLLM2_BLOCK, 8, params="fp16").nbytes / bf16 == 0.625
    assert key_spec(SMOLLM2_BLOCK, 4, params="fp16").nbytes / bf16 == 0.375


@pytest.mark.parametrize("make", [key_spec, value_spec])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_batched_decode_matches_per_block_decode(make: Callable[..., CodecSpec], bits: int) -> None:
    spec = make(SMALL_BLOCK, bits)
    blocks = torch.stack([kv_like(SMALL_BLOCK, seed=s) for s in range(5)]).to(torch.bfloat16)
    pool = encode_rows(blocks, spec)  # [N, nbytes], row i = block i
    one = encode(blocks[2], bits, spec.axis, spec.group, spec.params, spec.shrink)  # the range fit too
    assert torch.equal(pool[2], one.to_bytes())
    ids = torch.tensor([4, 0, 2, 2])
    rows = pool[ids]
    expected = torch.stack([decode(EncodedBlock.from_bytes(pool[i], spec), torch.bfloat16) for i in ids])
    assert torch.equal(decode_rows(rows, spec, torch.bfloat16), expected)
    for layer in range(SMALL_BLOCK[0]):
        got = decode_rows(rows, spec, torch.bfloat16, layer=layer)
        assert got.shape == (4, *SMALL_BLOCK[1:]) and got.is_contiguous()
        assert torch.equal(got, expected[:, layer])


@pytest.mark.parametrize("spec", [key_spec(SMALL_BLOCK, 4), value_spec(SMALL_BLOCK, 2),
                                  value_spec(SMALL_BLOCK, 4, group=16)])  # one group / several
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_in_place_by_runs_writes_exactly_the_runs_rows(spec: CodecSpec, dtype: torch.dtype) -> None:
    blocks = torch.stack([kv_like(SMALL_BLOCK, seed=s) for s in range(5)])
    rows = encode_rows(blocks, spec)
    expected = decode_rows(rows, spec, dtype)
    out = torch.full((9, *SMALL_BLOCK), 7.0, dtype=dtype)
    runs = ((1, 0, 2), (6, 2, 3))  # decoded rows 0-1 at out rows 1-2, rows 2-4 at out rows 6-8
    assert decode_rows(rows, spec, dtype, out=out, runs=runs) is out
    assert torch.equal(out[1:3], expected[:2]) and torch.equal(out[6:9], expected[2:])
    assert bool((out[[0, 3, 4, 5]] == 7.0).all())
    whole = torch.empty_like(expected)
    assert torch.equal(decode_rows(rows, spec, dtype, out=whole), expected)


def test_gather_runs_are_consecutive_table_rows_and_too_many_fall_back_to_a_copy() -> None:
    assert row_runs([3, 4, 5, 9, 10]) == ((3, 0, 3), (9, 3, 2))
    assert row_runs(list(range(0, 2 * MAX_RUNS, 2))) == tuple((2 * i, i, 1) for i in range(MAX_RUNS))
    assert row_runs(list(range(0, 2 * MAX_RUNS + 2, 2))) is None


def test_slot_reads_match_the_byte_index_for_slots_inside_adjacent_and_apart_hosts() -> None:
    spec = value_spec(SMALL_BLOCK, 4)
    host_bytes = 3 * spec.nbytes // 2 + 1  # slots straddle hosts at different offsets
    arena = Arena(spec, host_bytes)
    hosts = iter([4, 5, 1, 7, 8])  # 4 -> 5 and 7 -> 8 are neighbours in the pool, 5 -> 1 and 1 -> 7 not
    slots = [arena.take_slot(lambda: next(hosts)) for _ in range(5)]
    stream = torch.randint(0, 256, (10 * host_bytes,), dtype=torch.uint8)
    reads = arena.slot_reads(slots, torch.device("cpu"))
    assert reads.apart is not None and 0 < reads.apart.numel() < len(slots)
    expected = stream[arena.byte_index(torch.tensor(slots))].view(len(slots), spec.nbytes)
    assert torch.equal(reads.read(stream, spec.nbytes), expected)


def test_quantize_works_on_stacked_blocks_like_one_at_a_time() -> None:
    spec = key_spec(SMALL_BLOCK, 4)
    blocks = torch.stack([kv_like(SMALL_BLOCK, seed=s) for s in range(3)])
    codes, scales, mins = quantize(blocks, spec)
    one = quantize(blocks[1], spec)
    assert torch.equal(codes[1], one[0]) and torch.equal(scales[1], one[1]) and torch.equal(mins[1], one[2])


def test_bad_specs_and_inputs_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="bits must be one of"):
        CodecSpec(SMALL_BLOCK, 3, 1, 16)
    with pytest.raises(ValueError, match="must divide the axis length 16"):
        CodecSpec(SMALL_BLOCK, 8, 1, 5)
    with pytest.raises(ValueError, match="packs 4 codes per byte"):
        CodecSpec((2, 6), 2, 1, 6)
    with pytest.raises(ValueError, match="params must be one of"):
        CodecSpec(SMALL_BLOCK, 8, 1, 16, "fp8")
    with pytest.raises(ValueError, match="at least 2 axes"):
        CodecSpec((16,), 8, 0, 16, "dq6")
    with pytest.raises(ValueError, match="axis 4 is out of range"):
        CodecSpec(SMALL_BLOCK, 8, 4, 2)
    x = kv_like(SMALL_BLOCK)
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="inf, nan"):
        encode(x, 8, 1, 16)
    with pytest.raises(ValueError, match="65504"):
        encode(torch.full(SMALL_BLOCK, 1e5), 8, 1, 16)
    spec = key_spec(SMALL_BLOCK, 8)
    with pytest.raises(ValueError, match=f"uint8 encodings of {spec.nbytes} bytes"):
        EncodedBlock.from_bytes(torch.zeros(spec.nbytes - 2, dtype=torch.uint8), spec)
    with pytest.raises(ValueError, match="expected a tensor ending in shape"):
        encode_rows(torch.zeros(2, 3, 16, 2, 32), spec)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        decode_rows(torch.zeros(1, spec.nbytes, dtype=torch.uint8), spec, layer=2)


def test_blocks_of_the_paged_cache_encode_and_decode_per_layer_in_its_layout() -> None:
    """kv[L, num_blocks, bs, Hkv, D]: encode some block ids at once, decode one layer as kv[l, ids]."""
    spec_kv = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16,
                        dtype=torch.bfloat16, device=torch.device("cpu"))
    cache = KVCache(spec_kv, num_blocks=6)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(5)))
    ids = torch.tensor([4, 1, 3])
    blocks = cache.kv[:, ids].movedim(1, 0)  # [N, L, bs, Hkv, D]
    for make, bits in ((key_spec, 8), (value_spec, 4)):
        spec = make(tuple(blocks.shape[1:]), bits)
        rows = encode_rows(blocks, spec)
        for layer in range(2):
            got = decode_rows(rows, spec, torch.bfloat16, layer=layer)
            ref = cache.kv[layer, ids].float()
            step = (ref.amax() - ref.amin()) / ((1 << bits) - 1)
            assert got.shape == ref.shape and (got.float() - ref).abs().max() <= step
