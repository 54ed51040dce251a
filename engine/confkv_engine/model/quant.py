"""Weight quantization maths, as pure functions on arrays (no modules, no kernels, no I/O).

Two target formats, both the ones PyTorch's CPU weight-only kernels consume:

- **int4, groups along K**: ``q`` in 0..15 ``[N, K]``, ``scale`` and ``zero`` ``[N, K/group]`` with
  ``w = (q - 8) * scale + zero`` (the convention of ``_weight_int4pack_mm_for_cpu``). GGUF's Q4_0
  (``w = d * (q - 8)``) and Q4_1 (``w = d * q + m``) blocks of 32 map onto it exactly, with
  ``zero = 0`` and ``zero = m + 8 d`` respectively; the only rounding left is that of storing
  ``scale`` / ``zero`` in the activation dtype (bf16 keeps 8 mantissa bits).
- **int8, one scale per output row** (symmetric, ``w = q * scale``): what ``_weight_int8pack_mm``
  uses. Formats with per-block scales (Q8_0, the K-quants) are
  requantized from their dequantized values, so this costs one more rounding (at most half a step
  of the row's scale, about 0.8 % of the weights' RMS on this model, since a row's absmax is
  3-4x its RMS). Searching a per-row clip ratio for the least squared error was measured and
  lowers that error by only 3 % (the rows are not outlier-dominated), so the scale stays absmax/127.

The ``int8`` mode keeps the query and value projections (``INT8_DENSE_LINEARS``) dense in the
activation dtype: measured one family at a time on the embedded model (bench/quality/weights_quality.py),
they are the ones whose int8 rounding moves perplexity most (the attention logits and the values
every later token mixes), as llama.cpp's mixtures keep ``attn_v`` at more bits than the rest.
They are about an eighth of the linear weights (+10 % weight bytes over all-int8).

- **int8, one scale per output row and group of 32 or 16** (``Int8GroupWeight``, ``w = q * scale``):
  GGUF's Q8_0 (``w = d * q``) and Q5_0 (``w = d * (q - 16)``) blocks of 32 and Q6_K's sub-blocks of
  16 (``w = d * sc_j * (q - 32)``: one fp32 scale ``d * sc_j``, exact) as they are stored, codes in
  -32..31 at most for the 5- and 6-bit ones: no second rounding. Only the native int8 kernel
  (``q8native``) reads it; the loader asks for it where that kernel serves int8 weights.

``unpack_q4`` reads the raw GGUF bytes directly: nothing is expanded to fp32 for the 4-bit path.
Q4_K (super-blocks of 256 = 8 sub-blocks of 32, ``w = d * sc_j * q - dmin * m_j`` with 6-bit
``sc_j``, ``m_j``) maps onto the same groups of 32 exactly: ``scale = d * sc_j``,
``zero = 8 * scale - dmin * m_j`` (``unpack_q4_k``). Q5_K and Q6_K have no such layout here (5 and
6 bits): the loader serves them dense in the activation dtype instead of requantizing them
(``DENSE_K_TYPES``), except where the native int8 kernel runs: there Q6_K converts exactly to int8
groups of 16 (``int8_groups``), read by that kernel at a few rows, the dense copy above.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

Q4_BLOCK = 32
# bytes per 32-weight block: Q4_0 = f16 d + 16 nibble bytes; Q4_1 = f16 d + f16 m + 16 bytes.
_Q4_LAYOUT = {"Q4_0": (18, False), "Q4_1": (20, True)}
INT4_TYPES = frozenset({*_Q4_LAYOUT, "Q4_K"})
DENSE_K_TYPES = frozenset({"Q5_K", "Q6_K"})
QK_K = 256
_Q4_K_BYTES = 144  # f16 d, f16 dmin, 12 bytes of packed 6-bit scales and mins, 128 nibble bytes
INT8_DENSE_LINEARS = ("q_proj", "v_proj")


def int8_keeps_dense(path: str) -> bool:
    """Whether the ``int8`` mode leaves the linear at module path ``path`` dense."""
    return path.rpartition(".")[2] in INT8_DENSE_LINEARS


@dataclass(frozen=True)
class Int4Weight:
    q: Tensor  # [N, K] int32 in 0..15
    scale: Tensor  # [N, K / group] fp32
    zero: Tensor  # [N, K / group] fp32
    group: int

    def dequantize(self) -> Tensor:
        n, k = self.q.shape
        groups = (self.q.float() - 8).view(n, k // self.group, self.group)
        return (groups * self.scale[..., None] + self.zero[..., None]).view(n, k)

    def permute_rows(self, order: Tensor) -> Int4Weight:
        return Int4Weight(self.q[order], self.scale[order], self.zero[order], self.group)


@dataclass(frozen=True)
class Int8Weight:
    q: Tensor  # [N, K] int8
    scale: Tensor  # [N] fp32

    def dequantize(self) -> Tensor:
        return self.q.float() * self.scale[:, None]

    def permute_rows(self, order: Tensor) -> Int8Weight:
        return Int8Weight(self.q[order], self.scale[order])


@dataclass(frozen=True)
class Int8GroupWeight:
    q: Tensor  # [N, K] int8 in -127..127
    scale: Tensor  # [N, K / group] fp32
    group: int  # 32 or 16

    def dequantize(self) -> Tensor:
        n, k = self.q.shape
        return (self.q.float().view(n, k // self.group, self.group) * self.scale[..., None]).view(n, k)

    def permute_rows(self, order: Tensor) -> Int8GroupWeight:
        return Int8GroupWeight(self.q[order], self.scale[order], self.group)


# Types served exactly as ``Int8GroupWeight``: type -> (bytes per block, weights per block, group).
GROUPED_INT8_TYPES = {"Q8_0": (34, 32, 32), "Q5_0": (22, 32, 32), "Q6_K": (210, QK_K, 16)}
# Of those, the ones the loader serves as ``Int8GroupWeight`` (all; Q6_K's groups of 16 are kind
# ``int8g16``, served by q8n only at the few rows where it beats the layer's dense copy, see
# ``kernels.INT8G16_MAX_ROWS``).
GROUPED_INT8_SERVED = frozenset({"Q8_0", "Q5_0", "Q6_K"})


def _group_scales(raw: np.ndarray, type_name: str, k: int) -> np.ndarray:
    """Raw rows of a ``GROUPED_INT8_TYPES`` type -> its scale per row and group, ``[N, K / group]``."""
    block_bytes, per_block, _ = GROUPED_INT8_TYPES[type_name]
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], k // per_block, block_bytes)
    if type_name == "Q6_K":  # 128 + 64 bytes of codes, 16 int8 sub-block scales, then f16 d
        d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
        return (d[..., None] * blocks[..., 192:208].copy().view(np.int8)).reshape(raw.shape[0], -1)
    return blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # f16 d first


def int8_groups(raw: np.ndarray, type_name: str, dense: np.ndarray) -> Int8GroupWeight:
    """A ``GROUPED_INT8_TYPES`` tensor -> ``Int8GroupWeight``: the scales read from its raw rows, the
    codes recovered from its dequantized values ``dense [N, K]`` (``round(w / scale)`` is exact: each
    value is the scale times a small integer)."""
    n, k = dense.shape
    group = GROUPED_INT8_TYPES[type_name][2]
    scale = _group_scales(raw, type_name, k)
    safe = np.where(scale == 0, 1.0, scale)[..., None]
    codes = np.rint(dense.reshape(n, k // group, group) / safe).clip(-127, 127)
    q = torch.from_numpy(codes.astype(np.int8).reshape(n, k))
    return Int8GroupWeight(q, torch.from_numpy(scale), group)


def unpack_q4(raw: np.ndarray, type_name: str, k: int) -> Int4Weight:
    """Raw GGUF Q4_0 / Q4_1 / Q4_K rows (uint8 ``[N, K/32 * block bytes]``) -> exact int4 groups of 32."""
    if type_name == "Q4_K":
        return unpack_q4_k(raw, k)
    if type_name not in _Q4_LAYOUT:
        raise ValueError(f"not a 4-bit block type: {type_name}")
    block_bytes, has_min = _Q4_LAYOUT[type_name]
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, k // Q4_BLOCK, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else None
    qs = blocks[..., block_bytes - 16:]
    # Element j of a block is the low nibble of byte j, element j + 16 its high nibble.
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    zero = (m + 8.0 * d) if m is not None else np.zeros_like(d)
    return Int4Weight(torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d),
                      torch.from_numpy(zero), Q4_BLOCK)


def _k4_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes per super-block -> 8 six-bit scales and 8 mins (ggml's ``get_scale_min_k4``)."""
    p = packed.astype(np.uint8)
    sc = np.concatenate([p[..., 0:4] & 63, (p[..., 8:12] & 0x0F) | ((p[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([p[..., 4:8] & 63, (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def unpack_q4_k(raw: np.ndarray, k: int) -> Int4Weight:
    """Raw GGUF Q4_K rows (uint8 ``[N, K/256 * 144]``) -> int4 groups of 32, exact in fp32."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, k // QK_K, _Q4_K_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    sc, mn = _k4_scales_mins(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(n, k // QK_K, 4, 32)
    # Sub-blocks 2c and 2c + 1 share 32 bytes: the low nibbles are 2c's, the high ones 2c + 1's.
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)
    scale = (d[..., None] * sc).reshape(n, -1)
    zero = (8.0 * d[..., None] * sc - dmin[..., None] * mn).reshape(n, -1)
    return Int4Weight(torch.from_numpy(q.astype(np.int32)), torch.from_numpy(scale),
                      torch.from_numpy(zero), Q4_BLOCK)


def quantize_int4(w: Tensor, group: int = Q4_BLOCK) -> Int4Weight:
    """Dense ``[N, K]`` -> asymmetric int4 groups (min/max per group), for sources without 4-bit blocks."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group {group}")
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    return Int4Weight(q.view(n, k), scale, lo + 8 * scale, group)


def quantize_int8(w: Tensor) -> Int8Weight:
    """Dense ``[N, K]`` -> symmetric int8 with one scale per output row."""
    wf = w.float()
    scale = (wf.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = (wf / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


def quantize_int8_groups(w: Tensor, group: int = 32) -> Int8GroupWeight:
    """Dense ``[N, K]`` -> symmetric int8 with one fp16-valued scale per output row and group."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    # fp16 scales, as GGUF's blocks and the native kernel keep them (2^-24: the smallest fp16)
    scale = (g.abs().amax(-1) / 127).clamp_min(2.0 ** -24).half().float()
    q = (g / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
    return Int8GroupWeight(q.view(n, k), scale, group)


def int4_scales_and_zeros(weight: Int4Weight, dtype: torch.dtype) -> Tensor:
    """``[K / group, N, 2]`` (scale, zero) in the activation dtype, the layout the kernel reads."""
    return torch.stack([weight.scale.t(), weight.zero.t()], dim=-1).contiguous().to(dtype)
