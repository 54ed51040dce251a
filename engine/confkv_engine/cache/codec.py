"""Group-wise asymmetric quantization of KV blocks (int8 / int4 / int2): pure tensor functions.

One codec serves both background compression of cold blocks and the retention tiers' low-precision
form. The maths (``quantize`` / ``dequantize``) is kept apart from the storage layout (``to_bytes``
/ ``from_bytes``, ``encode_rows`` / ``decode_rows``), gpt-fast style; nothing here owns memory.

**Groups.** A block ``x`` (one K or V block: ``[L, block_size, Hkv, D]``) is cut along one axis into
groups of ``group`` consecutive elements; each group has a ``min`` and a ``scale`` (about ``(max -
min) / (2**bits - 1)``) and every element the code ``round((x - min) / scale)``. Asymmetric (scale
and minimum) because post-RoPE keys and values are not centred on zero per group (see dq6 below
for what the alternatives cost).

**Keys per channel, values per token (as KIVI).** Keys have a few outlier *channels*: fixed head
dimensions whose magnitude is many times the rest, for every token (RoPE rotates pairs of channels
but keeps their scale). Grouping keys along tokens (``axis=1``), one group per (layer, head,
channel), gives each outlier channel its own range, so it does not inflate the step of the others.
Values have no such channel structure, and attention output is a per-token weighted sum of value
rows, so values are grouped along ``head_dim`` (``axis=3``): a token's error stays in that token,
scaled by the attention it receives. A key group can span at most one block's tokens (16); the
value group is free up to ``D``.

**Group parameters** (``CodecSpec.params``):

- ``fp16``: each group's ``min`` (rounded down) and ``scale`` (rounded up) in fp16, 4 bytes a group.
  Every element lies in ``[min, min + levels * scale]`` and decodes within ``scale / 2``; ``scale``
  is the range / levels widened by about 2**-10 relative. A constant group decodes exactly when the
  constant is an fp16 number. Used for values: a value group is a whole head row (64 elements), so
  4 bytes are cheap there.
- ``dq6`` (double quantization, for keys): a 16-token key group has only 16 elements, so 4 bytes of
  fp16 parameters are 0.25 byte per element, more than the int4 target allows at bf16. Instead one
  *row* of groups (the last two axes of ``groups_shape``: the D channels of one (layer, head)) shares
  an fp16 header ``(top, floor, step)`` and every group stores two 6-bit codes (1.5 bytes): its
  ``min = floor + m * step`` (``m`` = 0..63, rounded down so ``min <= `` the group's minimum) and
  its ``scale = top * 2**(-s / 8)`` (``s`` = 0..63, rounded up: at most 9% above the group's
  range / levels, and never below ``top / 235``). Every element still lies in the grid and decodes
  within ``scale / 2``; a group's range is widened by less than one ``step`` = the spread of its
  row's minimums / 63. Measured on SmolLM2's keys (1,024 pydoc tokens, relative RMS error of the
  attention logits ``q.k``, int8 / int4 / int2): fp16 parameters 0.0016 / 0.027 / 0.135, dq6
  0.0018 / 0.030 / 0.147; the 1-byte alternatives are worse: a symmetric grid with an fp8 or
  log-coded scale 0.004 / 0.065 / 0.39, a 1-byte scale with a 4-bit zero point (the range must
  then contain 0) 0.0022 / 0.037 / 0.17. Splitting the 12 bits 5+7, 7+5 or 4+8, or one header per
  layer instead of per head, is no better than 6+6 per head; a Hadamard rotation of head_dim with
  per-token groups (QuaRot style, no channel groups) has 4.6x dq6's attention KL at int4.

Inputs must be finite and inside fp16's range (|x| <= 65504); anything else is refused with
``ValueError`` (keep that block uncompressed).

**Bytes.** ``to_bytes`` lays out ``codes | pad to even | parameters`` in one flat uint8 tensor (fits
in pool memory or a file): fp16 ``scales | mins``, or dq6 ``headers (fp16) | 6-bit codes`` (four per
3 bytes, one run per row); int4 and int2 codes are packed 2 and 4 per byte, little end first. For
SmolLM2-135M (L=30, bs=16, Hkv=3, D=64; a bf16 block is 184,320 bytes, an fp32 block 368,640,
position metadata excluded), parameters included:

==========================  ========  ========  ========
block                         int8      int4      int2
==========================  ========  ========  ========
K, group 16 (tokens), dq6    0.550x    0.300x    0.175x   of bf16 (half these of fp32)
K, group 16, fp16            0.625x    0.375x    0.250x   of bf16
V, group 64 (head), fp16     0.531x    0.281x    0.156x   of bf16
V, group 32 (head), fp16     0.563x    0.313x    0.188x   of bf16
==========================  ========  ========  ========

(K dq6 exactly: 0.5498 / 0.2998 / 0.1748.) So keys (dq6) and values (group 64) both meet int8 <=
0.55x and int4 <= 0.3x of a bf16 block; keys with fp16 parameters cannot: 4 bytes of scale and min
per 16-token channel group is 0.25 bytes per element on top of the codes. Against an fp32 block
they do (0.31x / 0.19x), so ``arena.block_codecs`` keeps fp16 key parameters in an fp32 pool.

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
PARAM_FORMATS = ("fp16", "dq6")
DQ_CODES = 63  # 6-bit codes of a dq6 group's min and scale
DQ_SCALE_STEP = 1 / 8  # octaves between two dq6 scale codes
DQ_HEADER = 3  # fp16 (top, floor, step) per row of groups


@dataclass(frozen=True)
class CodecSpec:
    """How one block of ``shape`` is encoded: ``bits`` per code, groups of ``group`` along ``axis``,
    group parameters stored as ``params`` ("fp16" or "dq6", see the module docstring)."""

    shape: tuple[int, ...]
    bits: int
    axis: int
    group: int
    params: str = "fp16"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.params not in PARAM_FORMATS:
            raise ValueError(f"params must be one of {PARAM_FORMATS}, got {self.params!r}")
        if not self.shape or any(s <= 0 for s in self.shape):
            raise ValueError(f"block shape must be non-empty and positive, got {self.shape}")
        if not -len(self.shape) <= self.axis < len(self.shape):
            raise ValueError(f"axis {self.axis} is out of range for a block of shape {self.shape}")
        object.__setattr__(self, "axis", self.axis % len(self.shape))
        length = self.shape[self.axis]
        if self.group <= 0 or length % self.group:
            raise ValueError(f"group {self.group} must divide the axis length {length} (axis {self.axis})")
        if self.params == "dq6" and len(self.shape) < 2:
            raise ValueError("dq6 parameters need a block of at least 2 axes (rows of groups)")
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
    def rows_shape(self) -> tuple[int, ...]:
        """dq6: one header per row; a row is the last two axes of ``groups_shape``."""
        return self.groups_shape[:-2]

    @property
    def row_groups(self) -> int:
        return prod(self.groups_shape[-2:])

    @property
    def row_code_nbytes(self) -> int:
        """dq6: bytes of one row's 6-bit codes (two per group, four per 3 bytes)."""
        return 3 * -(-2 * self.row_groups // 4)

    @property
    def codes_nbytes(self) -> int:
        return prod(self.packed_shape)

    @property
    def params_nbytes(self) -> int:
        if self.params == "fp16":
            return 4 * self.num_groups
        return prod(self.rows_shape) * (2 * DQ_HEADER + self.row_code_nbytes)

    @property
    def nbytes(self) -> int:
        """Exact size of ``to_bytes``: codes, padding to an even offset, group parameters."""
        return _even(self.codes_nbytes) + self.params_nbytes


def key_spec(shape: tuple[int, ...], bits: int, group: int | None = None, params: str = "dq6") -> CodecSpec:
    """Keys of a ``[L, block_size, Hkv, D]`` block: per channel, grouped along tokens (default all)."""
    return CodecSpec(tuple(shape), bits, axis=1, group=group or shape[1], params=params)


def value_spec(shape: tuple[int, ...], bits: int, group: int | None = None) -> CodecSpec:
    """Values of a ``[L, block_size, Hkv, D]`` block: per token, grouped along head_dim (default D)."""
    return CodecSpec(tuple(shape), bits, axis=-1, group=group or shape[-1])


def encoded_nbytes(shape: tuple[int, ...], bits: int, axis: int, group: int, params: str = "fp16") -> int:
    """Bytes of one encoded block, group parameters included (``CodecSpec(...).nbytes``)."""
    return CodecSpec(tuple(shape), bits, axis, group, params).nbytes


def _even(n: int) -> int:
    return n + (n & 1)


# --------------------------------------------------------------------------- maths

Params = tuple[Tensor, Tensor]  # as stored: fp16 (scales, mins) or dq6 (headers, codes)


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


def _fp16_down(v: Tensor) -> Tensor:
    h = v.half()
    return torch.where(h.float() > v, torch.nextafter(h, torch.full_like(h, -torch.inf)), h)


def _fp16_up(v: Tensor) -> Tensor:
    h = v.half()
    return torch.where(h.float() < v, torch.nextafter(h, torch.full_like(h, torch.inf)), h)


def _fp16_params(lo: Tensor, hi: Tensor, levels: int) -> Params:
    """fp16 (scales, mins) with min <= lo and min + levels * scale >= hi for every group."""
    mins = _fp16_down(lo)
    return _fp16_up((hi - mins.float()) / levels), mins


def _dq_values(headers: Tensor, codes: Tensor) -> tuple[Tensor, Tensor]:
    """dq6 headers [*R, 3] fp16 and codes [*R, *row, 2] uint8 -> fp32 (scales, mins) [*R, *row]."""
    extra = codes.dim() - headers.dim()  # the row's axes
    top, floor, step = (headers[..., i].float().reshape(*headers.shape[:-1], *([1] * extra))
                        for i in range(DQ_HEADER))
    scales = top * torch.exp2(codes[..., 0].float() * -DQ_SCALE_STEP)
    return scales, floor + codes[..., 1].float() * step


def _dq_params(lo: Tensor, hi: Tensor, levels: int) -> Params:
    """dq6 (headers, codes) for groups [*R, a, b]: per row, mins rounded down onto ``floor + m *
    step`` and scales up onto ``top * 2**(-s / 8)``, so min <= lo and min + levels * scale >= hi."""
    flo, fhi = lo.flatten(-2), hi.flatten(-2)  # [*R, G]
    floor = _fp16_down(flo.amin(-1))
    step = _fp16_up((flo.amax(-1) - floor.float()) / DQ_CODES)
    f, st = floor.float()[..., None], step.float()[..., None]
    m = torch.floor((flo - f) / torch.where(st > 0, st, torch.ones_like(st))).clamp_(0, DQ_CODES)
    m = torch.where(f + m * st > flo, (m - 1).clamp_(min=0), m)  # fp32 rounding of floor + m * step
    need = (fhi - (f + m * st)) / levels
    top = _fp16_up(need.amax(-1))
    ratio = top.float()[..., None] / torch.where(need > 0, need, torch.ones_like(need))
    s = torch.where(need > 0, torch.floor(torch.log2(ratio) / DQ_SCALE_STEP), torch.full_like(need, DQ_CODES))
    s = s.clamp_(0, DQ_CODES)
    headers = torch.stack([top, floor, step], -1)
    codes = torch.stack([s, m], -1).to(torch.uint8)
    scales, mins = _dq_values(headers, codes)
    short = mins + scales * levels < fhi  # exp2 rounding at an exact power: one code coarser
    codes[..., 0] = torch.where(short, (s - 1).clamp_(min=0), s).to(torch.uint8)
    return headers, codes.reshape(*lo.shape, 2)


def group_values(params: Params, spec: CodecSpec) -> tuple[Tensor, Tensor]:
    """(scales, mins) [*B, *groups_shape] of stored parameters: fp16 as stored, dq6 decoded to fp32."""
    if spec.params == "fp16":
        return params
    headers, codes = params
    scales, mins = _dq_values(headers, codes.flatten(-3, -2))
    return scales.reshape(codes.shape[:-1]), mins.reshape(codes.shape[:-1])


def _quantize(x: Tensor, spec: CodecSpec) -> tuple[Tensor, Params]:
    g = _grouped(x, spec)
    lo, hi = g.amin(-1), g.amax(-1)
    magnitude = torch.maximum(-lo.amin(), hi.amax()).item()  # nan if any value is nan
    if not magnitude <= FP16_MAX:
        raise ValueError(f"cannot quantize a block holding inf, nan or |x| > {FP16_MAX} "
                         f"(fp16 group parameters); largest magnitude {magnitude}")
    params = (_fp16_params if spec.params == "fp16" else _dq_params)(lo, hi, spec.levels)
    scales, mins = group_values(params, spec)
    step = scales.float().unsqueeze(-1)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.round((g - mins.float().unsqueeze(-1)) / safe).clamp_(0, spec.levels)
    return codes.to(torch.uint8), params


def quantize(x: Tensor, spec: CodecSpec) -> tuple[Tensor, Tensor, Tensor]:
    """[*B, *shape] -> codes uint8 [*B, *groups_shape, group]; scales, mins [*B, *groups_shape]
    (fp16 for ``params="fp16"``, the exact fp32 values of the dq6 codes otherwise)."""
    codes, params = _quantize(x, spec)
    return (codes, *group_values(params, spec))


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
    shifts = torch.tensor([0, 6, 12, 18], dtype=torch.int32, device=packed.device)
    codes = (word.unsqueeze(-1) >> shifts) & DQ_CODES
    return codes.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.uint8)


