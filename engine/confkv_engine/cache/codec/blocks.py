"""The KV block codec (int8 / int4 / int2): blocks encoded to and decoded from flat bytes.

One codec serves both background compression of cold blocks and the retention tiers' low-precision
form; nothing in it owns memory. The maths is kept apart from the storage layout, gpt-fast style:
``codec.spec`` says what a block's encoding is (``CodecSpec``: bits, groups, parameter format,
exact bytes, with the table of sizes), ``codec.group_quant`` computes it (groups, keys per channel
and values per token as KIVI, fp16 and dq6 group parameters and what they were measured to cost) and
``codec.bitpack`` packs codes into bytes. This module lays a block out as ``codes | pad to even |
parameters`` (``to_bytes`` / ``from_bytes``, ``encode_rows`` / ``decode_rows``) and reads it back,
as views of the buffer where it can.

Decoding many blocks at once (``decode_rows`` on ``[N, nbytes]``, optionally one layer) is one
vectorised unpack-multiply-add over all of them, no Python loop per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from torch import Tensor

from confkv_engine.cache.codec import native
from confkv_engine.cache.codec.bitpack import pack, pack6, unpack, unpack6
from confkv_engine.cache.codec.group_quant import (
    Params,
    Runs,
    dequantize_blocks,
    group_values,
    quantize_stored,
)
from confkv_engine.cache.codec.spec import DQ_HEADER, CodecSpec


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


def encode(x: Tensor, bits: int, axis: int, group: int, params: str = "fp16",
           shrink: float = 1.0) -> EncodedBlock:
    """Encode one block ``x`` [*shape] (fp32/bf16/fp16) with groups of ``group`` along ``axis``."""
    spec = CodecSpec(tuple(x.shape), bits, axis, group, params, shrink)
    codes, stored = quantize_stored(x, spec)
    return EncodedBlock(spec, pack(codes, bits), stored)


def decode(block: EncodedBlock, dtype: torch.dtype = torch.float32) -> Tensor:
    """The block [*shape] in ``dtype`` (contiguous)."""
    spec = block.spec
    scales, mins = group_values(block.params, spec)
    return dequantize_blocks(unpack(block.codes, spec.bits), scales, mins, spec, dtype=dtype)


def encode_rows(x: Tensor, spec: CodecSpec) -> Tensor:
    """Encode N stacked blocks at once: x [N, *shape] -> uint8 [N, spec.nbytes] (row i = block i)."""
    codes, params = quantize_stored(x, spec)
    lead = tuple(x.shape[: x.dim() - len(spec.shape)])
    return _flatten(pack(codes, spec.bits), params, spec, lead=lead)


def decode_rows(rows: Tensor, spec: CodecSpec, dtype: torch.dtype = torch.float32,
                layer: int | None = None, out: Tensor | None = None,
                runs: Runs | None = None) -> Tensor:
    """Decode N encodings at once: rows [N, nbytes] -> [N, *shape], or [N, *shape[1:]] for one layer.

    ``rows`` may be gathered from pool memory (``buf[block_ids]``); only ``layer``'s codes and
    parameters are dequantized when it is given (``axis`` must not be 0 then). ``out`` (contiguous,
    of that shape and ``dtype``, or of any number of rows with ``runs``) receives the result instead
    of a new tensor; ``runs`` = ``(out row, decoded row, rows)`` places the decoded rows in runs.
    """
    if rows.dim() != 2:
        raise ValueError(f"rows must be [N, nbytes], got shape {tuple(rows.shape)}")
    codes, params = _sections(rows, spec)
    if layer is None and native.covers(spec, dtype, rows.device):
        target = out if out is not None else torch.empty((rows.shape[0], *spec.shape), dtype=dtype,
                                                         device=rows.device)
        if target.dtype == dtype and native.decode_into(rows, spec, *group_values(params, spec), target,
                                                        _destinations(runs, rows.shape[0], rows.device)):
            return target
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
    return dequantize_blocks(unpack(codes, spec.bits), scales, mins, spec, layer, dtype, out, runs)


def decode_keys_transposed(rows: Tensor, spec: CodecSpec, out: Tensor, dst: Tensor) -> bool:
    """Key blocks ``rows`` [N, nbytes] decoded channel-major into ``out`` [R, Hkv * D, bs * C] fp32
    (``native.decode_keys_transposed``: ``dst[i] = layer * C + table row``); False when the library
    does not cover it (the caller decodes token-major and transposes)."""
    if not native.covers(spec, torch.float32, rows.device) or spec.axis != 0:
        return False
    codes, params = _sections(rows, spec)
    return native.decode_keys_transposed(rows, spec, *group_values(params, spec), out, dst)


def _destinations(runs: Runs | None, n: int, device: torch.device) -> Tensor:
    """Output row of each of ``n`` decoded rows under ``runs`` (-1: a row no run places)."""
    if runs is None:
        return torch.arange(n, device=device)
    dst = torch.full((n,), -1, dtype=torch.long, device=device)
    for first, src, count in runs:
        dst[src:src + count] = torch.arange(first, first + count, device=device)
    return dst


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
    start = spec.params_offset
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
