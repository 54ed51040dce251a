"""Group-wise asymmetric quantization of KV blocks (int8 / int4 / int2): the maths, pure tensor
functions (what is computed is a ``codec.spec.CodecSpec``; its byte layout is ``codec.blocks``'s).

**Groups.** A block ``x`` (one K or V block: ``[L, block_size, Hkv, D]``) is cut along one axis into
groups of ``group`` consecutive elements; each group has a ``min`` and a ``scale`` (about ``(max -
min) / (2**bits - 1)``) and every element the code ``round((x - min) / scale)``. Asymmetric (scale
and minimum) because post-RoPE keys and values are not centred on zero per group (see dq6 below
for what the alternatives cost).

**Range fit.** ``min`` and ``scale`` cover the group's [min, max] (``CodecSpec.shrink`` 1), or, for
int2 in the cache's codecs, the range among [min, max] shrunk around its midpoint (down to 0.8 for
keys, 0.6 for values) whose group decodes with the least squared error; the elements outside clamp
to its ends (``_fitted_params``). The stored format is the same, decoders do not know.

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
"""

from __future__ import annotations

import torch
from torch import Tensor

from confkv_engine.cache.codec.spec import DQ_CODES, DQ_HEADER, DQ_SCALE_STEP, CodecSpec

FP16_MAX = 65504.0

Params = tuple[Tensor, Tensor]  # as stored: fp16 (scales, mins) or dq6 (headers, codes)
Runs = tuple[tuple[int, int, int], ...]  # (first output row, first decoded row, rows) per run


