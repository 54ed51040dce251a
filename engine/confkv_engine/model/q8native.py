"""The native int8-weight matmul (``_q8matmul.c``, built into the same library as the int4 one).

Maths (the C file says why): the weights are ``Int8Weight``'s values (``q [N, K]`` int8, one fp32
scale per output row), repacked once at load into 16-row blocks (``pack``: the layer keeps only
that copy when its plan is ``q8n`` at every row count), the activations are quantized per row and
group of 32 to int8 with one scale (``max|x| / 127``), integer dot products per group, fp32
accumulation. The int8 activations are the only rounding added to the weights' own.

Paths as ``q4native`` (``vnni``, ``avx2``, ``scalar``; the library re-checks the CPU).
``CONFKV_NATIVE_INT8=0`` turns this kernel off (read when a kernel table is made, i.e. at model
load: ``kernels.native_int8_isa``), so int8 weights are served by PyTorch's kernels as before;
``CONFKV_NATIVE_Q4=0`` turns the whole library off.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from confkv_engine.model.q4native import ISAS, LIBRARY, find_library
from confkv_engine.model.q4native import SWITCH as LIBRARY_SWITCH
from confkv_engine.model.quant import Int8Weight

SWITCH = "CONFKV_NATIVE_INT8"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ERRORS = {-1: "the CPU lacks the instruction set asked for", -2: "in_features is not a multiple of 32",
           -3: "out of memory for the quantized activations"}


@cache
def _library() -> ctypes.CDLL | None:
    lib = find_library(Path(__file__).parent, LIBRARY, LIBRARY_SWITCH)
    if lib is None or not hasattr(lib, "confkv_q8_matmul"):
        return None
    fn = lib.confkv_q8_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int]
    lib.confkv_q8_supported.restype = ctypes.c_int
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
    one output per 32-bit lane), the last block padded with zero rows; scales padded alike."""

    q: Tensor  # [ceil(N / 16), K / 4, 16, 4] int8
    scale: Tensor  # [ceil(N / 16) * 16] fp32
    n: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.q.shape[1] * 4


def pack(weight: Int8Weight) -> PackedInt8:
    """``Int8Weight`` -> the library's layout (a rearranged copy, the same size as ``q``)."""
    n, k = weight.q.shape
    if k % 32:
        raise ValueError(f"the native int8 kernel needs in_features a multiple of 32, not {k}")
    pad = -n % 16
    q = F.pad(weight.q.to(torch.int8), (0, 0, 0, pad)) if pad else weight.q.to(torch.int8)
    packed = q.view((n + pad) // 16, 16, k // 4, 4).transpose(1, 2).contiguous()
    scale = F.pad(weight.scale.to(torch.float32), (0, pad)).contiguous()
    return PackedInt8(packed, scale, n)


def matmul(x: Tensor, w: PackedInt8, isa: str, threads: int | None = None) -> Tensor:
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
    rc = lib.confkv_q8_matmul(x.data_ptr(), code, x.shape[0], k, w.q.data_ptr(), w.scale.data_ptr(), n,
                              y.data_ptr(), code, ISAS[isa], threads or torch.get_num_threads())
    if rc:
        raise RuntimeError(f"native int8 matmul ({isa}): {_ERRORS.get(rc, rc)}")
    return y
