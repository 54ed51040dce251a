"""The native int8 matmul (model/_q8matmul.c) against a reference, and the kernel plan that picks it.

Every path this CPU has runs (the scalar one always, the AVX2 one on AVX-512 machines too); a path
the CPU lacks is skipped and says so.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from confkv_engine.model import kernels, q8native
from confkv_engine.model.qlinear import build_quant_linear
from confkv_engine.model.quant import Int8Weight, quantize_int4, quantize_int8, quantize_int8_groups

needs_library = pytest.mark.skipif(not q8native.supported_isas(), reason="native library not built")


def reference(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """The kernel's maths in float64: int8 activations per row and group of 32, the int8 weights."""
    rows, k = x.shape
    xg = x.double().view(rows, k // 32, 32)
    scale = xg.abs().amax(-1) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    a = torch.round((xg * inv[..., None]).float()).double()  # round half to even, as the kernel
    q = w.q.double().view(w.q.shape[0], k // 32, 32)
    dots = torch.einsum("rgj,ngj->rng", a, q) * scale[:, None, :]
    return (dots.sum(-1) * w.scale.double()[None]).float()


def outlier_weight(n: int, k: int, seed: int) -> Int8Weight:
    """Random weights whose every fifth input channel is 30x larger (an outlier channel shrinks the
    per-row scale's resolution for the others), as per-row int8."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[:, ::5] *= 30
    return quantize_int8(w)


def isa_param(isa: str):  # noqa: ANN201
    have = isa in q8native.supported_isas()
    return pytest.param(isa, marks=pytest.mark.skipif(not have, reason=f"this CPU has no {isa} path"))


ISAS = [isa_param("scalar"), isa_param("avx2"), isa_param("vnni")]


@needs_library
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 32, 33])
@pytest.mark.parametrize(("n", "k"), [(72, 96), (37, 640)])  # 37: a partial block of 16 outputs
def test_native_matches_reference(isa: str, rows: int, n: int, k: int) -> None:
    w = outlier_weight(n, k, rows)
    gen = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, k, generator=gen)
    x[:, 7] *= 50  # an outlier activation channel: it coarsens its own group only
    x[0, :32] = 0.0  # an all-zero group: scale 0, no division by zero
    y = q8native.matmul(x, q8native.pack(w), isa, threads=2)
    ref = reference(x, w)
    # The integer dots are exact; what differs from the float64 reference is fp32 accumulation over
    # k / 32 group terms (and the offset of the unsigned flip on VNNI: ~128 * sum|a| * s, a few
    # times the result), so a few fp32 ulps of the output's largest magnitude.
    assert torch.allclose(y, ref, rtol=1e-5, atol=2e-5 * ref.abs().max().item())
    # against the dense fp32 matmul of the same weights: only the int8 activations differ, each by
    # at most half a step (max|x| / 127 of its group), so |y - dense| <= sum_k |w_nk| step_k / 2
    dense = x @ w.dequantize().t()
    step = (x.abs().view(rows, k // 32, 32).amax(-1) / 127).repeat_interleave(32, dim=1)
    bound = 0.5 * step @ w.dequantize().abs().t()
    assert ((y - dense).abs() <= bound * 1.001 + 1e-5 * dense.abs().max()).all()
    # without the outlier activation the int8 activations cost well under 1 % of the norm
    clean = x.clone()
    clean[:, 7] /= 50
    y_clean, dense_clean = q8native.matmul(clean, q8native.pack(w), isa), clean @ w.dequantize().t()
    assert ((y_clean - dense_clean).norm() / dense_clean.norm()).item() < 0.01


@needs_library
@pytest.mark.parametrize("isa", ISAS)
def test_bf16_in_bf16_out(isa: str) -> None:
    w = outlier_weight(48, 64, 1)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = q8native.matmul(x, q8native.pack(w), isa)
    assert y.dtype == torch.bfloat16
    ref = reference(x.float(), w)  # within one bf16 rounding (8 bits) of the fp32 result
    assert torch.allclose(y.float(), ref, rtol=2 ** -8, atol=1e-3 * ref.abs().max().item())


@needs_library
def test_paths_agree_bit_for_bit_in_the_integer_part() -> None:
    """The SIMD paths compute the same integer dots as the scalar one: results within fp32 rounding."""
    w = outlier_weight(64, 128, 2)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(2))
    packed = q8native.pack(w)
    ys = [q8native.matmul(x, packed, isa) for isa in q8native.supported_isas()]
    for y in ys[1:]:
        assert torch.allclose(y, ys[0], rtol=1e-5, atol=1e-5 * ys[0].abs().max().item())


@needs_library
def test_bad_shapes_are_clear_errors() -> None:
    packed = q8native.pack(quantize_int8(torch.randn(8, 64)))
    with pytest.raises(ValueError, match="does not fit"):
        q8native.matmul(torch.randn(2, 32), packed, "scalar")
    with pytest.raises(ValueError, match="multiple of 32"):
        q8native.pack(quantize_int8(torch.randn(8, 48)))
    assert q8native.matmul(torch.randn(0, 64), packed, "scalar").shape == (0, 8)


def test_pack_layout() -> None:
    """Block b, chunk c, lane l holds row 16 b + l, inputs 4 c .. 4 c + 3; padding rows are zero."""
    w = quantize_int8(torch.randn(20, 32))
    packed = q8native.pack(w)
    assert packed.q.shape == (2, 8, 16, 4) and packed.shape == (20, 32)
    assert torch.equal(packed.q[1, 3, 2], w.q[18, 12:16])
    assert not packed.q[1, :, 4:].any() and not packed.scale[20:].any()


AVX2 = kernels.CpuInfo("AVX2", frozenset({"avx2", "fma"}), "an AVX2-only CPU")
AMX = kernels.CpuInfo("AVX512", frozenset({"avx2", "fma", "avx512vl", "avx512_vnni", "avx512_bf16",
                                           "amx_bf16"}), "an AMX CPU")
VNNI = kernels.CpuInfo("AVX512", frozenset({"avx2", "fma", "avx512vl", "avx512_vnni", "avx512_bf16"}),
                       "AVX-512 VNNI and BF16, no AMX")


@pytest.mark.parametrize(("info", "native8", "expected"), [
    (VNNI, True, ["q8n"] * 5),  # measured: q8n wins at every row count (docs/performance.md)
    (VNNI, False, ["int8", "int8", "dense", "dense", "dense"]),  # library absent or switched off
    (AMX, True, ["int8", "int8", "dense", "dense", "dense"]),  # unmeasured there: unchanged
    (AVX2, True, ["q8n"] * 5),  # measured under the AVX2 emulation: q8n wins at every row count
    (AVX2, False, ["dense"] * 5),
])
def test_derived_int8_plan(info: kernels.CpuInfo, native8: bool, expected: list[str]) -> None:
    assert [kernels.derived_choice("int8", r, info, native8=native8) for r in kernels.ROW_GRID] == expected
    assert kernels.derived_choice("int4", 1, info, native=False, native8=native8) != "q8n"


def test_switch_turns_q8n_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(q8native.SWITCH, "0")
    assert kernels.native_int8_isa() is None
    assert "q8n" not in kernels.candidates("int8")
    table = kernels.derive_table([("int8", 48, 64)], VNNI)
    assert "q8n" not in table.choices[kernels.KernelTable.key("int8", 48, 64)]


@needs_library
def test_quant_linear_serves_q8n_and_keeps_one_copy() -> None:
    gen = torch.Generator().manual_seed(3)
    weight, bias = outlier_weight(48, 64, 3), torch.randn(48, generator=gen)
    table = kernels.KernelTable({kernels.KernelTable.key("int8", 48, 64): ["q8n"] * 5}, "measured")
    layer = build_quant_linear(weight, bias, torch.float32, table)
    assert layer.kernel_for(1) == layer.kernel_for(300) == "q8n"
    x = torch.randn(3, 64, generator=gen)
    dense = F.linear(x, weight.dequantize(), bias)
    assert ((layer(x) - dense).norm() / dense.norm()).item() < 0.01


@needs_library
def test_measured_table_times_q8n(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measured path builds q8n on the shape and picks it when it times fastest."""
    timed: list[str] = []

    def fake_times(fns: dict, x: torch.Tensor, rounds: int) -> dict[str, float]:
        for name, fn in fns.items():
            assert fn(x).shape == (x.shape[0], 256)
            timed.append(name)
        return {name: 1.0 if name == "q8n" else 2.0 for name in fns}

    monkeypatch.setattr(kernels, "_time_candidates", fake_times)
    table = kernels.measure_table([("int8", 256, 128)], torch.float32)
    assert table.choices[kernels.KernelTable.key("int8", 256, 128)] == ["q8n"] * 5
    assert {"q8n", "int8", "dense"} <= set(timed)


@needs_library
@pytest.mark.parametrize("isa", q8native.supported_isas())
def test_bound_call_equals_the_checked_matmul(isa: str) -> None:
    """``bound``'s resolved call gives ``matmul``'s result bit for bit, for int8 (row and group
    scales) and int4 blocks; other dtypes, non-contiguous inputs and zero rows take the checked path."""
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(40, 96, generator=gen) * 0.02
    for packed in (q8native.pack(quantize_int8(w)), q8native.pack(quantize_int8_groups(w)),
                   q8native.pack_int4(quantize_int4(w))):
        for dtype in (torch.float32, torch.bfloat16):
            run = q8native.bound(packed, isa, dtype)
            x = torch.randn(5, 96, generator=gen).to(dtype)
            assert torch.equal(run(x), q8native.matmul(x, packed, isa))
            strided = torch.randn(96, 5, generator=gen).to(dtype).t()  # not contiguous
            assert torch.equal(run(strided), q8native.matmul(strided.contiguous(), packed, isa))
            other = x.float() if dtype == torch.bfloat16 else x.bfloat16()
            assert torch.equal(run(other), q8native.matmul(other.to(dtype), packed, isa))
            assert run(x[:0]).shape == (0, 40)