# --------------------------------------------------------------------------- storage


@dataclass(frozen=True)
class EncodedBlock:
    """One encoded block: packed codes [*packed_shape] uint8 and the group parameters as stored
    (fp16: scales and mins [*groups_shape]; dq6: headers [*rows_shape, 3] fp16, codes
    [*groups_shape, 2] uint8)."""

    spec: CodecSpec
    codes: Tensor
    params: Params

    @property
    def scales(self) -> Tensor:
        return group_values(self.params, self.spec)[0]

    @property
    def mins(self) -> Tensor:
        return group_values(self.params, self.spec)[1]

    def to_bytes(self) -> Tensor:
        """One flat uint8 tensor of ``spec.nbytes`` (codes | pad | parameters)."""
        return _flatten(self.codes, self.params, self.spec, lead=())

    @classmethod
    def from_bytes(cls, buf: Tensor, spec: CodecSpec) -> EncodedBlock:
        """The block ``to_bytes`` wrote for the same ``spec`` (codes and fp16 parts are views of ``buf``)."""
        if buf.dim() != 1:
            raise ValueError(f"an encoded block is a flat uint8 tensor, got shape {tuple(buf.shape)}")
        codes, params = _sections(buf, spec)
        return cls(spec, codes, params)


def encode(x: Tensor, bits: int, axis: int, group: int, params: str = "fp16") -> EncodedBlock:
    """Encode one block ``x`` [*shape] (fp32/bf16/fp16) with groups of ``group`` along ``axis``."""
    spec = CodecSpec(tuple(x.shape), bits, axis, group, params)
    codes, stored = _quantize(x, spec)
    return EncodedBlock(spec, pack(codes, bits), stored)


