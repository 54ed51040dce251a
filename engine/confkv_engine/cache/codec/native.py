"""The native block decoder (``_dequant.c``), loaded with ctypes when it was built.

``pip install`` builds ``_dequant.c`` into a shared library next to this module (``setup.py``: an
optional extension, so a machine without a C compiler installs without it). Nothing is compiled or
downloaded at run time: without the library, or for a case it does not cover, ``decode_into``
answers False and the caller decodes with PyTorch ops (same values: the library computes the same
fp32 ``min + code * scale`` with the same roundings).

Covered: CPU tensors, fp32 or bf16 tables, any bits / axis / group of a per-layer block spec
``[bs, Hkv, D]`` with its groups along axis 0 (keys) or 2 (values). Measured on one layer of a
``conf-kv+tiers`` decode step at 8 x 2,048 cached tokens (816 int4 K blocks, dq6, and 816 int4 V
blocks decoded into the gathered table, 2 threads): keys 5.5 -> 3.4 ms, values 3.0 -> 1.0 ms (the
keys' remaining time is mostly reading their dq6 parameters, in PyTorch).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from confkv_engine.cache.codec.spec import CodecSpec

LIBRARY = "_dequant"
_OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# CONFKV_NATIVE_CODEC=0 turns the library off (the PyTorch decode, for comparisons).
SWITCH = "CONFKV_NATIVE_CODEC"


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(SWITCH, "1") == "0":
        return None
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"{LIBRARY}{suffix}"
        if path.exists():
            lib = ctypes.CDLL(str(path))
            fn = lib.confkv_dequantize
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                           ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                           *([ctypes.c_int] * 7)]
            return lib
    return None


def available() -> bool:
    """Whether the library was built and loads here."""
    return _library() is not None


def covers(spec: CodecSpec, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``decode_into`` handles blocks of ``spec`` into a ``dtype`` table on ``device``."""
    return (len(spec.shape) == 3 and spec.axis in (0, 2) and device.type == "cpu"
            and dtype in _OUT_DTYPES and available())


def decode_into(rows: Tensor, spec: CodecSpec, scales: Tensor, mins: Tensor, out: Tensor,
                dst: Tensor) -> bool:
    """Decode ``rows`` [N, spec.nbytes] (codes first) with fp32 ``scales`` / ``mins`` [N, num_groups]
    into rows ``dst`` [N] (int64; -1: skip the block) of ``out`` [R, *spec.shape]; False (nothing
    written) when not covered."""
    if not covers(spec, out.dtype, out.device) or not out.is_contiguous():
        return False
    n = rows.shape[0]
    if tuple(out.shape[1:]) != spec.shape or tuple(rows.shape) != (n, spec.nbytes) or dst.shape != (n,):
        raise ValueError(f"native decode: rows {tuple(rows.shape)}, out {tuple(out.shape)}, dst "
                         f"{tuple(dst.shape)} do not fit {spec}")
    if n and int(dst.max()) >= out.shape[0]:  # the library writes where dst says: never past out
        raise ValueError(f"native decode: row {int(dst.max())} is past the table's {out.shape[0]} rows")
    lib = _library()
    assert lib is not None
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    scales, mins = (x.to(torch.float32).reshape(n, spec.num_groups).contiguous() for x in (scales, mins))
    dst = dst.to(torch.int64).contiguous()
    bs, heads, dim = spec.shape
    lib.confkv_dequantize(rows.data_ptr(), rows.stride(0), scales.data_ptr(), mins.data_ptr(),
                          spec.num_groups, out.data_ptr(), _OUT_DTYPES[out.dtype], dst.data_ptr(), n,
                          spec.bits, spec.axis, bs, heads, dim, spec.group, torch.get_num_threads())
    return True
