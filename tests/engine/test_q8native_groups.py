"""Int8 weights with a scale per group (``Int8GroupWeight``): GGUF's Q8_0 / Q5_0 / Q6_K blocks read
exactly (no second rounding; the loader serves Q8_0 / Q5_0 so, and Q6_K with its group scales rounded
to fp16 for the kernel at a few rows), the native kernel's group-scale paths (groups of 32 and 16)
against a float64 reference, and the module plans.

Every kernel path this CPU has runs (scalar always); a path the CPU lacks is skipped and says so.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from confkv_engine.model import kernels, q8native
from confkv_engine.model.gguf_loader import dequantize
from confkv_engine.model.gguf_reader import read_gguf
from confkv_engine.model.qlinear import build_quant_linear, fuse_weights
from confkv_engine.model.quant import Int8GroupWeight, Int8Weight, int8_groups, quantize_int8_groups
from tests.engine.gguf_fixtures import write_raw_tensor

Q = gguf.GGMLQuantizationType
needs_library = pytest.mark.skipif(not q8native.supported_isas(), reason="native library not built")


def isa_param(isa: str):  # noqa: ANN201
    have = isa in q8native.supported_isas()
    return pytest.param(isa, marks=pytest.mark.skipif(not have, reason=f"this CPU has no {isa} path"))


ISAS = [isa_param("scalar"), isa_param("avx2"), isa_param("vnni")]


def raw_q6_k(rows: int, k: int, seed: int) -> np.ndarray:
    """Random Q6_K rows (gguf-py cannot quantize to Q6_K): any code and sub-block scale bytes are a
    valid block; only the f16 super-block scale d is set to a finite value."""
    raw = np.random.default_rng(seed).integers(0, 256, (rows, k // 256, 210), dtype=np.uint8)
    raw[..., 208:210] = np.full((rows, k // 256), 0.01, np.float16).view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def gguf_tensor(tmp_path, qtype, rows: int = 40, k: int = 512, seed: int = 1):  # noqa: ANN201
    if qtype == Q.Q6_K:
        raw = raw_q6_k(rows, k, seed)
    else:
        w = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
        w[:, ::7] *= 20  # an outlier channel: only its own groups get a coarse scale
        raw = gguf.quants.quantize(w, qtype)
    path = write_raw_tensor(tmp_path / "t.gguf", "blk.0.ffn_down.weight", raw, qtype)
    return read_gguf(path).tensors["blk.0.ffn_down.weight"]


@pytest.mark.parametrize(("qtype", "group", "span"), [(Q.Q8_0, 32, 127), (Q.Q5_0, 32, 16), (Q.Q6_K, 16, 32)])
def test_blocks_convert_exactly(tmp_path, qtype, group: int, span: int) -> None:
    tensor = gguf_tensor(tmp_path, qtype)
    weight = int8_groups(tensor.data, tensor.type_name, dequantize(tensor))
    assert weight.group == group and weight.scale.shape == (40, 512 // group)
    assert weight.q.abs().max() <= span and weight.q.min() >= -span
    assert torch.equal(weight.dequantize(), torch.from_numpy(dequantize(tensor)))


def reference(x: torch.Tensor, w: Int8GroupWeight) -> torch.Tensor:
    """The kernel's maths in float64: int8 activations per row and group of 32, the int8 weights
    with their group scales."""
    rows, k = x.shape
    xg = x.double().view(rows, k // 32, 32)
    scale = xg.abs().amax(-1) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    a = torch.round((xg * inv[..., None]).float()).double().view(rows, k)
    return (a * scale.repeat_interleave(32, 1)) @ w.dequantize().double().t()


@needs_library
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_group_scales_match_reference(isa: str, group: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows + group)
    w = torch.randn(37, 256, generator=gen) * 0.05  # 37: a partial block of 16 outputs
    w[:, ::5] *= 30
    weight = quantize_int8_groups(w, group)
    x = torch.randn(rows, 256, generator=gen)
    x[:, 7] *= 50
    x[0, :32] = 0.0  # an all-zero activation group: scale 0
    y = q8native.matmul(x, q8native.pack(weight), isa, threads=2)
    ref = reference(x, weight)
    # exact integer dots per group; fp32 accumulation over k / group terms
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=2e-5 * ref.abs().max().item())


@needs_library
@pytest.mark.parametrize("isa", ISAS)
def test_one_group_scale_per_row_equals_the_row_kernel(isa: str) -> None:
    """The same weights as Int8Weight and as Int8GroupWeight with the row's scale in every group:
    the two kernels agree within fp32 rounding, bf16 activations and outputs included."""
    gen = torch.Generator().manual_seed(3)
    row = Int8Weight(torch.randint(-127, 128, (48, 128), generator=gen, dtype=torch.int8),
                     (torch.rand(48, generator=gen) * 0.01).half().float())  # fp16 values: group scales are
    grouped = Int8GroupWeight(row.q, row.scale[:, None].expand(48, 4).contiguous(), 32)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(9, 128, generator=gen).to(dtype)
        a = q8native.matmul(x, q8native.pack(row), isa).float()
        b = q8native.matmul(x, q8native.pack(grouped), isa).float()
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        assert torch.allclose(a, b, rtol=tol, atol=tol * a.abs().max().item())


def test_pack_groups_layout() -> None:
    """Group scales are stored in fp16 per block and group with the block's 16 rows together; rows
    past N are zero; scales that are not fp16 values are refused, not rounded."""
    weight = quantize_int8_groups(torch.randn(20, 64), 16)
    packed = q8native.pack(weight)
    assert packed.scale.shape == (2, 4, 16) and packed.group == 16 and packed.scale.dtype == torch.float16
    assert torch.equal(packed.scale[1, 2, :4].float(), weight.scale[16:20, 2])
    assert not packed.scale[1, :, 4:].any()
    with pytest.raises(ValueError, match="groups of 16 or 32"):
        q8native.pack(quantize_int8_groups(torch.randn(8, 128), 64))
    with pytest.raises(ValueError, match="not fp16 values"):
        q8native.pack(Int8GroupWeight(weight.q, weight.scale + 1e-7, 16))


def test_pack_rounds_scales_only_when_asked() -> None:
    """Q6_K's d * sc_j: rounded to the nearest fp16 on request, at most 2^-11 of each scale."""
    d = torch.tensor([0.0123], dtype=torch.float16).float()
    scale = (d * torch.arange(-32, 32).float()).view(4, 16)  # an fp16 times a 6-bit integer
    assert not torch.equal(scale.half().float(), scale)  # some products are not fp16 values
    weight = Int8GroupWeight(torch.ones(4, 256, dtype=torch.int8), scale, 16)
    packed = q8native.pack(weight, round_scales=True)
    got = packed.scale[0, :, :4].t().float()
    assert torch.equal(got, scale.half().float())
    assert ((got - scale).abs() <= scale.abs() * 2**-11).all()