def decode(block: EncodedBlock, dtype: torch.dtype = torch.float32) -> Tensor:
    """The block [*shape] in ``dtype`` (contiguous)."""
    spec = block.spec
    g = dequantize(unpack(block.codes, spec.bits), *group_values(block.params, spec), dtype)
    return _ungrouped(g, spec).contiguous()


def encode_rows(x: Tensor, spec: CodecSpec) -> Tensor:
    """Encode N stacked blocks at once: x [N, *shape] -> uint8 [N, spec.nbytes] (row i = block i)."""
    codes, params = _quantize(x, spec)
    lead = tuple(x.shape[: x.dim() - len(spec.shape)])
    return _flatten(pack(codes, spec.bits), params, spec, lead=lead)


def decode_rows(rows: Tensor, spec: CodecSpec, dtype: torch.dtype = torch.float32,
                layer: int | None = None) -> Tensor:
    """Decode N encodings at once: rows [N, nbytes] -> [N, *shape], or [N, *shape[1:]] for one layer.

    ``rows`` may be gathered from pool memory (``buf[block_ids]``); only ``layer``'s codes and
    parameters are dequantized when it is given (``axis`` must not be 0 then).
    """
    if rows.dim() != 2:
        raise ValueError(f"rows must be [N, nbytes], got shape {tuple(rows.shape)}")
    codes, params = _sections(rows, spec)
    if layer is not None:
        if spec.axis == 0:
            raise ValueError("per-layer decode needs the groups off axis 0 (the layer axis)")
        if not 0 <= layer < spec.shape[0]:
            raise ValueError(f"layer {layer} out of range for {spec.shape[0]} layers")
        if spec.params == "dq6" and not spec.rows_shape:
            raise ValueError("per-layer decode of dq6 needs the layer axis among the header rows")
        codes = codes[:, layer]
        params = (params[0][:, layer], params[1][:, layer])  # headers are per layer (axis != 0)
    scales, mins = group_values(params, spec)
    g = dequantize(unpack(codes, spec.bits), scales, mins, dtype)
    return _ungrouped(g, spec, layer).contiguous()