def _grouped(x: Tensor, spec: CodecSpec) -> Tensor:
    """[*B, *shape] -> [*B, *groups_shape, group] (float32), ``axis`` moved last and split."""
    lead = x.dim() - len(spec.shape)
    if lead < 0 or tuple(x.shape[lead:]) != spec.shape:
        raise ValueError(f"expected a tensor ending in shape {spec.shape}, got {tuple(x.shape)}")
    moved = x.float().movedim(lead + spec.axis, -1)
    return moved.reshape(*moved.shape[:-1], spec.shape[spec.axis] // spec.group, spec.group)


def ungroup(g: Tensor, spec: CodecSpec, layer: int | None = None) -> Tensor:
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


def _dq_header(flo: Tensor, fhi: Tensor, levels: int) -> tuple[Tensor, Tensor, Tensor]:
    """dq6 row headers fp16 (top, floor, step) [*R] for the groups' ranges [*R, G]: the minimums'
    grid spans the row's minimums, ``top`` the widest scale any group needs on it."""
    floor = _fp16_down(flo.amin(-1))
    step = _fp16_up((flo.amax(-1) - floor.float()) / DQ_CODES)
    return _fp16_up(((fhi - _dq_min(floor, step, flo)) / levels).amax(-1)), floor, step


def _dq_min(floor: Tensor, step: Tensor, flo: Tensor) -> Tensor:
    """The grid's min code of every group [..., G] (``floor + m * step <= flo``), as fp32 values."""
    f, st = floor.float()[..., None], step.float()[..., None]
    m = torch.floor((flo - f) / torch.where(st > 0, st, torch.ones_like(st))).clamp_(0, DQ_CODES)
    m = torch.where(f + m * st > flo, (m - 1).clamp_(min=0), m)  # fp32 rounding of floor + m * step
    return f + m * st


def _dq_codes(header: tuple[Tensor, Tensor, Tensor], flo: Tensor, fhi: Tensor, levels: int) -> Params:
    """dq6 (headers [..., 3], codes [..., G, 2]) on a row's header: mins rounded down onto ``floor + m
    * step`` and scales up onto ``top * 2**(-s / 8)``, so min <= flo and min + levels * scale >= fhi
    wherever the header allows (always for the ranges it was made from)."""
    top, floor, step = (h.expand(flo.shape[:-1]) for h in header)
    mins = _dq_min(floor, step, flo)
    st = step.float()[..., None]
    m = torch.round((mins - floor.float()[..., None]) / torch.where(st > 0, st, torch.ones_like(st)))
    need = (fhi - mins) / levels
    ratio = top.float()[..., None] / torch.where(need > 0, need, torch.ones_like(need))
    s = torch.where(need > 0, torch.floor(torch.log2(ratio) / DQ_SCALE_STEP), torch.full_like(need, DQ_CODES))
    s = s.clamp_(0, DQ_CODES)
    headers = torch.stack([top, floor, step], -1)
    codes = torch.stack([s, m], -1).to(torch.uint8)
    scales, mins = _dq_values(headers, codes)
    short = mins + scales * levels < fhi  # exp2 rounding at an exact power: one code coarser
    codes[..., 0] = torch.where(short, (s - 1).clamp_(min=0), s).to(torch.uint8)
    return headers, codes


def _dq_params(lo: Tensor, hi: Tensor, levels: int) -> Params:
    """dq6 (headers, codes) for groups [*R, a, b] covering [lo, hi] (``_dq_header``, ``_dq_codes``)."""
    flo, fhi = lo.flatten(-2), hi.flatten(-2)  # [*R, G]
    headers, codes = _dq_codes(_dq_header(flo, fhi, levels), flo, fhi, levels)
    return headers, codes.reshape(*lo.shape, 2)


def _sq_error(g: Tensor, scales: Tensor, mins: Tensor, levels: int) -> Tensor:
    """Squared error of every group [*groups] decoded with fp32 ``scales`` and ``mins`` [*groups]."""
    step, low = scales.unsqueeze(-1), mins.unsqueeze(-1)
    codes = torch.round((g - low) / torch.where(step > 0, step, torch.ones_like(step))).clamp_(0, levels)
    return torch.addcmul(low, codes, step).sub_(g).square_().sum(-1)


def _fitted_params(g: Tensor, lo: Tensor, hi: Tensor, spec: CodecSpec) -> Params:
    """The stored parameters of groups ``g`` [*groups, group]: per group, the range among
    ``spec.shrink_factors`` x [lo, hi] (around the midpoint) whose decoded group has the least
    squared error, as the parameters are stored (fp16, or dq6 codes on the min/max header: the
    header is the row's, shared by all candidates). Min/max is the first candidate and ties keep it,
    so no group decodes worse than with min/max; elements outside the chosen range clamp to its ends.

    Measured on SmolLM2's K/V (``bench.micro.codec_fit``: 1,024 pydoc tuning tokens, bf16, relative
    MSE of the decoded blocks, keys dq6 per channel, values fp16 per token), int2: keys 0.028 -> 0.018
    (shrink 0.8), values 0.238 -> 0.130 (0.6), logits q.k 0.148 -> 0.118 relative RMS. A 6 x 6 grid
    clipping each end on its own won a little more MSE at 4x the cost, Lloyd-style refits of (scale,
    min) less. Which bits are fitted and how far: ``codec.spec`` (``FIT_MAX_BITS``, ``KEY_SHRINK``)."""
    levels = spec.levels
    header = None if spec.params == "fp16" else _dq_header(lo.flatten(-2), hi.flatten(-2), levels)

    def stored(lo_c: Tensor, hi_c: Tensor) -> Params:  # the parameters covering [lo_c, hi_c], as stored
        if header is None:
            return _fp16_params(lo_c, hi_c, levels)
        headers, codes = _dq_codes(header, lo_c.flatten(-2), hi_c.flatten(-2), levels)
        return headers, codes.reshape(*lo.shape, 2)

    plain = stored(lo, hi)
    if len(spec.shrink_factors) == 1:
        return plain
    best, best_err = plain, _sq_error(g, *(v.float() for v in group_values(plain, spec)), levels)
    mid = (lo + hi) / 2
    for a in spec.shrink_factors[1:]:
        cand = stored(mid - a * (mid - lo), mid + a * (hi - mid))
        err = _sq_error(g, *(v.float() for v in group_values(cand, spec)), levels)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        if spec.params == "fp16":
            best = (torch.where(better, cand[0], best[0]), torch.where(better, cand[1], best[1]))
        else:
            best = (best[0], torch.where(better[..., None], cand[1], best[1]))
    return best


def group_values(params: Params, spec: CodecSpec) -> tuple[Tensor, Tensor]:
    """(scales, mins) [*B, *groups_shape] of stored parameters: fp16 as stored, dq6 decoded to fp32."""
    if spec.params == "fp16":
        return params
    headers, codes = params
    scales, mins = _dq_values(headers, codes.flatten(-3, -2))
    return scales.reshape(codes.shape[:-1]), mins.reshape(codes.shape[:-1])


def quantize_stored(x: Tensor, spec: CodecSpec) -> tuple[Tensor, Params]:
    """[*B, *shape] -> codes uint8 [*B, *groups_shape, group] and the group parameters as stored."""
    g = _grouped(x, spec)
    lo, hi = g.amin(-1), g.amax(-1)
    magnitude = torch.maximum(-lo.amin(), hi.amax()).item()  # nan if any value is nan
    if not magnitude <= FP16_MAX:
        raise ValueError(f"cannot quantize a block holding inf, nan or |x| > {FP16_MAX} "
                         f"(fp16 group parameters); largest magnitude {magnitude}")
    params = _fitted_params(g, lo, hi, spec)
    scales, mins = group_values(params, spec)
    step = scales.float().unsqueeze(-1)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.round((g - mins.float().unsqueeze(-1)) / safe).clamp_(0, spec.levels)
    return codes.to(torch.uint8), params


def quantize(x: Tensor, spec: CodecSpec) -> tuple[Tensor, Tensor, Tensor]:
    """[*B, *shape] -> codes uint8 [*B, *groups_shape, group]; scales, mins [*B, *groups_shape]
    (fp16 for ``params="fp16"``, the exact fp32 values of the dq6 codes otherwise)."""
    codes, params = quantize_stored(x, spec)
    return (codes, *group_values(params, spec))


def dequantize(codes: Tensor, scales: Tensor, mins: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes [..., group] * scales[..., None] + mins[..., None], computed in fp32, cast to ``dtype``."""
    x = codes.float() * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)
    return x.to(dtype)


def dequantize_blocks(codes: Tensor, scales: Tensor, mins: Tensor, spec: CodecSpec,
                      layer: int | None = None, dtype: torch.dtype = torch.float32,
                      out: Tensor | None = None, runs: Runs | None = None) -> Tensor:
    """``ungroup(dequantize(codes, scales, mins, dtype), spec, layer).contiguous()`` written once, in
    the block layout: codes [*B, *groups_shape, group] -> [*B, *shape]; into ``out`` when given,
    ``runs`` = ``(out row, decoded row, rows)`` along the first axis (default: all rows at 0).

    With one group along ``axis`` (the codec's key and value defaults) the scales and minimums are
    broadcast views of the block layout, so one fused multiply-add (``addcmul``, computed in fp32)
    writes the result where ``dequantize`` took a multiply, an add and, for keys, the transposing
    copy of ``ungroup``: three passes over the block saved, and a fourth (the copy into a gathered
    table) when it writes into ``out``. The fused form rounds once, so it may differ from
    ``dequantize`` in the last bit; every reader of the codec decodes through here.
    """
    if spec.shape[spec.axis] == spec.group and dtype == torch.float32:
        # uint8 codes moved into the block layout first (a quarter of the bytes of moving floats),
        # so the fused multiply-add reads them in order.
        c = ungroup(codes, spec, layer).to(torch.float32, memory_format=torch.contiguous_format)
        s = ungroup(scales.float().unsqueeze(-1), spec, layer)
        m = ungroup(mins.float().unsqueeze(-1), spec, layer)
        if runs is None:
            return torch.addcmul(m, c, s, out=torch.empty(c.shape, device=c.device) if out is None else out)
        for dst, src, n in runs:
            torch.addcmul(m[src:src + n], c[src:src + n], s[src:src + n], out=out[dst:dst + n])
        return out
    if spec.shape[spec.axis] == spec.group:  # another dtype: computed in fp32, then cast
        x = dequantize_blocks(codes, scales, mins, spec, layer).to(dtype)
    else:  # several groups along the axis: no broadcast view
        x = ungroup(dequantize(codes, scales, mins, dtype), spec, layer).contiguous()
    if out is None:
        return x
    for dst, src, n in runs or ((0, 0, x.shape[0]),):
        out[dst:dst + n].copy_(x[src:src + n])
    return out
