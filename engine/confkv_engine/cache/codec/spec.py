"""The shape of one encoded KV block (``CodecSpec``): bits, groups, parameter format and exact bytes.

The codec (``codec.blocks``) encodes a block with the group-wise maths of ``codec.group_quant`` and
lays it out as described here; a spec is plain data, validated once when it is built, so a bad
bits / group / axis choice is a ``ValueError`` naming it before any tensor is touched.

**Bytes.** ``codec.blocks`` lays a block out as ``codes | pad to even | parameters`` in one flat
uint8 tensor (fits in pool memory or a file): fp16 ``scales | mins``, or dq6 ``headers (fp16) |
6-bit codes`` (four per 3 bytes, one run per row); int4 and int2 codes are packed 2 and 4 per
byte, little end first. For SmolLM2-135M (L=30, bs=16, Hkv=3, D=64; a bf16 block is 184,320
bytes, an fp32 block 368,640, position metadata excluded), parameters included:

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
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import prod

SUPPORTED_BITS = (2, 4, 8)
PARAM_FORMATS = ("fp16", "dq6")
SHRINK_STEP = 0.05  # between two range fractions the fit tries (``group_quant._fitted_params``)
# The smallest fraction of a group's [min, max] the range fit tries (1: min/max). Keys stop at 0.8: a
# key's extreme channel values make its largest logits, and clipping down to 0.6 cut the keys' MSE
# (0.028 -> 0.016 at int2) but raised the attention distributions' KL (0.127 -> 0.145, SmolLM2,
# 1,024 tuning tokens; 0.8: 0.123); values, averaged by attention, take 0.6 (attention output error
# 0.48 -> 0.39 of its RMS at int2). Only int2 is fitted (``FIT_MAX_BITS``): at int4 the fit cut the
# MSE by 8-18% but raised KIVI-int4's perplexity on the tuning prose (+0.58% -> +0.75%), while at int2
# it more than halved KIVI-int2's (+22.3% -> +9.2%; repeating text +39.9% -> +23.2%). Measured:
# docs/notes/retention-journal.md, "A range fit for int2".
KEY_SHRINK = 0.8
VALUE_SHRINK = 0.6
FIT_MAX_BITS = 2
DQ_CODES = 63  # 6-bit codes of a dq6 group's min and scale
DQ_SCALE_STEP = 1 / 8  # octaves between two dq6 scale codes
DQ_HEADER = 3  # fp16 (top, floor, step) per row of groups


@dataclass(frozen=True)
class CodecSpec:
    """How one block of ``shape`` is encoded: ``bits`` per code, groups of ``group`` along ``axis``,
    group parameters stored as ``params`` ("fp16" or "dq6", see the module docstring), each group's
    range, at int2, the one of least decoded squared error among [min, max] shrunk around its
    midpoint to 1, 0.95, ... down to ``shrink`` (1: min/max, every element inside; decoders never
    read it, the stored format is the same). The derived
    sizes are computed once per spec (the cache asks for a block's bytes many times a step)."""

    shape: tuple[int, ...]
    bits: int
    axis: int
    group: int
    params: str = "fp16"
    shrink: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.params not in PARAM_FORMATS:
            raise ValueError(f"params must be one of {PARAM_FORMATS}, got {self.params!r}")
        if not 0 < self.shrink <= 1:
            raise ValueError(f"shrink must be in (0, 1], got {self.shrink}")
        if self.bits > FIT_MAX_BITS:  # not fitted: equal to the min/max spec (one arena, one codec)
            object.__setattr__(self, "shrink", 1.0)
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

    @cached_property
    def shrink_factors(self) -> tuple[float, ...]:
        """The range fractions the fit tries, min/max first (above ``FIT_MAX_BITS``: only min/max)."""
        if self.bits > FIT_MAX_BITS:
            return (1.0,)
        return tuple(1 - SHRINK_STEP * i for i in range(int((1 - self.shrink) / SHRINK_STEP + 1e-6) + 1))

    @cached_property
    def per_byte(self) -> int:
        return 8 // self.bits

    @cached_property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @cached_property
    def groups_shape(self) -> tuple[int, ...]:
        """Shape of scales and mins: the block's other axes in order, then the groups of ``axis``."""
        others = tuple(s for i, s in enumerate(self.shape) if i != self.axis)
        return (*others, self.shape[self.axis] // self.group)

    @cached_property
    def packed_shape(self) -> tuple[int, ...]:
        """Shape of the packed codes: ``groups_shape`` then ``group / per_byte`` bytes."""
        return (*self.groups_shape, self.group // self.per_byte)

    @cached_property
    def num_groups(self) -> int:
        return prod(self.groups_shape)

    @cached_property
    def rows_shape(self) -> tuple[int, ...]:
        """dq6: one header per row; a row is the last two axes of ``groups_shape``."""
        return self.groups_shape[:-2]

    @cached_property
    def row_groups(self) -> int:
        return prod(self.groups_shape[-2:])

    @cached_property
    def row_code_nbytes(self) -> int:
        """dq6: bytes of one row's 6-bit codes (two per group, four per 3 bytes)."""
        return 3 * -(-2 * self.row_groups // 4)

    @cached_property
    def codes_nbytes(self) -> int:
        return prod(self.packed_shape)

    @cached_property
    def params_nbytes(self) -> int:
        if self.params == "fp16":
            return 4 * self.num_groups
        return prod(self.rows_shape) * (2 * DQ_HEADER + self.row_code_nbytes)

    @cached_property
    def params_offset(self) -> int:
        """Where the group parameters start: after the codes, at an even offset (fp16 alignment)."""
        return self.codes_nbytes + (self.codes_nbytes & 1)

    @cached_property
    def nbytes(self) -> int:
        """Exact size of ``to_bytes``: codes, padding to an even offset, group parameters."""
        return self.params_offset + self.params_nbytes


def key_spec(shape: tuple[int, ...], bits: int, group: int | None = None, params: str = "dq6",
             shrink: float = 1.0) -> CodecSpec:
    """Keys of a ``[L, block_size, Hkv, D]`` block: per channel, grouped along tokens (default all)."""
    return CodecSpec(tuple(shape), bits, axis=1, group=group or shape[1], params=params, shrink=shrink)


def value_spec(shape: tuple[int, ...], bits: int, group: int | None = None,
               shrink: float = 1.0) -> CodecSpec:
    """Values of a ``[L, block_size, Hkv, D]`` block: per token, grouped along head_dim (default D)."""
    return CodecSpec(tuple(shape), bits, axis=-1, group=group or shape[-1], shrink=shrink)


def encoded_nbytes(shape: tuple[int, ...], bits: int, axis: int, group: int, params: str = "fp16") -> int:
    """Bytes of one encoded block, group parameters included (``CodecSpec(...).nbytes``)."""
    return CodecSpec(tuple(shape), bits, axis, group, params).nbytes

