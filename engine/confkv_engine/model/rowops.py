"""The decoder layers' elementwise blocks as single native calls (``_rowops.c``, in the ``_native``
library), used in place of the PyTorch reference functions of ``llama`` where they apply.

Why: at one decode row RMSNorm, RoPE and the gated activation are a few hundred elements each, and
their PyTorch ops cost more in dispatch than in arithmetic (an RMSNorm is eight ops, ~35 us a call
on the development machine; a layer makes several such calls). Each native function repeats its
reference's roundings (fp32 statistics, bf16 results rounded to nearest even where the reference
rounds), so outputs match the reference up to the order of a sum and the last bit of exp / tanh (the
activation computes GELU's ``1 + tanh(y)`` as ``2 sigmoid(2 y)``, through one exp).

Every function returns None (or False) when it does not apply, and the caller runs the reference:
library not built (no C compiler at install), ``CONFKV_NATIVE_ROWOPS=0``, a tensor not on the CPU,
not fp32 / bf16, dtypes that differ, not contiguous, or needing gradients.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from confkv_engine.model.native import LIBRARY, find_library

SWITCH = "CONFKV_NATIVE_ROWOPS"
# The gated activation's native loop (a vectorised exp) against PyTorch's kernels, 2 threads, bf16, the
# EPYC development machine, scratch timing of the C call: GELU (tanh form, 2 x 2,048) 6.5 against 9.5 us
# at one row, 0.84 against 1.15 ms at 512 rows; SiLU (2 x 1,536) 4.7 against 6.1 us at one row, level
# at 4-32 rows, 0.60 against 0.32 ms at 512. So GELU runs natively at every row count, SiLU at up to 2.
ACT_MAX_ROWS = {"silu": 2, "gelu_pytorch_tanh": 1 << 62}
ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I64, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "confkv_rms_norm": [_P, _P, _P, _I64, _I64, _F, _I, _I],
    "confkv_add_rms_norm": [_P, _P, _P, _P, _P, _P, _I64, _I64, _F, _I, _I],
    "confkv_qk_rope": [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _F, _F, _I, _I],
    "confkv_gated_act": [_P, _P, _I64, _I64, _I, _I, _I],
}


@cache
def _library() -> ctypes.CDLL | None:
    lib = find_library(Path(__file__).parent, LIBRARY, SWITCH)
    if lib is None or not all(hasattr(lib, name) for name in _SIGNATURES):
        return None  # (a library built from an older _rowops.c lacks some: the reference serves)
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def available() -> bool:
    return _library() is not None


def _fits(*tensors: Tensor) -> bool:
    dtype = tensors[0].dtype
    if dtype not in _DTYPES:
        return False
    for t in tensors:  # (a loop, not all(genexpr): this runs several times per layer and step)
        if t.dtype != dtype or not t.is_cpu or not t.is_contiguous() or t.requires_grad:
            return False
    return True


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """``llama.rms_norm`` (x [..., dim], weight [dim]) in one call, or None."""
    lib = _library()
    if lib is None or not _fits(x, weight):
        return None
    out = torch.empty_like(x)
    dim = x.shape[-1]
    rc = lib.confkv_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
                             _DTYPES[x.dtype], torch.get_num_threads())
    return None if rc else out


def add_rms_norm(resid: Tensor, y: Tensor, weight: Tensor | None, eps: float,
                 y_weight: Tensor | None = None) -> tuple[Tensor, Tensor | None] | None:
    """``(s, rms_norm(s, weight))`` with ``s = resid + y`` (or ``resid + rms_norm(y, y_weight)``),
    the second None when ``weight`` is; or None."""
    lib = _library()
    parts = [t for t in (resid, y, weight, y_weight) if t is not None]
    if lib is None or resid.shape != y.shape or not _fits(*parts):
        return None
    s = torch.empty_like(resid)
    out = None if weight is None else torch.empty_like(resid)
    dim = resid.shape[-1]
    rc = lib.confkv_add_rms_norm(resid.data_ptr(), y.data_ptr(), _ptr(y_weight), s.data_ptr(), _ptr(weight),
                                 _ptr(out), resid.numel() // dim, dim, eps, _DTYPES[resid.dtype],
                                 torch.get_num_threads())
    return None if rc else (s, out)


def qk_rope_(qkv: Tensor, heads: int, nq: int, cos: Tensor, sin: Tensor, norm_weight: Tensor | None,
             eps: float, q_scale: float) -> bool:
    """In place on the first ``heads`` heads of ``qkv`` [T, H, D] (queries 0 .. nq - 1, then keys):
    the per-head norm (``norm_weight`` [heads, D], None for none), ``llama.apply_rope`` with
    cos / sin [T, D / 2] fp32, then queries times ``q_scale``. False (nothing done) when it does
    not apply."""
    lib = _library()
    weights = (qkv,) if norm_weight is None else (qkv, norm_weight)
    if lib is None or not _fits(*weights) or not _fits(cos, sin) or cos.dtype != torch.float32:
        return False
    t, _, d = qkv.shape
    if cos.shape != (t, d // 2) or sin.shape != cos.shape:
        return False
    rc = lib.confkv_qk_rope(qkv.data_ptr(), t, qkv.stride(0), heads, nq, d, cos.data_ptr(), sin.data_ptr(),
                            _ptr(norm_weight), eps, q_scale, _DTYPES[qkv.dtype], torch.get_num_threads())
    return rc == 0


def gated_act(gate_up: Tensor, act: str) -> Tensor | None:
    """``act(gate) * up`` for ``gate_up`` [..., 2 I] whose halves are gate and up, or None (also above
    the activation's ``ACT_MAX_ROWS``)."""
    lib = _library()
    inter = gate_up.shape[-1] // 2
    rows = gate_up.numel() // max(1, 2 * inter)
    if lib is None or act not in ACTS or rows > ACT_MAX_ROWS[act] or not _fits(gate_up):
        return None
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    rc = lib.confkv_gated_act(gate_up.data_ptr(), out.data_ptr(), rows, inter, ACTS[act],
                              _DTYPES[gate_up.dtype], torch.get_num_threads())
    return None if rc else out
