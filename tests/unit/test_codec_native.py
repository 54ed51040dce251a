"""The native block decoder (``cache/codec/_dequant.c``) against the codec's PyTorch decode: the same
values to the bit, for every bits / axis / group / parameter format and fp32 / bf16 tables, placed
by runs like a gathered table. The library is built by ``pip install`` (``setup.py``); a machine
without a C compiler decodes with PyTorch and these tests are skipped there."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.cache.codec import native
from confkv_engine.cache.codec.blocks import decode_rows, encode_rows
from confkv_engine.cache.codec.spec import CodecSpec

pytestmark = pytest.mark.skipif(not native.available(), reason="the native decoder was not built here")

SPECS = [(axis, group, params) for axis, group, params in
         ((0, 16, "fp16"), (0, 16, "dq6"), (0, 8, "dq6"), (2, 64, "fp16"), (2, 32, "fp16"))]


def _torch_decode(rows, spec, monkeypatch, **kw):
    with monkeypatch.context() as m:
        m.setattr(native, "covers", lambda *a: False)
        return decode_rows(rows, spec, **kw)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(("axis", "group", "params"), SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_equals_torch(bits, axis, group, params, dtype, monkeypatch):
    torch.manual_seed(bits * 10 + axis)
    x = torch.randn(7, 16, 3, 64) * torch.rand(1, 1, 3, 64) * 4 + torch.randn(1, 1, 3, 64)
    spec = CodecSpec((16, 3, 64), bits, axis, group, params)
    rows = encode_rows(x, spec)
    got = decode_rows(rows, spec, dtype=dtype)
    assert torch.equal(got, _torch_decode(rows, spec, monkeypatch, dtype=dtype))
    assert got.dtype == dtype and got.shape == (7, 16, 3, 64)


def test_native_decode_places_runs_and_leaves_other_rows(monkeypatch):
    spec = CodecSpec((16, 3, 64), 4, 0, 16, "dq6")
    rows = encode_rows(torch.randn(5, 16, 3, 64), spec)
    runs = ((1, 0, 2), (6, 3, 2))  # decoded row 2 is placed by no run
    got = torch.full((9, 16, 3, 64), 7.0)
    want = torch.full((9, 16, 3, 64), 7.0)
    decode_rows(rows, spec, out=got, runs=runs)
    _torch_decode(rows, spec, monkeypatch, out=want, runs=runs)
    assert torch.equal(got, want)
    assert torch.equal(got[0], torch.full((16, 3, 64), 7.0))


def test_native_decode_refuses_rows_past_the_table():
    spec = CodecSpec((16, 3, 64), 4, 2, 64)
    rows = encode_rows(torch.randn(2, 16, 3, 64), spec)
    with pytest.raises(ValueError, match="past the table"):
        native.decode_into(rows, spec, torch.ones(2, spec.num_groups), torch.zeros(2, spec.num_groups),
                           torch.empty(2, 16, 3, 64), torch.tensor([0, 2]))
