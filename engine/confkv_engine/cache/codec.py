"""Group-wise asymmetric quantization of KV blocks (int8 / int4 / int2): pure tensor functions.

One codec serves both background compression of cold blocks and the retention tiers' low-precision
form. The maths (``quantize`` / ``dequantize``) is kept apart from the storage layout (``to_bytes``
/ ``from_bytes``, ``encode_rows`` / ``decode_rows``), gpt-fast style; nothing here owns memory.

**Groups.** A block ``x`` (one K or V block: ``[L, block_size, Hkv, D]``) is cut along one axis into
groups of ``group`` consecutive elements; each group stores ``min`` and ``scale = (max - min) /
(2**bits - 1)`` in fp16 and every element the code ``round((x - min) / scale)``. Asymmetric (scale
and minimum) because post-RoPE keys and values are not centred on zero per group.

**Keys per channel, values per token (as KIVI).** Keys have a few outlier *channels*: fixed head
dimensions whose magnitude is many times the rest, for every token (RoPE rotates pairs of channels
but keeps their scale). Grouping keys along tokens (``axis=1``), one group per (layer, head,
channel), gives each outlier channel its own range, so it does not inflate the step of the others.
Values have no such channel structure, and attention output is a per-token weighted sum of value
rows, so values are grouped along ``head_dim`` (``axis=3``): a token's error stays in that token,
scaled by the attention it receives. A key group can span at most one block's tokens (16); the
value group is free up to ``D``.

**Accuracy.** ``min`` is rounded down and ``scale`` up to fp16, so every element of a group lies in
``[min, min + levels * scale]`` and decodes within ``scale / 2`` of its value. ``scale`` is the
group's range / levels, widened by fp16 rounding: by about 2**-10 relative, plus ``|min| * 2**-10 /
levels`` when the group sits far from zero compared with its range. A constant group (zero range)
decodes exactly when the constant is an fp16 number. Inputs must be finite and inside fp16's range
(|x| <= 65504); anything else is refused with ``ValueError`` (keep that block uncompressed).

**Bytes.** ``to_bytes`` lays out ``codes | pad to even | scales (fp16) | mins (fp16)`` in one flat
uint8 tensor (fits in pool memory or a file); int4 and int2 codes are packed 2 and 4 per byte,
little end first. For SmolLM2-135M (L=30, bs=16, Hkv=3, D=64; a bf16 block is 184,320 bytes, an
fp32 block 368,640, position metadata excluded), scales and mins included:

====================  ========  ========  ========
block                   int8      int4      int2
====================  ========  ========  ========
K, group 16 (tokens)   0.625x    0.375x    0.250x   of bf16 (half these of fp32)
V, group 64 (head)     0.531x    0.281x    0.156x   of bf16
V, group 32 (head)     0.563x    0.313x    0.188x   of bf16
====================  ========  ========  ========

So against an fp32 block every choice meets int8 <= 0.55x and int4 <= 0.3x. Against bf16, values
meet both with group 64 (one group per token and head) but keys cannot: 4 bytes of fp16 scale and
min per 16-token channel group is 0.25 bytes per element on top of the codes.

Decoding many blocks at once (``decode_rows`` on ``[N, nbytes]``, optionally one layer) is one
vectorised unpack-multiply-add over all of them, no Python loop per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from torch import Tensor

SUPPORTED_BITS = (2, 4, 8)
FP16_MAX = 65504.0


@dataclass(frozen=True)
class CodecSpec:
    """How one block of ``shape`` is encoded: ``bits`` per code, groups of ``group`` along ``axis``."""

    shape: tuple[int, ...]
    bits: int
    axis: int
    group: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if not self.shape or any(s <= 0 for s in self.shape):
            raise ValueError(f"block shape must be non-empty and positive, got {self.shape}")
        if not -len(self.shape) <= self.axis < len(self.shape):
            raise ValueError(f"axis {self.axis} is out of range for a block of shape {self.shape}")
        object.__setattr__(self, "axis", self.axis % len(self.shape))
        length = self.shape[self.axis]
        if self.group <= 0 or length % self.group:
            raise ValueError(f"group {self.group} must divide the axis length {length} (axis {self.axis})")
        if self.group % self.per_byte:
            raise ValueError(f"int{self.bits} packs {self.per_byte} codes per byte: group {self.group} "
                             f"must be a multiple of {self.per_byte}")

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def groups_shape(self) -> tuple[int, ...]:
        """Shape of scales and mins: the block's other axes in order, then the groups of ``axis``."""
        others = tuple(s for i, s in enumerate(self.shape) if i != self.axis)
        return (*others, self.shape[self.axis] // self.group)

    @property
    def packed_shape(self) -> tuple[int, ...]:
        """Shape of the packed codes: ``groups_shape`` then ``group / per_byte`` bytes."""
        return (*self.groups_shape, self.group // self.per_byte)

    @property
    def num_groups(self) -> int:
        return prod(self.groups_shape)

    @property
    def codes_nbytes(self) -> int:
        return prod(self.packed_shape)

    @property
    def nbytes(self) -> int:
        """Exact size of ``to_bytes``: codes, padding to an even offset, fp16 scales and mins."""
        return _even(self.codes_nbytes) + 4 * self.num_groups


def key_spec(shape: tuple[int, ...], bits: int, group: int | None = None) -> CodecSpec:
    """Keys of a ``[L, block_size, Hkv, D]`` block: per channel, grouped along tokens (default all)."""
    return CodecSpec(tuple(shape), bits, axis=1, group=group or shape[1])


def value_spec(shape: tuple[int, ...], bits: int, group: int | None = None) -> CodecSpec:
    """Values of a ``[L, block_size, Hkv, D]`` block: per token, grouped along head_dim (default D)."""
    return CodecSpec(tuple(shape), bits, axis=-1, group=group or shape[-1])


def encoded_nbytes(shape: tuple[int, ...], bits: int, axis: int, group: int) -> int:
    """Bytes of one encoded block, scales and mins included (``CodecSpec(...).nbytes``)."""
    return CodecSpec(tuple(shape), bits, axis, group).nbytes


def _even(n: int) -> int:
    return n + (n & 1)


# --------------------------------------------------------------------------- maths


def _grouped(x: Tensor, spec: CodecSpec) -> Tensor:
    """[*B, *shape] -> [*B, *groups_shape, group] (float32), ``axis`` moved last and split."""
    lead = x.dim() - len(spec.shape)
    if lead < 0 or tuple(x.shape[lead:]) != spec.shape:
        raise ValueError(f"expected a tensor ending in shape {spec.shape}, got {tuple(x.shape)}")
    moved = x.float().movedim(lead + spec.axis, -1)
    return moved.reshape(*moved.shape[:-1], spec.shape[spec.axis] // spec.group, spec.group)


def _ungrouped(g: Tensor, spec: CodecSpec, layer: int | None = None) -> Tensor:
    """Inverse of ``_grouped``: [*B, *groups_shape, group] -> [*B, *shape] (or the layer's shape)."""
    shape = spec.shape if layer is None else spec.shape[1:]
    axis = spec.axis if layer is None else spec.axis - 1
    flat = g.reshape(*g.shape[:-2], g.shape[-2] * g.shape[-1])
    return flat.movedim(-1, flat.dim() - len(shape) + axis)


def _fp16_bounds(lo: Tensor, hi: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """fp16 (min, scale) with min <= lo and min + levels * scale >= hi for every group."""
    magnitude = torch.maximum(-lo.amin(), hi.amax()).item()  # nan if any value is nan
    if not magnitude <= FP16_MAX:
        raise ValueError(f"cannot quantize a block holding inf, nan or |x| > {FP16_MAX} "
                         f"(fp16 scales and mins); largest magnitude {magnitude}")
    mins = lo.half()
    mins = torch.where(mins.float() > lo, torch.nextafter(mins, torch.full_like(mins, -torch.inf)), mins)
    scales = ((hi - mins.float()) / levels).half()
    short = mins.float() + scales.float() * levels < hi
    scales = torch.where(short, torch.nextafter(scales, torch.full_like(scales, torch.inf)), scales)
    return mins, scales


def quantize(x: Tensor, spec: CodecSpec) -> tuple[Tensor, Tensor, Tensor]:
    """[*B, *shape] -> codes uint8 [*B, *groups_shape, group]; scales, mins fp16 [*B, *groups_shape]."""
    g = _grouped(x, spec)
    mins, scales = _fp16_bounds(g.amin(-1), g.amax(-1), spec.levels)
    step = scales.float().unsqueeze(-1)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.round((g - mins.float().unsqueeze(-1)) / safe).clamp_(0, spec.levels)
    return codes.to(torch.uint8), scales, mins


def dequantize(codes: Tensor, scales: Tensor, mins: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes [..., group] * scales[..., None] + mins[..., None], computed in fp32, cast to ``dtype``."""
    x = codes.float() * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)
    return x.to(dtype)


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
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


# --------------------------------------------------------------------------- storage


@dataclass(frozen=True)
class EncodedBlock:
    """One encoded block: packed codes [*packed_shape] uint8, scales and mins [*groups_shape] fp16."""

    spec: CodecSpec
    codes: Tensor
    scales: Tensor
    mins: Tensor

    def to_bytes(self) -> Tensor:
        """One flat uint8 tensor of ``spec.nbytes`` (codes | pad | scales | mins)."""
        return _flatten(self.codes, self.scales, self.mins, self.spec, lead=())

    @classmethod
    def from_bytes(cls, buf: Tensor, spec: CodecSpec) -> EncodedBlock:
        """Views into ``buf`` (no copy) as written by ``to_bytes`` for the same ``spec``."""
        if buf.dim() != 1:
            raise ValueError(f"an encoded block is a flat uint8 tensor, got shape {tuple(buf.shape)}")
        codes, scales, mins = _sections(buf, spec)
        return cls(spec, codes, scales, mins)


def encode(x: Tensor, bits: int, axis: int, group: int) -> EncodedBlock:
    """Encode one block ``x`` [*shape] (fp32/bf16/fp16) with groups of ``group`` along ``axis``."""
    spec = CodecSpec(tuple(x.shape), bits, axis, group)
    codes, scales, mins = quantize(x, spec)
    return EncodedBlock(spec, pack(codes, bits), scales, mins)


def decode(block: EncodedBlock, dtype: torch.dtype = torch.float32) -> Tensor:
    """The block [*shape] in ``dtype`` (contiguous)."""
    spec = block.spec
    g = dequantize(unpack(block.codes, spec.bits), block.scales, block.mins, dtype)
    return _ungrouped(g, spec).contiguous()


def encode_rows(x: Tensor, spec: CodecSpec) -> Tensor:
    """Encode N stacked blocks at once: x [N, *shape] -> uint8 [N, spec.nbytes] (row i = block i)."""
    codes, scales, mins = quantize(x, spec)
    lead = tuple(x.shape[: x.dim() - len(spec.shape)])
    return _flatten(pack(codes, spec.bits), scales, mins, spec, lead=lead)


def decode_rows(rows: Tensor, spec: CodecSpec, dtype: torch.dtype = torch.float32,
                layer: int | None = None) -> Tensor:
    """Decode N encodings at once: rows [N, nbytes] -> [N, *shape], or [N, *shape[1:]] for one layer.

    ``rows`` may be gathered from pool memory (``buf[block_ids]``); only ``layer``'s codes, scales
    and mins are read when it is given (``axis`` must not be 0 then).
    """
    if rows.dim() != 2:
        raise ValueError(f"rows must be [N, nbytes], got shape {tuple(rows.shape)}")
    codes, scales, mins = _sections(rows, spec)
    if layer is not None:
        if spec.axis == 0:
            raise ValueError("per-layer decode needs the groups off axis 0 (the layer axis)")
        if not 0 <= layer < spec.shape[0]:
            raise ValueError(f"layer {layer} out of range for {spec.shape[0]} layers")
        codes, scales, mins = codes[:, layer], scales[:, layer], mins[:, layer]
    g = dequantize(unpack(codes, spec.bits), scales, mins, dtype)
    return _ungrouped(g, spec, layer).contiguous()


def _flatten(codes: Tensor, scales: Tensor, mins: Tensor, spec: CodecSpec,
             lead: tuple[int, ...]) -> Tensor:
    parts = [codes.reshape(*lead, -1)]
    if spec.codes_nbytes & 1:
        parts.append(torch.zeros(*lead, 1, dtype=torch.uint8, device=codes.device))
    for half in (scales, mins):
        parts.append(half.contiguous().reshape(*lead, -1).view(torch.uint8))
    return torch.cat(parts, dim=-1)


def _sections(buf: Tensor, spec: CodecSpec) -> tuple[Tensor, Tensor, Tensor]:
    """Views of (codes, scales, mins) in buf [*B, nbytes]; B is () or (N,)."""
    if buf.dtype != torch.uint8 or buf.shape[-1] != spec.nbytes:
        raise ValueError(f"expected uint8 encodings of {spec.nbytes} bytes for {spec}, "
                         f"got {buf.dtype} with last dimension {buf.shape[-1] if buf.dim() else None}")
    if buf.stride(-1) != 1:
        buf = buf.contiguous()
    lead = tuple(buf.shape[:-1])
    start = _even(spec.codes_nbytes)
    end = start + 2 * spec.num_groups
    codes = buf[..., : spec.codes_nbytes].reshape(*lead, *spec.packed_shape)
    scales = _fp16_view(buf[..., start:end]).reshape(*lead, *spec.groups_shape)
    mins = _fp16_view(buf[..., end:]).reshape(*lead, *spec.groups_shape)
    return codes, scales, mins


def _fp16_view(section: Tensor) -> Tensor:
    """Reinterpret uint8 bytes as fp16 without a copy when aligned (copy otherwise)."""
    try:
        return section.view(torch.float16)
    except RuntimeError:
        return section.contiguous().view(torch.float16)
