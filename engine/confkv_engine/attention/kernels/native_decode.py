"""Decode attention read straight from the pool (``_decode.c``), loaded with ctypes when it was built.

``pip install`` builds ``_decode.c`` next to this module (``setup.py``: an optional extension;
without a C compiler the install goes on, ``available()`` is False and the gathering path serves).
Nothing is compiled or downloaded at run time.

What it replaces, per layer of a decode step: the gather of every cached K and V block into a fresh
tensor, the additive mask and PyTorch's flash kernel over the copy. Measured on the embedded model
at one decode row (2 threads): the gather and the kernel took about 115 us a layer; see
docs/performance.md for the step. Covered: CPU, fp32 or bf16 query and pool of one dtype (an int8,
fp8 or fp16 pool keeps the gathering path), any head dim up to 256, grouped query heads, a sliding
window. ``CONFKV_NATIVE_DECODE=0`` turns it off (the gathering path, for comparisons).
"""

from __future__ import annotations

import ctypes
import math
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from confkv_engine.cache.codec.native import find_library

LIBRARY = "_decode"
ABI = 2  # confkv_decode_abi() of the arguments below (2: the log-sum-exp output)
SWITCH = "CONFKV_NATIVE_DECODE"
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ERRORS = {-1: "unsupported dtype", -2: "head dim above 256 or query heads not grouped",
           -3: "out of memory for the scores"}


@cache
def _library() -> ctypes.CDLL | None:
    lib = find_library(Path(__file__).parent, LIBRARY, SWITCH)
    if lib is None:
        return None
    if not hasattr(lib, "confkv_decode_abi") or lib.confkv_decode_abi() != ABI:
        warnings.warn(f"{LIBRARY} was built from an older _decode.c: rebuild it (pip install -e . or make "
                      "setup); decode attention gathers meanwhile", stacklevel=2)
        return None
    fn = lib.confkv_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    return lib


def available() -> bool:
    """Whether the library was built and loads here (and is not switched off)."""
    return _library() is not None


def reads(pool: Tensor) -> bool:
    """Whether the kernel reads this pool (CPU, fp32 or bf16) in place."""
    return pool.device.type == "cpu" and pool.dtype in DTYPES


@dataclass(frozen=True)
class DecodeTables:
    """One decode step's rows as the kernel reads them (built once per step, used by every layer)."""

    k_table: Tensor  # [B, width] int64, padded with any valid block
    v_table: Tensor  # [B, width] int64
    lens: Tensor  # [B] int64: visible slots per row, the row's own new slot included

    @classmethod
    def build(cls, k_tables: list[list[int]], v_tables: list[list[int]], lens: list[int],
              pad: int) -> DecodeTables:
        width = max(1, max(len(t) for t in k_tables + v_tables))
        k = torch.tensor([t + [pad] * (width - len(t)) for t in k_tables], dtype=torch.long)
        v = torch.tensor([t + [pad] * (width - len(t)) for t in v_tables], dtype=torch.long)
        return cls(k, v, torch.tensor(lens, dtype=torch.long))


def decode_attention(q: Tensor, pool: Tensor, tables: DecodeTables, window: int | None = None,
                     scale: float | None = None) -> Tensor:
    """q [B, Hq, D] against pool layer ``pool`` [NB, bs, Hkv, D] (q's dtype) through ``tables``;
    returns [B, Hq, D] in q's dtype. ``window``: only the last ``window`` visible slots."""
    return _attend(q, pool, tables, window, scale, None)


def decode_attention_lse(q: Tensor, pool: Tensor, tables: DecodeTables) -> tuple[Tensor, Tensor]:
    """``decode_attention`` with its log-sum-exp: (out [B, Hq, D] in q's dtype, lse [B, Hq] fp32 of
    the scaled scores, -inf for a row with no visible slot), for merging another part of the same
    attention (``attention.codes``)."""
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    return _attend(q, pool, tables, None, None, lse), lse


def _attend(q: Tensor, pool: Tensor, tables: DecodeTables, window: int | None, scale: float | None,
            lse: Tensor | None) -> Tensor:
    lib = _library()
    if lib is None:
        raise RuntimeError("the native decode attention library is not built (see setup.py)")
    b, hq, d = q.shape
    if pool.dtype != q.dtype or q.dtype not in DTYPES or not pool.is_contiguous():
        raise ValueError(f"native decode attention: q {q.dtype}, pool {pool.dtype} (contiguous: "
                         f"{pool.is_contiguous()}) must be one contiguous fp32 or bf16 pair")
    q = q.contiguous()
    out = torch.empty_like(q)
    _, bs, hkv, _ = pool.shape
    rc = lib.confkv_decode_attention(
        q.data_ptr(), out.data_ptr(), DTYPES[q.dtype], b, hq, pool.data_ptr(), bs, hkv, d,
        tables.k_table.data_ptr(), tables.v_table.data_ptr(), tables.k_table.shape[1], tables.lens.data_ptr(),
        window or 0, scale if scale is not None else 1.0 / math.sqrt(d), torch.get_num_threads(),
        None if lse is None else lse.data_ptr())
    if rc:
        raise RuntimeError(f"native decode attention: {_ERRORS.get(rc, rc)}")
    return out
