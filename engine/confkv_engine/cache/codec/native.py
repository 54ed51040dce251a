"""The native block decoder (``_dequant.c``), loaded with ctypes when it was built.

``pip install`` builds ``_dequant.c`` into a shared library next to this module (``setup.py``: an
optional extension, so a machine without a C compiler installs without it). Nothing is compiled or
downloaded at run time: without the library, or for a case it does not cover, ``decode_into``
answers False and the caller decodes with PyTorch ops (same values: the library computes the same
fp32 ``min + code * scale`` with the same roundings).

``attend_codes`` is decode attention straight from the codes of compressed K / V block pairs (same
library, ``confkv_codes_attention``): no decoded element is written, the keys' and values' group
parameters (fp16 or dq6) are read in C.

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
            att = lib.confkv_codes_attention
            att.restype = None
            att.argtypes = [*([ctypes.c_void_p] * 8), ctypes.c_int, ctypes.c_void_p, *([ctypes.c_int] * 6),
                            *([ctypes.c_void_p] * 3)]
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


@cache
def codes_layout(spec: CodecSpec) -> Tensor:
    """A block layout as the library reads it (``L_*`` in ``_dequant.c``): int64 [8]."""
    dq6 = spec.params == "dq6"
    rows = 1
    for r in spec.rows_shape:
        rows *= r
    row = (spec.row_groups, rows, spec.row_code_nbytes) if dq6 else (1, 1, 0)
    return torch.tensor([spec.bits, spec.group, int(dq6), spec.params_offset, spec.num_groups, *row],
                        dtype=torch.int64)


def codes_pair_covered(k_spec: CodecSpec, v_spec: CodecSpec) -> bool:
    """Whether ``attend_codes`` reads blocks of this (key, value) codec pair: per-layer ``[bs, Hkv, D]``
    blocks, keys grouped along tokens (axis 0), values along head_dim (axis 2), the same shape."""
    return (available() and len(k_spec.shape) == 3 and k_spec.shape == v_spec.shape and k_spec.axis == 0
            and v_spec.axis == 2)


# Blocks per work item (a row's run of blocks for one KV head): small enough that one long row splits
# over the threads, large enough that merging partial results stays negligible.
CHUNK_BLOCKS = 16


def attend_codes(q: Tensor, keys: tuple[Tensor, Tensor], k_spec: CodecSpec, values: tuple[Tensor, Tensor],
                 v_spec: CodecSpec, row_start: Tensor, valid: Tensor,
                 state: tuple[Tensor, Tensor, Tensor]) -> None:
    """Fold B decode rows' attention over compressed block pairs into ``state``.

    q [B, Hq, D] fp32 contiguous, already scaled; ``keys`` = (bytes, offsets): K block i is the
    ``k_spec.nbytes`` bytes at ``offsets[i]`` (int64 [N]) of the uint8 1-D ``bytes`` (a layer's pool
    stream, read where it lies), ``values`` the same for its V block; row r owns blocks
    ``row_start[r]:row_start[r + 1]`` (int64 [B + 1]), block i holds ``valid[i]`` tokens (int32 [N]).
    ``state`` = (m [B, Hq], l [B, Hq], acc [B, Hq, D]), fp32 contiguous, updated in place: attention
    over the union is ``acc / l`` with log-sum-exp ``m + log l``. The caller checks
    ``codes_pair_covered`` first."""
    lib = _library()
    if lib is None or not codes_pair_covered(k_spec, v_spec):
        raise ValueError(f"codes attention does not cover keys {k_spec} with values {v_spec} here")
    b, hq, d = q.shape
    bs, heads, dim = k_spec.shape
    m, total, acc = state
    (k_src, k_off), (v_src, v_off) = keys, values
    n = k_off.shape[0]
    if (dim != d or hq % heads or not _inside(k_src, k_off, k_spec.nbytes, n)
            or not _inside(v_src, v_off, v_spec.nbytes, n)
            or tuple(row_start.shape) != (b + 1,) or tuple(valid.shape) != (n,) or int(row_start[-1]) != n
            or tuple(acc.shape) != (b, hq, d) or tuple(m.shape) != (b, hq) or tuple(total.shape) != (b, hq)):
        raise ValueError("attend_codes: inconsistent shapes or offsets")
    tensors = [q, k_src, v_src, m, total, acc]
    if any(not t.is_contiguous() or t.device.type != "cpu" for t in tensors) or q.dtype != torch.float32:
        raise ValueError("attend_codes takes contiguous CPU tensors and fp32 queries")
    row_start, valid = row_start.to(torch.int64).contiguous(), valid.to(torch.int32).contiguous()
    k_off, v_off = k_off.to(torch.int64).contiguous(), v_off.to(torch.int64).contiguous()
    klay, vlay = codes_layout(k_spec), codes_layout(v_spec)
    lib.confkv_codes_attention(k_src.data_ptr(), k_off.data_ptr(), klay.data_ptr(), v_src.data_ptr(),
                               v_off.data_ptr(), vlay.data_ptr(), row_start.data_ptr(), valid.data_ptr(), b,
                               q.data_ptr(), hq // heads, bs, heads, d, CHUNK_BLOCKS, torch.get_num_threads(),
                               m.data_ptr(), total.data_ptr(), acc.data_ptr())


def row_bytes(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Encoded blocks as rows uint8 [N, nbytes] in the (bytes, offsets) form ``attend_codes`` reads."""
    rows = rows.contiguous()
    return rows.view(-1), torch.arange(rows.shape[0], device=rows.device) * rows.shape[1]


def _inside(src: Tensor, offsets: Tensor, nbytes: int, n: int) -> bool:
    """Every block ``[offset, offset + nbytes)`` lies in the 1-D uint8 ``src`` (the library reads there)."""
    if src.dtype != torch.uint8 or src.dim() != 1 or tuple(offsets.shape) != (n,):
        return False
    return not n or (int(offsets.min()) >= 0 and int(offsets.max()) + nbytes <= src.numel())
