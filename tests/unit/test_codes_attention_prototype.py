"""The codes-attention prototype (testkit.codes_attention, timed by bench.micro.codes_attention)
equals decode-then-attend on random int4 blocks: GQA ratios 1 and 3, head dims 64 and 128, fp32 and
bf16 queries (the prototype computes in fp32; the reference gets the same fp32 queries). Needs gcc
and the native codec."""

import shutil

import pytest
import torch

from confkv_engine.cache.codec import native

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or not native.available(),
                                reason="needs gcc and the built native codec")


@pytest.fixture(scope="module")
def lib():
    from testkit.codes_attention import build
    return build()


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_codes_attention_equals_decode_then_attend(lib, group, dim, dtype, parts):
    from testkit.codes_attention import Blocks
    torch.manual_seed(group * dim + parts)
    b = Blocks(11, heads=2, group=group, dim=dim, dtype=dtype)
    got, want = b.from_codes(lib, parts), b.reference()
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4
