"""Bit packing of the codec's codes: int4 / int2 codes 2 and 4 per byte, and dq6's 6-bit group
parameter codes four per 3 bytes, little end first. Pure tensor functions, one vectorised pass
over every block at once (a Python loop only over the few bit fields of a byte)."""

from __future__ import annotations

import torch
from torch import Tensor

SIX_BITS = 63  # mask of one 6-bit code


def pack(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes [..., n] (each < 2**bits) -> [..., n * bits / 8]; the first code in the low bits."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes.to(torch.uint8)
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    out = c[..., 0].clone()
    for i in range(1, per_byte):  # at most 3 iterations: one per bit field, not per block
        out |= c[..., i] << (bits * i)
    return out


def unpack(packed: Tensor, bits: int) -> Tensor:
    """Inverse of ``pack``: uint8 [..., m] -> codes [..., m * 8 / bits]."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    mask = (1 << bits) - 1
    # One shift per bit field, stacked: a broadcast shift over a [.., per_byte] axis of uint8 takes
    # ATen's scalar path and measured 2x slower on the decode of every frozen block.
    fields = [packed & mask] + [(packed >> (bits * i)) & mask for i in range(1, per_byte)]
    return torch.stack(fields, -1).reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


def pack6(codes: Tensor) -> Tensor:
    """6-bit codes [..., n] -> uint8 [..., 3 * ceil(n / 4)]: four codes per 3 bytes, little end first."""
    pad = -codes.shape[-1] % 4
    c = codes.to(torch.int32)
    if pad:
        c = torch.cat([c, c.new_zeros(*c.shape[:-1], pad)], -1)
    c = c.reshape(*c.shape[:-1], -1, 4)
    word = c[..., 0] | c[..., 1] << 6 | c[..., 2] << 12 | c[..., 3] << 18
    out = torch.stack([word & 255, (word >> 8) & 255, word >> 16], -1)
    return out.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def unpack6(packed: Tensor, n: int) -> Tensor:
    """Inverse of ``pack6``: uint8 [..., 3k] -> the first ``n`` codes [..., n]."""
    b = packed.to(torch.int32).reshape(*packed.shape[:-1], -1, 3)
    word = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16
    # Made on the device (no host-to-device copy while decoding a frozen block): 0, 6, 12, 18.
    shifts = torch.arange(0, 24, 6, dtype=torch.int32, device=packed.device)
    codes = (word.unsqueeze(-1) >> shifts) & SIX_BITS
    return codes.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.uint8)
