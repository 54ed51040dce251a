"""The native int4-weight matmul (``_q4matmul.c``), loaded with ctypes when it was built.

``pip install`` builds ``_q4matmul.c`` next to this module (``setup.py``: an optional extension;
without a C compiler the install goes on and ``available()`` is False, so the kernel table never
plans it and PyTorch's kernels serve). Nothing is compiled or downloaded at run time.

Maths (the C file says why): weights in groups of 32 as ``w = d * (q - 8) + z`` with 4-bit ``q``;
activations quantized per row and group of 32 to int8 with one scale (``max|x| / 127``), integer
dot products, fp32 accumulation per group; the offset term ``z * sum(x)`` uses the exact fp32 sum
of each activation group. The int8 activations are the only rounding added to the weights' own.

Paths: ``vnni`` (AVX-512 VNNI), ``avx2`` (AVX2 + FMA), ``scalar`` (portable C). ``isa_for`` picks
the best one the CPU flags allow; the library re-checks the CPU and refuses a path it cannot run.
``CONFKV_NATIVE_Q4=0`` turns the library off (PyTorch's kernels only, for comparisons).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from confkv_engine.model.quant import Q4_BLOCK, Int4Weight

LIBRARY = "_q4matmul"
SWITCH = "CONFKV_NATIVE_Q4"
ISAS = {"scalar": 0, "avx2": 1, "vnni": 2}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ERRORS = {-1: "the CPU lacks the instruction set asked for", -2: "in_features is not a multiple of 32",
           -3: "out of memory for the quantized activations"}


def find_library(directory: Path, name: str, switch: str) -> ctypes.CDLL | None:
    """The extension ``name`` built into ``directory``, loaded with ctypes; None when it was not built
    or the environment variable ``switch`` is "0". (``cache.codec.native`` has its own: the layering
    keeps model below the codec.)"""
    if os.environ.get(switch, "1") == "0":
        return None
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = directory / f"{name}{suffix}"
        if path.exists():
            return ctypes.CDLL(str(path))
    return None


@cache
def _library() -> ctypes.CDLL | None:
    lib = find_library(Path(__file__).parent, LIBRARY, SWITCH)
    if lib is None:
        return None
    fn = lib.confkv_q4_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int]
    lib.confkv_q4_supported.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the library was built and loads here."""
    return _library() is not None


def supported_isas() -> list[str]:
    """The paths this CPU can run (by the library's own CPU check); empty without the library."""
    lib = _library()
    if lib is None:
        return []
    bits = lib.confkv_q4_supported()
    return [name for name, code in ISAS.items() if bits >> code & 1]


def isa_for(flags: frozenset[str]) -> str:
    """The fastest path the CPU flags (``/proc/cpuinfo`` names) allow."""
    if {"avx512_vnni", "avx512vl"} <= flags:
        return "vnni"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "scalar"


@dataclass(frozen=True)
class PackedInt4:
    """Weights ``[N, K]`` as the library reads them: 16 bytes per group of 32 (element j in the low
    nibble of byte j, element j + 16 in its high nibble) and fp32 ``w = d * (q - 8) + z`` per group."""

    q: Tensor  # [N, K / 2] uint8
    d: Tensor  # [N, K / 32] fp32
    z: Tensor  # [N, K / 32] fp32

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * 2


def pack(weight: Int4Weight) -> PackedInt4:
    """``Int4Weight`` (``w = (q - 8) * scale + zero``, groups of 32) -> the library's layout."""
    if weight.group != Q4_BLOCK:
        raise ValueError(f"the native int4 kernel needs groups of {Q4_BLOCK}, not {weight.group}")
    n, k = weight.q.shape
    codes = weight.q.to(torch.uint8).view(n, k // Q4_BLOCK, 2, Q4_BLOCK // 2)
    q = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return PackedInt4(q, weight.scale.float().contiguous(), weight.zero.float().contiguous())


def matmul(x: Tensor, w: PackedInt4, isa: str, threads: int | None = None) -> Tensor:
    """``x [rows, K]`` (fp32 or bf16, CPU) times ``w``'s transpose -> ``[rows, N]`` in ``x``'s dtype."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the native int4 kernel is not built (see setup.py)")
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in _DTYPES or x.device.type != "cpu":
        raise ValueError(f"native int4 matmul: x {tuple(x.shape)} {x.dtype} on {x.device} does not fit "
                         f"[rows, {k}] fp32/bf16 on cpu")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    code = _DTYPES[x.dtype]
    rc = lib.confkv_q4_matmul(x.data_ptr(), code, x.shape[0], k, w.q.data_ptr(), w.d.data_ptr(),
                              w.z.data_ptr(), n, y.data_ptr(), code, ISAS[isa],
                              threads or torch.get_num_threads())
    if rc:
        raise RuntimeError(f"native int4 matmul ({isa}): {_ERRORS.get(rc, rc)}")
    return y
