"""Attention mass per cached token from the recorded queries' scores (``_mass.c``, the ``_mass``
library), loaded with ctypes when it was built.

What it replaces, at a decision step of a retained sequence: the softmax of the score matrix, the sum
over each KV head's query heads and the fold into the retention sums (``scorer.update_attention``,
``scorer.update_peak``), a dozen PyTorch passes over [units, G, T, n] tensors, by one pass per score
row. CPU and fp32 scores only; elsewhere (CUDA, no compiler, ``CONFKV_NATIVE_MASS=0``) the PyTorch
path runs, and the tests hold the two equal.
"""

from __future__ import annotations

import ctypes
import warnings
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from confkv_engine.cache.codec.native import find_library
from confkv_engine.retention.scorer import AttentionMass, PeakFilter

LIBRARY = "_mass"
ABI = 1  # confkv_mass_abi() of the arguments below
SWITCH = "CONFKV_NATIVE_MASS"


@cache
def _library() -> ctypes.CDLL | None:
    lib = find_library(Path(__file__).parent, LIBRARY, SWITCH)
    if lib is None:
        return None
    if not hasattr(lib, "confkv_mass_abi") or lib.confkv_mass_abi() != ABI:
        warnings.warn(f"{LIBRARY} was built from an older _mass.c: rebuild it (pip install -e . "
                      "or make setup); retention scores with PyTorch ops meanwhile", stacklevel=2)
        return None
    fn = lib.confkv_attention_mass
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, *([ctypes.c_int64] * 4), ctypes.c_void_p, ctypes.c_int64,
                   *([ctypes.c_void_p] * 6), ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    return lib


def available() -> bool:
    """Whether the library was built and loads here (and is not switched off)."""
    return _library() is not None


def applies(device: torch.device) -> bool:
    """Whether scores on ``device`` fold natively."""
    return device.type == "cpu" and available()


def attention_mass(scores: Tensor, group: int, key_pos: Tensor, query_pos: Tensor, weights: Tensor,
                   peak: PeakFilter | None) -> AttentionMass:
    """``scorer.attention_mass`` from the scores: ``scores`` [U, G * T, n] fp32 (row g * T + i: query i
    through query head g, as ``retention.scoring.scaled_scores`` lays them out; overwritten), key_pos
    [U, n], query_pos [T] (ascending), the queries' weights [T] (``scorer.query_weights``)."""
    u, n = key_pos.shape
    t = query_pos.numel()
    if scores.shape != (u, group * t, n) or scores.dtype != torch.float32 or not scores.is_contiguous():
        raise ValueError(f"scores must be contiguous fp32 [{u}, {group * t}, {n}], got {tuple(scores.shape)}")
    pos = key_pos.to(torch.int32).contiguous()
    qpos = query_pos.to(torch.int32).contiguous()
    w = weights.to(torch.float32).contiguous()
    out = torch.empty((4 if peak else 2, u, n))
    psum, pcount = (out[2], out[3]) if peak else (None, None)
    rc = _library().confkv_attention_mass(
        scores.data_ptr(), u, group, t, n, pos.data_ptr(), n, qpos.data_ptr(), w.data_ptr(),
        out[0].data_ptr(), out[1].data_ptr(), psum.data_ptr() if psum is not None else None,
        pcount.data_ptr() if pcount is not None else None, peak.min_distance if peak else 0,
        -1 if peak is None or peak.reach is None else peak.reach, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("attention mass: out of memory for a row of scratch")
    return AttentionMass(out[0], out[1], psum, pcount)