@needs_library
def test_module_plan_and_fusion() -> None:
    """Group weights are kind int8g: fused when their groups match, served by q8n where it runs."""
    gen = torch.Generator().manual_seed(4)
    weights = {f"l.{m}": quantize_int8_groups(torch.randn(32, 64, generator=gen), 32)
               for m in ("q_proj", "k_proj", "v_proj")}
    fused = fuse_weights(weights)
    assert list(fused) == ["l.qkv_proj"] and fused["l.qkv_proj"].q.shape == (96, 64)
    mixed = fuse_weights({**weights, "l.v_proj": quantize_int8_groups(torch.randn(32, 64), 16)})
    assert sorted(mixed) == ["l.k_proj", "l.q_proj", "l.v_proj"]
    weight = fused["l.qkv_proj"]
    plan = ["q8n"] * 4 + ["dense"]
    table = kernels.KernelTable({kernels.KernelTable.key("int8g", 96, 64): plan}, "measured")
    layer = build_quant_linear(weight, None, torch.float32, table)
    assert layer.kind == "int8g" and [layer.kernel_for(r) for r in (1, 300)] == ["q8n", "dense"]
    x = torch.randn(2, 64, generator=gen)
    dense = x @ weight.dequantize().t()
    assert ((layer(x) - dense).norm() / dense.norm()).item() < 0.01


@pytest.mark.parametrize(("native8", "expected"), [(True, "q8n"), (False, "dense")])
def test_derived_plan_for_group_weights(native8: bool, expected: str) -> None:
    vnni = kernels.CpuInfo("AVX512", frozenset({"avx2", "fma", "avx512vl", "avx512_vnni"}), "vnni")
    plan = [kernels.derived_choice("int8g", r, vnni, native8=native8) for r in kernels.ROW_GRID]
    assert plan == [expected] * 5
    # Groups of 16 (Q6_K): q8n up to INT8G16_MAX_ROWS_FP32 (64: four buckets) against fp32 GEMM, up
    # to INT8G16_MAX_ROWS (4: two buckets) where bf16 is native, then dense.
    plan16 = [kernels.derived_choice("int8g16", r, vnni, native8=native8) for r in kernels.ROW_GRID]
    assert plan16 == ([expected] * 4 + ["dense"] if native8 else ["dense"] * 5)
    bf16 = kernels.CpuInfo("AVX512", vnni.flags | {"avx512_bf16"}, "vnni")
    plan16 = [kernels.derived_choice("int8g16", r, bf16, native8=native8) for r in kernels.ROW_GRID]
    assert plan16 == ([expected] * 2 + ["dense"] * 3 if native8 else ["dense"] * 5)


@needs_library
def test_groups_of_16_are_their_own_kind() -> None:
    """An Int8GroupWeight of 16 is kind int8g16: q8n at one row on rounded scales, the exact dense
    copy it was given above the plan's limit."""
    gen = torch.Generator().manual_seed(6)
    d = torch.tensor(0.0107, dtype=torch.float16).float()
    weight = Int8GroupWeight(torch.randint(-32, 32, (32, 64), generator=gen, dtype=torch.int8),
                             d * torch.randint(1, 64, (32, 4), generator=gen).float(), 16)
    table = kernels.KernelTable({kernels.KernelTable.key("int8g16", 32, 64): ["q8n"] * 2 + ["dense"] * 3},
                                "measured")
    dense = weight.dequantize()
    layer = build_quant_linear(weight, None, torch.float32, table, dense=dense)
    assert layer.kind == "int8g16" and [layer.kernel_for(r) for r in (1, 4, 5)] == ["q8n", "q8n", "dense"]
    x = torch.randn(8, 64, generator=gen)
    assert torch.allclose(layer(x), x @ dense.t(), atol=1e-5)  # 8 rows: the exact dense copy
    one = x[:1] @ dense.t()
    assert ((layer(x[:1]) - one).norm() / one.norm()).item() < 0.01
