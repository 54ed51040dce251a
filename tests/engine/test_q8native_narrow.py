"""Narrow int8 blocks (model/_q8avx2.c): 16-row weight blocks whose codes all lie in -16..15 (groups of
32: GGUF's Q5_0) or -32..31 (groups of 16: Q6_K) are flagged at packing, and the AVX2 path multiplies
them without the sign trick. The flags
are checked block by block, and the outputs (matmul and the fused greedy argmax) must equal the
sign-trick tile's bit for bit, partial blocks, ragged row counts and bf16 included.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from confkv_engine.model import q8native
from confkv_engine.model.quant import Int8GroupWeight, quantize_int8_groups

needs_avx2 = pytest.mark.skipif("avx2" not in q8native.supported_isas(), reason="this CPU has no avx2 path")


def narrow_weight(n: int, k: int, seed: int, group: int = 32) -> Int8GroupWeight:
    """Codes in -c..c-1 (c = 16 for groups of 32: Q5_0's; 32 for groups of 16: Q6_K's) with fp16
    group scales; rows 40 and 70 step out of the range."""
    c = 16 if group == 32 else 32
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-c, c, (n, k), generator=gen, dtype=torch.int8)
    q[40, 7] = c  # block 2 (rows 32-47) is not narrow
    q[min(70, n - 1), 3] = -c - 1  # nor the block of row 70
    scale = (torch.rand(n, k // group, generator=gen) * 0.01 + 0.001).half().float()
    return Int8GroupWeight(q, scale, group)


@pytest.mark.parametrize("group", [32, 16])
def test_flags_per_block(group: int) -> None:
    packed = q8native.pack(narrow_weight(75, 128, 0, group))  # 75 rows: block 4 is partial (zero rows pad it)
    assert packed.narrow is not None and packed.narrow.tolist() == [1, 1, 0, 1, 0]
    assert q8native.pack(quantize_int8_groups(torch.randn(32, 64), 16)).narrow is None  # groups of 16
    full = Int8GroupWeight(torch.full((16, 64), 127, dtype=torch.int8), torch.ones(16, 2), 32)
    assert q8native.pack(full).narrow is None  # no narrow block at all


@needs_avx2
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 16])
def test_outputs_equal_the_sign_trick(rows: int, dtype: torch.dtype, group: int) -> None:
    packed = q8native.pack(narrow_weight(75, 640, rows, group))
    plain = dataclasses.replace(packed, narrow=None)
    gen = torch.Generator().manual_seed(100 + rows)
    x = (torch.randn(rows, 640, generator=gen) * 3).to(dtype)
    x[0, :32] = 0  # an all-zero activation group
    got = q8native.matmul(x, packed, "avx2", threads=2)
    assert torch.equal(got, q8native.matmul(x, plain, "avx2", threads=2))
    argmax = q8native.bound_argmax(packed, "avx2", dtype)
    if argmax is not None:
        assert torch.equal(argmax(x), got.max(dim=-1).indices)
