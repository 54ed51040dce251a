"""The native block decoder (``_dequant.c``), loaded with ctypes when it was built.

``pip install`` builds ``_dequant.c`` into a shared library next to this module (``setup.py``: an
optional extension, so a machine without a C compiler installs without it). Nothing is compiled or
downloaded at run time: without the library, or for a case it does not cover, ``decode_into``
answers False and the caller decodes with PyTorch ops (same values: the library computes the same
fp32 ``min + code * scale`` with the same roundings).

``decode_keys_transposed`` decodes key blocks channel-major, as K^T, for the score matmul of
retention's decisions (``retention.scoring``): the codes are stored that way, so nothing is transposed.

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
import warnings
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from confkv_engine.cache.codec.spec import CodecSpec

LIBRARY = "_dequant"
CODES_ABI = 4  # confkv_codes_abi() of the functions below (4: confkv_dequantize_keys_cm)
_OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# CONFKV_NATIVE_CODEC=0 turns the library off (the PyTorch decode, for comparisons).
SWITCH = "CONFKV_NATIVE_CODEC"


def find_library(directory: Path, name: str, switch: str) -> ctypes.CDLL | None:
    """The extension ``name`` built into ``directory``, loaded with ctypes; None when it was not built
    or the environment variable ``switch`` is "0" (the PyTorch path, for comparisons). The engine's
    other native libraries load through it too, each setting its own signatures."""
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
    fn = lib.confkv_dequantize
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, *([ctypes.c_int] * 7)]
    if not hasattr(lib, "confkv_codes_abi") or lib.confkv_codes_abi() != CODES_ABI:
        warnings.warn(f"{LIBRARY} was built from older sources (_dequant.c, _codes*.c): rebuild it "
                      "(pip install -e . or make setup); the codec decodes with PyTorch ops meanwhile",
                      stacklevel=2)
        return None
    cm = lib.confkv_dequantize_keys_cm
    cm.restype = None
    cm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, *([ctypes.c_int] * 6)]
    att = lib.confkv_codes_attention
    att.restype = ctypes.c_int
    blocks = [ctypes.c_void_p, ctypes.c_int64, *([ctypes.c_void_p] * 3)]  # raw, len, off, tail, lay
    att.argtypes = [*blocks, *blocks, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                    ctypes.c_void_p, *([ctypes.c_int] * 6), *([ctypes.c_void_p] * 3)]
    lib.confkv_codes_vector_folds.restype = ctypes.c_int
    lib.confkv_codes_vector_folds.argtypes = [ctypes.c_int]
    return lib


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


def decode_keys_transposed(rows: Tensor, spec: CodecSpec, scales: Tensor, mins: Tensor, out: Tensor,
                           dst: Tensor) -> bool:
    """Decode key blocks (groups along tokens) ``rows`` [N, spec.nbytes] channel-major into ``out``
    [R, Hkv * D, bs * C] fp32 (K^T of R layers of C table rows): block i, its token t and channel hc
    go to ``out.view(-1, bs * C)[hc + (dst[i] // C) * Hkv * D, (dst[i] % C) * bs + t]``, i.e. ``dst[i]
    = layer * C + table row``; -1 skips. False (nothing written) when not covered."""
    if (not covers(spec, torch.float32, out.device) or spec.axis != 0 or out.dtype != torch.float32
            or not out.is_contiguous()):
        return False
    n, (bs, heads, dim) = rows.shape[0], spec.shape
    r, hd, ld = out.shape
    if hd != heads * dim or ld % bs or tuple(rows.shape) != (n, spec.nbytes) or dst.shape != (n,):
        raise ValueError(f"native decode: rows {tuple(rows.shape)}, out {tuple(out.shape)} do not fit {spec}")
    per = ld // bs
    dst = dst.to(torch.int64)
    if n and int(dst.max()) >= r * per:
        raise ValueError(f"native decode: row {int(dst.max())} is past the {r * per} rows of out")
    # Block i starts at out + base * bs floats, base = layer * hd * per + row (see the C docstring).
    base = torch.where(dst >= 0, (dst // per) * hd * per + dst % per, dst).contiguous()
    lib = _library()
    assert lib is not None
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    scales, mins = (x.to(torch.float32).reshape(n, spec.num_groups).contiguous() for x in (scales, mins))
    lib.confkv_dequantize_keys_cm(rows.data_ptr(), rows.stride(0), scales.data_ptr(), mins.data_ptr(),
                                  spec.num_groups, out.data_ptr(), ld, base.data_ptr(), n, spec.bits, bs,
                                  heads, dim, spec.group, torch.get_num_threads())
    return True


@cache
def codes_layout(spec: CodecSpec) -> Tensor:
    """A block layout as the library reads it (``L_*`` in ``_dequant.c``): int64 [8]."""
    dq6 = spec.params == "dq6"
    rows = 1
    for r in spec.rows_shape:
        rows *= r
    row = (spec.row_groups, rows, spec.row_code_nbytes) if dq6 else (1, 1, 0)
    return torch.tensor([spec.bits, spec.group, int(dq6), spec.params_offset, spec.num_groups, *row,
                         spec.nbytes], dtype=torch.int64)


def codes_pair_covered(k_spec: CodecSpec, v_spec: CodecSpec) -> bool:
    """Whether ``attend_codes`` reads blocks of this (key, value) codec pair: per-layer ``[bs, Hkv, D]``
    blocks, keys grouped along tokens (axis 0), values along head_dim (axis 2), the same shape."""
    return (available() and len(k_spec.shape) == 3 and k_spec.shape == v_spec.shape and k_spec.axis == 0
            and v_spec.axis == 2)


# Blocks per work item (a row's run of blocks for one KV head): small enough that one long row splits
# over the threads, large enough that merging partial results stays negligible.
CHUNK_BLOCKS = 16


Source = tuple[Tensor, Tensor, Tensor | None]


def attend_codes(q: Tensor, keys: Source, k_spec: CodecSpec, values: Source, v_spec: CodecSpec,
                 row_start: Tensor, valid: Tensor, state: tuple[Tensor, Tensor, Tensor]) -> None:
    """Fold B decode rows' attention over compressed block pairs into ``state``.

    q [B, Hq, D] fp32 contiguous, already scaled; ``keys`` = (bytes, offsets, tails): K block i is the
    ``k_spec.nbytes`` bytes at ``offsets[i]`` (int64 [N]) of the uint8 1-D ``bytes`` (a layer's pool
    stream, read where it lies), or, where ``tails`` (int64 [N, 2] or None) says ``tails[i, 0] <
    nbytes``, its first ``tails[i, 0]`` bytes there and the rest from ``tails[i, 1]`` (a slot straddling
    two pool blocks that are not neighbours); ``values`` the same for its V block; row r owns blocks
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
    (k_src, k_off, k_tail), (v_src, v_off, v_tail) = keys, values
    n = k_off.shape[0]
    if (dim != d or hq % heads or not _stream(k_src, k_off, k_tail, n) or not _stream(v_src, v_off, v_tail, n)
            or tuple(row_start.shape) != (b + 1,) or tuple(valid.shape) != (n,)
            or tuple(acc.shape) != (b, hq, d) or tuple(m.shape) != (b, hq) or tuple(total.shape) != (b, hq)):
        raise ValueError("attend_codes: inconsistent shapes")
    tensors = [q, k_src, v_src, m, total, acc]
    if any(not t.is_contiguous() or t.device.type != "cpu" for t in tensors) or q.dtype != torch.float32:
        raise ValueError("attend_codes takes contiguous CPU tensors and fp32 queries")
    row_start, valid = row_start.to(torch.int64).contiguous(), valid.to(torch.int32).contiguous()
    k_off, v_off = k_off.to(torch.int64).contiguous(), v_off.to(torch.int64).contiguous()
    k_tail, v_tail = (None if t is None else t.to(torch.int64).contiguous() for t in (k_tail, v_tail))
    klay, vlay = codes_layout(k_spec), codes_layout(v_spec)
    # The library checks every block against its stream (and row_start) before reading anything.
    rc = lib.confkv_codes_attention(
        k_src.data_ptr(), k_src.numel(), k_off.data_ptr(), _ptr(k_tail), klay.data_ptr(),
        v_src.data_ptr(), v_src.numel(), v_off.data_ptr(), _ptr(v_tail), vlay.data_ptr(),
        row_start.data_ptr(), n, valid.data_ptr(), b, q.data_ptr(), hq // heads, bs, heads, d, CHUNK_BLOCKS,
        torch.get_num_threads(), m.data_ptr(), total.data_ptr(), acc.data_ptr())
    if rc == -1:
        raise ValueError("attend_codes: a block lies outside its bytes, or row_start does not cover them")
    if rc:
        raise MemoryError("attend_codes: out of memory")


def vector_folds(on: bool | None = None) -> bool:
    """Whether ``attend_codes`` folds the codecs' usual block shape in AVX2 vectors (CPUs with
    x86-64-v3) rather than in the portable array form; ``on`` chooses (the tests run both forms)."""
    lib = _library()
    return lib is not None and bool(lib.confkv_codes_vector_folds(-1 if on is None else int(on)))


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def row_bytes(rows: Tensor) -> Source:
    """Encoded blocks as rows uint8 [N, nbytes] in the (bytes, offsets, tails) form ``attend_codes`` reads."""
    rows = rows.contiguous()
    return rows.view(-1), torch.arange(rows.shape[0], device=rows.device) * rows.shape[1], None


def _stream(src: Tensor, offsets: Tensor, tails: Tensor | None, n: int) -> bool:
    """The form of one side's (bytes, offsets, tails); the library checks where the blocks lie."""
    return (src.dtype == torch.uint8 and src.dim() == 1 and tuple(offsets.shape) == (n,)
            and (tails is None or tuple(tails.shape) == (n, 2)))
