"""The codec's range fit: at int2 each group's range is the shrunk [min, max] with the least decoded
squared error (``CodecSpec.shrink`` < 1), never worse than min/max per group, in the same stored
format, so the unchanged decoders (PyTorch and native) read it; int4 and int8 keep min/max. The
cache's codecs (``block_codecs``) use it with ``range_fit`` (cold-block compression does)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from confkv_engine.cache.arena import block_codecs
from confkv_engine.cache.codec import native
from confkv_engine.cache.codec.blocks import EncodedBlock, decode, decode_rows, encode, encode_rows
from confkv_engine.cache.codec.spec import KEY_SHRINK, VALUE_SHRINK, CodecSpec, key_spec
from confkv_engine.cache.kv_cache import SeqKV
from confkv_engine.cache.tiered import tier_codecs

BLOCK = (4, 16, 3, 64)  # [L, block_size, Hkv, D]


def gaussian(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(BLOCK[-1], generator=gen) * 3
    return torch.randn(BLOCK, generator=gen) * scale + torch.randn(BLOCK[-1], generator=gen)


def outliers(seed: int) -> torch.Tensor:
    """Heavy tails (Student t, 2 degrees of freedom), a few spikes 50x the rest and outlier channels."""
    gen = torch.Generator().manual_seed(seed)
    x = _student_t(gen)
    spikes = torch.rand(BLOCK, generator=gen) < 0.01
    x = torch.where(spikes, 50 * torch.randn(BLOCK, generator=gen), x)
    x[..., ::16] *= 20.0
    return x


def _student_t(gen: torch.Generator) -> torch.Tensor:
    z = torch.randn(BLOCK, generator=gen)
    chi2 = torch.randn(2, *BLOCK, generator=gen).square().sum(0)
    return z / (chi2 / 2).sqrt()


def group_errors(x: torch.Tensor, block: EncodedBlock) -> torch.Tensor:
    """Squared decode error of every group [*groups_shape] (decoded by the codec's decoder)."""
    spec = block.spec
    err = (decode(block) - x.float()).square().movedim(spec.axis, -1)
    return err.reshape(*spec.groups_shape, spec.group).sum(-1)


CASES = [(1, 16, "dq6"), (1, 16, "fp16"), (3, 64, "fp16"), (3, 32, "fp16"), (1, 8, "dq6")]


@pytest.mark.parametrize(("axis", "group", "params"), CASES)
@pytest.mark.parametrize("make", [gaussian, outliers])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shrink", [KEY_SHRINK, VALUE_SHRINK])
def test_the_fit_never_decodes_a_group_worse_than_min_max(axis, group, params, make, dtype, shrink) -> None:
    bits = 2
    x = make(axis + group).to(dtype)
    fitted = encode(x, bits, axis, group, params, shrink=shrink)
    plain = encode(x, bits, axis, group, params)
    e_fit, e_plain = group_errors(x, fitted), group_errors(x, plain)
    # The search compares errors as decoded; the block decode's fused multiply-add may round once
    # differently (the last bit of an element), hence the relative slack.
    assert (e_fit <= e_plain * (1 + 1e-5) + 1e-9).all()
    assert e_fit.sum() < 0.9 * e_plain.sum()  # the search finds something
    assert fitted.spec.nbytes == plain.spec.nbytes and fitted.to_bytes().shape == plain.to_bytes().shape


@pytest.mark.parametrize("bits", [8, 4])
def test_int8_and_int4_keep_min_max_exactly_and_the_cache_codecs_fit(bits: int) -> None:
    x = outliers(bits)
    for axis, group, params in CASES:
        assert torch.equal(encode(x, bits, axis, group, params, shrink=VALUE_SHRINK).to_bytes(),
                           encode(x, bits, axis, group, params).to_bytes())
    k_spec, v_spec = block_codecs(16, 3, 64, 2, 64, range_fit=True)
    assert (k_spec.shrink, v_spec.shrink) == (KEY_SHRINK, VALUE_SHRINK)
    assert block_codecs(16, 3, 64, 2, 64)[1].shrink == key_spec(BLOCK, 2).shrink == 1.0  # off by default
    assert CodecSpec(BLOCK, 2, 1, 16).shrink_factors == (1.0,)
    assert CodecSpec(BLOCK, 8, 1, 16, shrink=0.6) == CodecSpec(BLOCK, 8, 1, 16)  # unfitted: one codec
    assert CodecSpec(BLOCK, 4, 1, 16, shrink=0.6) == CodecSpec(BLOCK, 4, 1, 16)
    assert len(CodecSpec(BLOCK, 2, 1, 16, shrink=0.6).shrink_factors) == 9


@pytest.mark.parametrize(("axis", "group", "params"), [(0, 16, "dq6"), (0, 16, "fp16"), (2, 64, "fp16")])
def test_fitted_rows_decode_with_the_unchanged_decoders(axis, group, params, monkeypatch) -> None:
    """Rows encoded with the fit read back identically under a min/max spec (the decoders never read
    ``fit``), by the native decoder and by PyTorch's, and equal the per-block decode."""
    x = torch.stack([outliers(s)[0] for s in range(5)])  # [N, 16, 3, 64]
    bits = 2
    spec = CodecSpec((16, 3, 64), bits, axis, group, params, shrink=VALUE_SHRINK)
    rows = encode_rows(x, spec)
    assert not torch.equal(rows, encode_rows(x, replace(spec, shrink=1.0)))  # the fit changed something
    got = decode_rows(rows, spec)
    assert torch.equal(got, decode_rows(rows, replace(spec, shrink=1.0)))
    with monkeypatch.context() as m:
        m.setattr(native, "covers", lambda *a: False)
        assert torch.equal(got, decode_rows(rows, spec))
    one = EncodedBlock.from_bytes(rows[2], spec)
    assert torch.allclose(decode(one), got[2], rtol=1e-6, atol=1e-6)
    assert torch.equal(rows[2], encode(x[2], bits, axis, group, params, shrink=VALUE_SHRINK).to_bytes())


@pytest.mark.parametrize("shrink", [0.0, -0.5, 1.5])
def test_a_bad_shrink_is_refused(shrink: float) -> None:
    with pytest.raises(ValueError, match="shrink must be in"):
        CodecSpec(BLOCK, 4, 1, 16, "dq6", shrink=shrink)


def test_cold_int2_blocks_are_compressed_with_the_fit_and_tier_codecs_without() -> None:
    from tests.unit.test_cache_compression import BS, SMOLLM2, blocks_of, fill, make_cache

    cache = make_cache(40, torch.bfloat16, SMOLLM2)
    seq = SeqKV()
    fill(cache, seq, 4 * BS)
    before = blocks_of(cache, seq.v_blocks[:2])  # [L, 2, BS, Hkv, D]
    assert cache.compress_tables([seq], [2], 2, 64, limit=100).blocks == 4
    codecs = {fit: block_codecs(BS, SMOLLM2[1], SMOLLM2[2], 2, 64, 2, range_fit=fit)[1]
              for fit in (True, False)}
    flat = before.reshape(-1, *codecs[True].shape)
    got = blocks_of(cache, seq.v_blocks[:2])
    want = {fit: decode_rows(encode_rows(flat, spec), spec, torch.bfloat16).view_as(before)
            for fit, spec in codecs.items()}
    assert torch.equal(got, want[True]) and not torch.equal(got, want[False])
    err = {fit: (x.float() - before.float()).square().sum() for fit, x in ((True, got), (False, want[False]))}
    assert err[True] < err[False]
    assert tier_codecs(cache.spec, (2, 2), 64)[1].shrink == 1.0