def _flatten(codes: Tensor, params: Params, spec: CodecSpec, lead: tuple[int, ...]) -> Tensor:
    parts = [codes.reshape(*lead, -1)]
    if spec.codes_nbytes & 1:
        parts.append(torch.zeros(*lead, 1, dtype=torch.uint8, device=codes.device))
    first, second = params
    parts.append(first.contiguous().reshape(*lead, -1).view(torch.uint8))
    if spec.params == "fp16":
        parts.append(second.contiguous().reshape(*lead, -1).view(torch.uint8))
    else:  # one run of 6-bit codes per row
        rows = second.reshape(*lead, *spec.rows_shape, 2 * spec.row_groups)
        parts.append(pack6(rows).reshape(*lead, -1))
    return torch.cat(parts, dim=-1)


def _sections(buf: Tensor, spec: CodecSpec) -> tuple[Tensor, Params]:
    """Codes and stored parameters in buf [*B, nbytes]; B is () or (N,)."""
    if buf.dtype != torch.uint8 or buf.shape[-1] != spec.nbytes:
        raise ValueError(f"expected uint8 encodings of {spec.nbytes} bytes for {spec}, "
                         f"got {buf.dtype} with last dimension {buf.shape[-1] if buf.dim() else None}")
    if buf.stride(-1) != 1:
        buf = buf.contiguous()
    lead = tuple(buf.shape[:-1])
    start = _even(spec.codes_nbytes)
    codes = buf[..., : spec.codes_nbytes].reshape(*lead, *spec.packed_shape)
    if spec.params == "fp16":
        end = start + 2 * spec.num_groups
        scales = _fp16_view(buf[..., start:end]).reshape(*lead, *spec.groups_shape)
        mins = _fp16_view(buf[..., end:]).reshape(*lead, *spec.groups_shape)
        return codes, (scales, mins)
    end = start + 2 * DQ_HEADER * prod(spec.rows_shape)
    headers = _fp16_view(buf[..., start:end]).reshape(*lead, *spec.rows_shape, DQ_HEADER)
    packed = buf[..., end:].reshape(*lead, *spec.rows_shape, spec.row_code_nbytes)
    group_codes = unpack6(packed, 2 * spec.row_groups).reshape(*lead, *spec.groups_shape, 2)
    return codes, (headers, group_codes)


def _fp16_view(section: Tensor) -> Tensor:
    """Reinterpret uint8 bytes as fp16 without a copy when aligned (copy otherwise)."""
    try:
        return section.view(torch.float16)
    except RuntimeError:
        return section.contiguous().view(torch.float16)
