"""The native block matmuls (``_q8matmul.c`` in the ``_native`` library): int8 weights (``q8n``)
and int4 weights (``q4n``), both in blocks of 16 output rows.

Maths (the C file says why): the weights are ``Int8Weight``'s values (``q [N, K]`` int8, one fp32
scale per output row), ``Int8GroupWeight``'s (one scale per row and group of 32 or 16) or
``Int4Weight``'s (groups of 32, ``w = scale * (q - 8) + zero``), repacked once at load into 16-row
blocks (``pack`` / ``pack_int4``: the layer keeps only that copy when its plan is the native kernel
at every row count), the activations are quantized per row and group of 32 to int8 with one scale
(``max|x| / 127``), integer dot products per group, fp32 accumulation. The int8 activations are
the only rounding added to the weights' own.

Paths as ``native.ISAS`` (``vnni``, ``avx2``, ``scalar``; the library re-checks the CPU).
``CONFKV_NATIVE_INT8=0`` turns this kernel off (read when a kernel table is made, i.e. at model
load: ``kernels.native_int8_isa``), so int8 weights are served by PyTorch's kernels as before;
``CONFKV_NATIVE_Q4=0`` turns the whole library off.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from confkv_engine.model.native import ISAS, LIBRARY, find_library
from confkv_engine.model.native import SWITCH as LIBRARY_SWITCH
from confkv_engine.model.quant import Q4_BLOCK, Int4Weight, Int8GroupWeight, Int8Weight

SWITCH = "CONFKV_NATIVE_INT8"
ACT_GROUP = 32  # _qcommon.h's GROUP: activations are quantized per row and group of 32
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ERRORS = {-1: "the CPU lacks the instruction set asked for", -2: "in_features is not a multiple of 32",
           -3: "out of memory for the quantized activations", -4: "weight groups of 16 or 32 only"}


@cache
def _library() -> ctypes.CDLL | None:
    lib = find_library(Path(__file__).parent, LIBRARY, LIBRARY_SWITCH)
    if lib is None or not hasattr(lib, "confkv_q8_matmul"):
        return None
    fn = lib.confkv_q8_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn4 = lib.confkv_q4i_matmul
    fn4.restype = ctypes.c_int
    fn4.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                    ctypes.c_int, ctypes.c_int]
    lib.confkv_q8_supported.restype = ctypes.c_int
    if hasattr(lib, "confkv_q8_argmax"):  # the same arguments with idx, val in place of y, y_dtype
        for name, entry in (("confkv_q8_argmax", fn), ("confkv_q4i_argmax", fn4)):
            head, tail = entry.argtypes[:-4], entry.argtypes[-2:]
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = [*head, ctypes.c_void_p, ctypes.c_void_p, *tail]
    if hasattr(lib, "confkv_quantize_rows"):
        lib.confkv_quantize_rows.restype = None
        head = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        lib.confkv_quantize_rows.argtypes = head + [ctypes.c_void_p] * 7 + [ctypes.c_int]
    return lib


def supported_isas() -> list[str]:
    """The paths this CPU can run (by the library's own CPU check); empty without the library."""
    lib = _library()
    if lib is None:
        return []
    bits = lib.confkv_q8_supported()
    return [name for name, code in ISAS.items() if bits >> code & 1]


@dataclass(frozen=True)
class PackedInt8:
    """Weights ``[N, K]`` as the library reads them: blocks of 16 output rows, each stored as K / 4
    chunks of 16 x 4 bytes (the 4 consecutive inputs of each of the 16 rows: one 512-bit register,
    one output per 32-bit lane), the last block padded with zero rows; scales padded alike, and
    for group scales stored a block's 16 rows together per group (one 512-bit load)."""

    q: Tensor  # [ceil(N / 16), K / 4, 16, 4] int8
    scale: Tensor  # group 0: [ceil(N / 16) * 16] fp32; else [ceil(N / 16), K / group, 16] fp16
    n: int
    group: int = 0  # inputs per weight scale, 0: the whole row
    # group scales: [ceil(N / 16)] uint8, 1 where all of a block's codes lie in -16..15 (groups of 32:
    # Q5_0's) or -32..31 (16: Q6_K's), which the AVX2 path multiplies without the sign trick
    # (``_q8avx2.c``; the same outputs); None: no such block
    narrow: Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.q.shape[1] * 4


def pack(weight: Int8Weight | Int8GroupWeight, round_scales: bool = False) -> PackedInt8:
    """``Int8Weight`` / ``Int8GroupWeight`` -> the library's layout (a rearranged copy). Group scales
    must be fp16 values unless ``round_scales``: Q6_K's ``d * sc_j`` (an fp16 times an 8-bit integer)
    is rounded to fp16 then, at most 2^-11 of each scale, at least 8 times under the int8 rounding
    of the activations this kernel makes anyway (up to 2^-8 of a group's largest value). The plan
    uses it at a few rows only; above them the layer's exact dense copy serves."""
    n, k = weight.q.shape
    if k % 32:
        raise ValueError(f"the native int8 kernel needs in_features a multiple of 32, not {k}")
    group = weight.group if isinstance(weight, Int8GroupWeight) else 0
    if group not in (0, 16, 32):
        raise ValueError(f"the native int8 kernel takes weight groups of 16 or 32, not {group}")
    pad = -n % 16
    q = F.pad(weight.q.to(torch.int8), (0, 0, 0, pad)) if pad else weight.q.to(torch.int8)
    packed = q.view((n + pad) // 16, 16, k // 4, 4).transpose(1, 2).contiguous()
    if not group:
        return PackedInt8(packed, F.pad(weight.scale.to(torch.float32), (0, pad)).contiguous(), n)
    if not round_scales and not torch.equal(weight.scale.half().float(), weight.scale.float()):
        raise ValueError("the native int8 kernel keeps group scales in fp16; these are not fp16 values")
    return PackedInt8(packed, _blocks_of_16(weight.scale).half(), n, group, narrow_blocks(packed, group))


NARROW_CODES = {32: 16, 16: 32}  # group -> c: the AVX2 narrow tile reads codes in -c .. c - 1


def narrow_blocks(packed: Tensor, group: int) -> Tensor | None:
    """Per 16-row block of ``packed`` ([blocks, K / 4, 16, 4] int8), 1 where every code lies in
    -16..15 (groups of 32: Q5_0's) or -32..31 (groups of 16: Q6_K's); None for per-row scales or
    where no block qualifies."""
    if group not in NARROW_CODES:
        return None
    c = NARROW_CODES[group]
    flat = packed.view(packed.shape[0], -1)
    flags = ((flat.amin(dim=1) >= -c) & (flat.amax(dim=1) <= c - 1)).to(torch.uint8)
    return flags.contiguous() if bool(flags.any()) else None


@dataclass(frozen=True)
class PackedInt4Blocks:
    """4-bit weights ``[N, K]`` in the same 16-row blocks: chunk c of a block holds inputs
    8c .. 8c + 7 of its 16 rows, 64 bytes, byte 4 l + i with input 8c + i of row l in its low nibble
    and input 8c + 4 + i in its high one (one 512-bit load, two dpbusd); ``w = scale * q + minimum``
    per row and group of 32 (``minimum = zero - 8 scale``), both fp16, stored per block and group
    with the 16 rows together."""

    q: Tensor  # [ceil(N / 16), K / 8, 16, 4] uint8
    scale: Tensor  # [ceil(N / 16), K / 32, 16] fp16
    minimum: Tensor  # [ceil(N / 16), K / 32, 16] fp16
    n: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.q.shape[1] * 8


def _blocks_of_16(t: Tensor) -> Tensor:
    """``[N, G]`` per-row-and-group values -> ``[ceil(N / 16), G, 16]`` (rows past N zero)."""
    pad = -t.shape[0] % 16
    t = F.pad(t.float().t(), (0, pad)).t()
    return t.reshape(-1, 16, t.shape[1]).transpose(1, 2).contiguous()


def pack_int4(weight: Int4Weight) -> PackedInt4Blocks:
    """``Int4Weight`` (groups of 32) -> the library's 4-bit block layout (half the bytes of int8)."""
    n, k = weight.q.shape
    if weight.group != Q4_BLOCK or k % 32:
        raise ValueError(f"the native 4-bit block kernel needs groups of {Q4_BLOCK} and in_features a "
                         f"multiple of 32, not group {weight.group}, {k}")
    pad = -n % 16
    codes = F.pad(weight.q.to(torch.uint8), (0, 0, 0, pad)).view((n + pad) // 16, 16, k // 8, 2, 4)
    q = (codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)).transpose(1, 2).contiguous()
    d, minimum = _fp16_scales(weight)
    return PackedInt4Blocks(q, _blocks_of_16(d).half(), _blocks_of_16(minimum).half(), n)


def _fp16_scales(weight: Int4Weight) -> tuple[Tensor, Tensor]:
    """The scale and minimum (``w = d q + m``) as the kernel keeps them, fp16 values in fp32."""
    d = weight.scale.float().half().float()
    return d, (weight.zero.float() - 8 * weight.scale.float()).half().float()


def int4_as_served(weight: Int4Weight) -> Int4Weight:
    """``weight`` with the scale and zero ``q4n`` computes with (fp16 scale and minimum; the same
    values for GGUF's Q4_0 / Q4_1, whose d and m are fp16): the reference for its maths."""
    d, minimum = _fp16_scales(weight)
    return Int4Weight(weight.q, d, minimum + 8 * d, weight.group)


def matmul(x: Tensor, w: PackedInt8 | PackedInt4Blocks, isa: str, threads: int | None = None) -> Tensor:
    """``x [rows, K]`` (fp32 or bf16, CPU) times ``w``'s transpose -> ``[rows, N]`` in ``x``'s dtype."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the native int8 kernel is not built (see setup.py)")
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in _DTYPES or x.device.type != "cpu":
        raise ValueError(f"native int8 matmul: x {tuple(x.shape)} {x.dtype} on {x.device} does not fit "
                         f"[rows, {k}] fp32/bf16 on cpu")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    if x.shape[0] == 0:
        return y
    code = _DTYPES[x.dtype]
    fn, middle = _entry(lib, w)
    rc = fn(x.data_ptr(), code, x.shape[0], k, *middle, y.data_ptr(), code, ISAS[isa],
            threads or torch.get_num_threads())
    if rc:
        raise RuntimeError(f"native int8 matmul ({isa}): {_ERRORS.get(rc, rc)}")
    return y


def quantized_activations(x: Tensor, threads: int | None = None) -> dict[str, Tensor]:
    """What every native matmul computes from ``x [rows, K]`` (fp32 or bf16, CPU) before its dots
    (``_qacts.c``): ``q`` int8 [rows, K], and per row ``s``, ``flip32``, ``xsum`` [rows, K / 32],
    ``flip16``, ``isum`` (int32) [rows, K / 16], ``off`` [rows]. For checking the kernel's activations."""
    lib = _library()
    if lib is None or not hasattr(lib, "confkv_quantize_rows"):
        raise RuntimeError("the native int8 kernel is not built (see setup.py)")
    if x.dim() != 2 or x.shape[1] % ACT_GROUP or x.dtype not in _DTYPES or x.device.type != "cpu":
        raise ValueError(f"activations: x {tuple(x.shape)} {x.dtype} on {x.device} "
                         "is not [rows, 32 m] fp32/bf16")
    x = x.contiguous()
    rows, k = x.shape
    g = k // ACT_GROUP
    out = {"q": torch.empty(rows, k, dtype=torch.int8), "s": torch.empty(rows, g), "off": torch.empty(rows),
           "flip16": torch.empty(rows, 2 * g), "flip32": torch.empty(rows, g), "xsum": torch.empty(rows, g),
           "isum": torch.empty(rows, 2 * g, dtype=torch.int32)}
    names = ("q", "s", "off", "flip16", "flip32", "xsum", "isum")
    lib.confkv_quantize_rows(x.data_ptr(), _DTYPES[x.dtype], rows, k, *(out[n].data_ptr() for n in names),
                             threads or torch.get_num_threads())
    return out


def _entry(lib: ctypes.CDLL, w: PackedInt8 | PackedInt4Blocks,
           op: str = "matmul") -> tuple[Any, tuple[int, ...]]:
    """The library function for ``w``'s format (``op``: matmul or argmax) and its weight arguments
    (between k and the outputs)."""
    n = w.shape[0]
    if isinstance(w, PackedInt4Blocks):
        return getattr(lib, f"confkv_q4i_{op}"), (w.q.data_ptr(), w.scale.data_ptr(), w.minimum.data_ptr(), n)
    narrow = None if w.narrow is None else w.narrow.data_ptr()
    return getattr(lib, f"confkv_q8_{op}"), (w.q.data_ptr(), w.scale.data_ptr(), w.group, narrow, n)


def bound(w: PackedInt8 | PackedInt4Blocks, isa: str, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    """``lambda x: matmul(x.to(dtype), w, isa)`` with the weight's arguments resolved once: a decode
    step makes this call four times per layer, and ``matmul``'s checks and lookups were a third of
    a one-row call on a small layer (16 x 64 int8, 2 threads, scratch: 8.2 us through ``matmul``,
    5.5 through this). An input that is not a contiguous ``[rows, K]`` CPU tensor in ``dtype`` takes
    ``matmul``'s checked path."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the native int8 kernel is not built (see setup.py)")
    n, k = w.shape
    code, isa_code = _DTYPES[dtype], ISAS[isa]
    fn, middle = _entry(lib, w)
    threads = torch.get_num_threads

    def run(x: Tensor) -> Tensor:
        if x.dtype is not dtype or x.dim() != 2 or x.shape[1] != k or not x.is_cpu or not x.is_contiguous():
            return matmul(x.to(dtype), w, isa)
        rows = x.shape[0]
        y = torch.empty(rows, n, dtype=dtype)
        if rows and fn(x.data_ptr(), code, rows, k, *middle, y.data_ptr(), code, isa_code, threads()):
            return matmul(x, w, isa)  # raises with the library's reason
        return y
    return run  # (the closure holds ``w``, so the pointers above stay valid)


def bound_argmax(w: PackedInt8 | PackedInt4Blocks, isa: str,
                 dtype: torch.dtype) -> Callable[[Tensor], Tensor] | None:
    """``lambda x: bound(w, isa, dtype)(x).max(dim=-1).indices`` without the ``[rows, N]`` outputs:
    the library scans each chunk of outputs while it is in cache (``confkv_q8_argmax``), so a greedy
    step over a large vocabulary neither writes nor re-reads its logits. The same indices, ties and
    NaN included (the test compares them). None where the library predates it."""
    lib = _library()
    if lib is None or not hasattr(lib, "confkv_q8_argmax"):
        return None
    k = w.shape[1]
    code, isa_code = _DTYPES[dtype], ISAS[isa]
    fn, middle = _entry(lib, w, "argmax")
    threads = torch.get_num_threads

    def run(x: Tensor) -> Tensor:
        x = x.to(dtype).contiguous()
        if x.dim() != 2 or x.shape[1] != k or not x.is_cpu:
            raise ValueError(f"native argmax: x {tuple(x.shape)} on {x.device} is not [rows, {k}] on cpu")
        rows = x.shape[0]
        idx, val = torch.empty(rows, dtype=torch.int64), torch.empty(rows)
        if rows and (rc := fn(x.data_ptr(), code, rows, k, *middle, idx.data_ptr(), val.data_ptr(), isa_code,
                              threads())):
            raise RuntimeError(f"native argmax ({isa}): {_ERRORS.get(rc, rc)}")
        return idx
    # ``middle`` points into ``w``'s tensors and ``run`` does not name ``w``: the function holds it, so a
    # caller that keeps only the function (a temporary pack) never reads freed weights.
    run.weight = w  # type: ignore[attr-defined]
    return run
