"""``attention.causal_chunks`` equals one masked ``scaled_dot_product_attention`` call: chunks that
cross query slices, chunks after cached slots, sliding windows shorter and longer than a slice,
grouped query heads, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from confkv_engine.attention import causal_chunks


def _reference(q, k, v, first, window):
    t, hq, d = q.shape
    s, hkv, _ = k.shape
    query = first + torch.arange(t)[:, None]
    key = torch.arange(s)[None, :]
    visible = (key <= query) & ((key > query - window) if window else True)
    kh = k.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    vh = v.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), kh, vh, attn_mask=visible)
    return out.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "first", "window"), [(300, 0, None), (300, 37, None), (1, 90, None),
                                                  (300, 0, 64), (200, 150, 200), (129, 10, 1)])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 1, 256), (9, 3, 64), (2, 2, 32)])
def test_sliced_attention_equals_one_masked_call(dtype, t, first, window, hq, hkv, d):
    gen = torch.Generator().manual_seed(t + first + d)
    s = first + t + 5  # keys past the chunk's last query exist and must stay hidden
    q, k, v = (torch.randn(n, h, d, generator=gen).to(dtype) for n, h in ((t, hq), (s, hkv), (s, hkv)))
    got = causal_chunks.attend(q, k, v, first, window)
    assert got.shape == q.shape and got.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), _reference(q, k, v, first, window), **tol)
