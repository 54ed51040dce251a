"""The native matmuls' activation quantization (model/_qacts.c) against its definition in torch.

The codes, scales and flips must be exact (the AVX2 path rounds eight lanes with one instruction
where the portable loop calls nearbyintf: the same rounding, ties to even); the fp32 group sums may
differ in the last bits (they add in another order). Rows above the parallel threshold go to
OpenMP threads, so one and two threads must agree exactly.
"""

from __future__ import annotations

import pytest
import torch

from confkv_engine.model import q8native

pytestmark = pytest.mark.skipif(not q8native.supported_isas(), reason="native library not built")


def expected(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The definition in fp32 torch ops, the same operations in the same order per element."""
    rows, k = x.shape
    xg = x.float().view(rows, k // 32, 32)
    amax = xg.abs().amax(-1)
    scale = amax / torch.full_like(amax, 127)
    # (a tensor divided by a tensor: torch rounds ``127 / amax``, a scalar by a tensor, differently
    # from IEEE division, which the kernel does)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    q = torch.round(xg * inv[..., None])  # round half to even, as nearbyintf in the default mode
    halves = q.view(rows, k // 32, 2, 16).sum(-1)
    total = (scale.double() * halves.sum(-1).double()).sum(-1)
    return {"q": q.to(torch.int8).view(rows, k), "s": scale,
            "flip16": (128 * scale[..., None] * halves).view(rows, -1),
            "flip32": 128 * scale * halves.sum(-1), "xsum": xg.sum(-1), "off": (128 * total).float(),
            "isum": halves.to(torch.int32).view(rows, -1)}


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Random rows with an all-zero group, an outlier, and exact ties (x / s = m + 0.5) in one group."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * 2
    x[0, :32] = 0
    x[-1, 40] = 500.0
    ties = torch.arange(32, dtype=torch.float32) - 15.5  # x / s = m + 0.5 with amax 127: s = 1
    ties[0] = 127.0
    x[rows // 2, 32:64] = ties
    return x


@pytest.mark.parametrize("rows,k", [(1, 96), (5, 576), (300, 96), (64, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codes_scales_and_flips_are_exact(rows: int, k: int, dtype: torch.dtype) -> None:
    x = activations(rows, k, rows + k).to(dtype)
    got, want = q8native.quantized_activations(x, threads=2), expected(x)
    assert torch.equal(got["q"], want["q"])
    assert torch.equal(got["s"], want["s"])
    assert torch.equal(got["flip16"], want["flip16"])
    assert torch.equal(got["flip32"], want["flip32"])
    assert torch.equal(got["isum"], want["isum"])
    torch.testing.assert_close(got["xsum"], want["xsum"], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got["off"], want["off"], rtol=1e-6, atol=1e-5)
    assert got["q"][rows // 2, 32:64].tolist()[1:4] == [-14, -14, -12]  # -14.5, -13.5, -12.5: ties to even


def test_threads_agree_exactly() -> None:
    x = activations(256, 576, 7)  # 256 x 576 is above the parallel threshold
    one, two = q8native.quantized_activations(x, threads=1), q8native.quantized_activations(x, threads=2)
    assert all(torch.equal(one[n], two[n]) for n in one)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="not \\[rows, 32 m\\]"):
        q8native.quantized_activations(torch.zeros(2, 40))
    with pytest.raises(ValueError):
        q8native.quantized_activations(torch.zeros(2, 64, dtype=torch.float16))
