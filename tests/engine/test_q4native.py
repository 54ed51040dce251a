"""The native int4 matmul (``q4n``: model/_q8matmul.c's 4-bit blocks) against a reference, and the
kernel plan per CPU.

The SIMD paths run on this machine only where its CPU has them; a path the CPU lacks is skipped
(and says so), never faked. The AVX2 path is run explicitly on AVX-512 machines too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from confkv_engine.model import kernels, native, q8native
from confkv_engine.model.qlinear import build_quant_linear
from confkv_engine.model.quant import Int4Weight, quantize_int4

needs_library = pytest.mark.skipif(not q8native.supported_isas(), reason="native library not built")


def reference(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """The kernel's maths in float64: int8 activations per group of 32, centred int4 codes."""
    rows, k = x.shape
    xg = x.double().view(rows, k // 32, 32)
    scale = xg.abs().amax(-1) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    a = torch.round((xg * inv[..., None]).float()).double()  # round half to even, as the kernel
    q = (w.q.double() - 8).view(w.q.shape[0], k // 32, 32)
    dots = torch.einsum("rgj,ngj->rng", a, q) * scale[:, None, :] * w.scale.double()[None]
    offsets = torch.einsum("rg,ng->rn", xg.sum(-1), w.zero.double())
    return (dots.sum(-1) + offsets).float()


def isa_param(isa: str):  # noqa: ANN201
    have = isa in q8native.supported_isas()
    return pytest.param(isa, marks=pytest.mark.skipif(not have, reason=f"this CPU has no {isa} path"))


@needs_library
@pytest.mark.parametrize("isa", [isa_param("scalar"), isa_param("avx2"), isa_param("vnni")])
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9, 33])
@pytest.mark.parametrize(("n", "shift"), [(72, 0.0), (37, 0.3)])  # 37: a partial block; 0.3: large zeros
def test_native_matches_reference(isa: str, rows: int, n: int, shift: float) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = quantize_int4(torch.randn(n, 96, generator=gen) * 0.05 + shift)
    x = torch.randn(rows, 96, generator=gen)
    x[0, :32] = 0.0  # an all-zero group: scale 0, no division by zero
    y = q8native.matmul(x, q8native.pack_int4(w), isa, threads=2)
    ref = reference(x, q8native.int4_as_served(w))  # its fp16 scale and minimum
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    # against the dense fp32 matmul of the same weights: only the int8 activations differ
    dense = x @ w.dequantize().t()
    assert ((y - dense).norm() / dense.norm()).item() < 0.02


@needs_library
def test_bf16_in_bf16_out() -> None:
    gen = torch.Generator().manual_seed(1)
    w = quantize_int4(torch.randn(64, 64, generator=gen))
    x = torch.randn(5, 64, generator=gen).bfloat16()
    y = q8native.matmul(x, q8native.pack_int4(w), "scalar")
    assert y.dtype == torch.bfloat16
    ref = reference(x.float(), q8native.int4_as_served(w))  # within one bf16 rounding (8 bits)
    assert torch.allclose(y.float(), ref, rtol=2 ** -8, atol=1e-3 * ref.abs().max().item())


@needs_library
def test_bad_shapes_are_clear_errors() -> None:
    packed = q8native.pack_int4(quantize_int4(torch.randn(8, 64)))
    with pytest.raises(ValueError, match="does not fit"):
        q8native.matmul(torch.randn(2, 32), packed, "scalar")
    with pytest.raises(ValueError, match="groups of 32"):
        q8native.pack_int4(quantize_int4(torch.randn(8, 64), group=64))
    assert q8native.matmul(torch.randn(0, 64), packed, "scalar").shape == (0, 8)


def test_pack_int4_layout() -> None:
    """Block b, chunk c, lane l, byte i: row 16 b + l, input 8 c + i (low nibble) and 8 c + 4 + i
    (high nibble); fp16 scales and minimums (``zero - 8 scale``) per block and group with the 16
    rows together, zero past N; the served values within fp16 rounding of the weight's."""
    w = quantize_int4(torch.randn(20, 64))
    packed = q8native.pack_int4(w)
    assert packed.q.shape == (2, 8, 16, 4) and packed.shape == (20, 64)
    byte = int(packed.q[1, 3, 2, 1])
    assert (byte & 15, byte >> 4) == (int(w.q[18, 25]), int(w.q[18, 29]))
    assert packed.scale.dtype == packed.minimum.dtype == torch.float16
    assert torch.equal(packed.scale[1, 1, :4], w.scale[16:20, 1].half())
    assert not packed.minimum[1, :, 4:].any()
    served = q8native.int4_as_served(w).dequantize()
    assert ((served - w.dequantize()).abs() <= 2 ** -10 * w.dequantize().abs().amax()).all()


def test_isa_from_flags_and_mask() -> None:
    full = frozenset({"avx2", "fma", "avx512f", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16"})
    assert native.isa_for(full) == "vnni"
    capped = kernels.mask_flags(full, "avx2")
    assert capped == frozenset({"avx2", "fma"}) and native.isa_for(capped) == "avx2"
    assert not kernels.CpuInfo("AVX2", capped, "x").native_bf16
    assert native.isa_for(kernels.mask_flags(full, "generic")) == "scalar"
    with pytest.raises(ValueError, match="CONFKV_CPU_ISA"):
        kernels.mask_flags(full, "avx3")


def test_cpu_isa_switch_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONFKV_CPU_ISA", "avx2")
    kernels.cpu_info.cache_clear()
    try:
        info = kernels.cpu_info()
        assert not any(f.startswith(("avx512", "amx")) for f in info.flags)
        assert kernels.activation_dtype(info) == torch.float32
    finally:
        monkeypatch.delenv("CONFKV_CPU_ISA")
        kernels.cpu_info.cache_clear()


AVX2 = kernels.CpuInfo("AVX2", frozenset({"avx2", "fma"}), "an AVX2-only CPU")
AMX = kernels.CpuInfo("AVX512", frozenset({"avx2", "fma", "avx512vl", "avx512_vnni", "avx512_bf16",
                                           "amx_bf16"}), "an AMX CPU")
VNNI = kernels.CpuInfo("AVX512", frozenset({"avx2", "fma", "avx512vl", "avx512_vnni", "avx512_bf16"}),
                       "AVX-512 VNNI and BF16, no AMX")


@pytest.mark.parametrize(("info", "native", "expected"), [
    # AVX2, no native bf16: the native kernel at every row count (it beat fp32 GEMM at 1-256 rows
    # under the AVX2 emulation); torch's int4 never
    (AVX2, True, ["q4n"] * 5),
    (AVX2, False, ["dense"] * 5),
    # native bf16: torch's int4 with bf16 activations at a few rows, bf16 GEMM above
    (AMX, True, ["int4", "int4", "dense", "dense", "dense"]),
    (AMX, False, ["int4", "int4", "dense", "dense", "dense"]),
    # VNNI without AMX: the native kernel at every row count (it beat bf16 GEMM at 1-512 rows)
    (VNNI, True, ["q4n"] * 5),
    (VNNI, False, ["int4", "int4", "dense", "dense", "dense"]),
])
def test_derived_plan_per_cpu(info: kernels.CpuInfo, native: bool, expected: list[str]) -> None:
    assert [kernels.derived_choice("int4", r, info, native) for r in kernels.ROW_GRID] == expected
    assert all(kernels.derived_choice("dense", r, info, native) == "dense" for r in kernels.ROW_GRID)
    int8 = [kernels.derived_choice("int8", r, info, native, native8=False) for r in kernels.ROW_GRID]
    assert int8 == (["int8"] * 2 + ["dense"] * 3 if info.native_bf16 else ["dense"] * 5)


@needs_library
def test_quant_linear_serves_q4n() -> None:
    gen = torch.Generator().manual_seed(2)
    weight, bias = quantize_int4(torch.randn(48, 64, generator=gen)), torch.randn(48, generator=gen)
    plan = ["q4n", "q4n", "dense", "dense", "dense"]
    table = kernels.KernelTable({kernels.KernelTable.key("int4", 48, 64): plan}, "measured")
    layer = build_quant_linear(weight, bias, torch.float32, table)
    x = torch.randn(2, 64, generator=gen)
    dense = F.linear(x, weight.dequantize(), bias)
    assert layer.kernel_for(2) == "q4n"
    assert ((layer(x) - dense).norm() / dense.norm()).item() < 0.02


def test_without_library_torch_kernels_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(q8native, "supported_isas", lambda: [])
    assert kernels.native_isa(AVX2) is None
    assert "q4n" not in kernels.candidates("int4")
    table = kernels.derive_table([("int4", 48, 64)], AVX2)
    assert "q4n" not in table.choices[kernels.KernelTable.key("int4", 48, 64)]
