"""Paged attention backend: writes a step's k/v into the sequences' slots and attends over them.

``begin_step`` builds everything that depends only on the batch (write indices, gather plans,
masks: ``attention.plans``) once per step; ``attend`` (called once per layer) is then a handful of
tensor ops. The step's tokens are the sequences' new tokens flattened in the order given.

- Decode rows (sequences with one new token) are batched: their blocks are gathered, K and V in
  one ``index_select``, into ``[B, S, Hkv, D]`` (S = longest table x block size) and one
  ``scaled_dot_product_attention`` call runs with an additive mask hiding each row's unused slots.
  Query heads are grouped by KV head (``[B, Hkv, G, D]``), so GQA never repeats K or V. With a
  ``max_gather_bytes`` bound (the memory planner's), consecutive decode rows are split into groups
  whose padded gather stays within it (one long row beside short ones no longer pads every short
  one to the long width), one gather and one kernel call per group; one row is never split.
- **Prefill chunks (CPU)** attend their own new keys with the causal kernel (no mask, the upper
  triangle skipped) and, when the sequence has cached slots, those without any mask; the two parts
  are combined exactly through their log-sum-exp (``partial``). Other devices keep one call per
  chunk over the gathered context with a causal mask in slot space (query t sees the slots below
  ``slots_before + t + 1``). Positions never enter a mask: RoPE was applied before caching.
- Compressed blocks (negative table entries) are dequantized on read: ``begin_step`` turns each
  table into a ``GatherPlan`` (pool ids with compressed entries pointing at the null block, plus
  per arena the rows and byte addresses to decode), and per layer the gather is one index_select
  followed by one batched decode per arena that overwrites those rows. By default (CPU, the
  native codec library; ``from_codes=False`` or ``CONFKV_CODES_ATTENTION=0`` turns it off) decode
  rows, and the cached part of a prefill chunk (its queries folded into the head axis), instead
  attend them straight from their codes (``attention.codes``): the gathered table holds the pool
  entries alone, compacted, the flash kernel returns their log-sum-exp and the library folds the
  compressed blocks into it.
- No upcast: the CPU flash-attention kernel accumulates bf16 / fp16 inputs in fp32 (as CUDA's
  kernels do), so q, K and V go in as they are stored. Masks are additive (0 / -inf) in the query's
  dtype; boolean 4D masks are avoided (they silently give wrong results in eager attention).
- Sliding-window layers (``attend(..., window=W)``) see only the last W slots up to each query:
  decode rows through a second mask that also hides the slots before the window, prefill chunks
  through one masked call over the gathered context. Slots stand for positions while none has been
  discarded; once retention frees slots, a window of W slots reaches further back than W positions.
  The blocks before every window stay allocated when all layers share one table; a model mixing
  global and window layers keeps the window layers in groups of their own (``cache.groups``), read
  through ``window_groups.WindowStep``, and ``attend`` maps each model layer to its pool layer.
- Not done, measured: attending runs of a table that are consecutive in the pool straight from
  the pool (a view, no copy), combined with the gathered rest by log-sum-exp. With the tables
  chunked prefill produces (runs of one chunk) the extra kernel calls and the combine cost more
  than the copy they save, at 1, 8 and 32 sequences of 2,048 tokens (docs/performance.md).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from confkv_engine.attention import codes, partial
from confkv_engine.attention.kernels import PagedBatch, PagedKernel, kernel_for, native_decode
from confkv_engine.attention.plans import DecodePlan, Mask, PrefillPlan
from confkv_engine.attention.window_groups import WindowStep
from confkv_engine.cache.arena import GatherPlan
from confkv_engine.cache.block_pool import is_compressed
from confkv_engine.cache.kv_cache import CacheSpec, KVCache, SeqKV, WritePlan
from confkv_engine.cache.layout import as_stored


class PagedAttention:
    """``AttentionBackend`` over a ``KVCache``. Use: begin_step -> model.forward -> end_step."""

    def __init__(self, cache: KVCache, num_q_heads: int, max_gather_bytes: int | None = None,
                 in_place: bool | None = None, from_codes: bool | None = None,
                 native: bool | None = None) -> None:
        """``max_gather_bytes``: one decode gather's bytes at most (None: unbounded). ``in_place``:
        attend through the block tables with a paged kernel (``attention.kernels``) instead of
        gathering (None: off until a GPU run has checked the compiled kernel). The gathering path
        stays the reference the kernels are tested against. ``from_codes``: decode rows attend their
        compressed blocks from the codes (``attention.codes``, where the native library is; None: on
        unless ``CONFKV_CODES_ATTENTION=0``). ``native``: decode-only steps read the pool in place
        with the native kernel (``kernels.native_decode``; None: where the library is, unless
        ``CONFKV_NATIVE_DECODE=0``; False: the gathering path always)."""
        self.cache = cache
        self.max_gather_bytes = max_gather_bytes  # one decode gather's bytes at most (None: unbounded)
        spec = cache.spec
        if num_q_heads % spec.num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads is not a multiple of {spec.num_kv_heads} KV heads")
        self.group = num_q_heads // spec.num_kv_heads
        self.split = partial.available(spec.device)  # part kernels with log-sum-exp exist here
        self._seqs: list[SeqKV] = []
        self._num_new: list[int] = []
        # Opt-in everywhere until the compiled Triton kernel has run on a GPU (it is checked under
        # TRITON_INTERPRET=1 only); on CPU the gather measured faster (docs/performance.md).
        wanted = bool(in_place)
        self.kernel: PagedKernel | None = (kernel_for(spec.device, spec.dtype, spec.block_size, spec.head_dim)
                                           if wanted else None)
        self.paged: PagedBatch | None = None
        self._side: GatherPlan | None = None
        # On by default: measured faster than decode-then-attend in the engine step (docs/performance.md).
        self.from_codes = codes.wanted(from_codes) and codes.available(cache)
        self._codes_memo = codes.SplitMemo()  # decode rows' splits, reused across steps
        # Decode-only steps read the pool in place with the native kernel where it can.
        self.native_ok = (native is not False and native_decode.available() and native_decode.reads(cache.kv)
                          and spec.dtype == spec.compute_dtype and cache.scale is None)
        self.native: native_decode.DecodeTables | None = None

    # ---- per-step metadata -------------------------------------------------------------------
    def begin_step(self, seqs: list[SeqKV], num_new: list[int], positions: Tensor) -> None:
        """Slots for ``num_new[i]`` tokens must already be reserved; ``positions`` [T] absolute."""
        self._seqs, self._num_new = seqs, num_new
        self._codes_memo.next_step()
        self.writes: WritePlan = self.cache.plan_writes(seqs, num_new, positions)
        offsets = [0]
        for n in num_new:
            offsets.append(offsets[-1] + n)
        dec = [i for i, n in enumerate(num_new) if n == 1]
        self.num_decode = len(dec)
        self.decode_index = dec
        dec_rows = [offsets[i] for i in dec]
        # The engine puts decode rows first; otherwise fall back to an index.
        self.decode_rows: slice | Tensor = (
            slice(0, len(dec)) if dec_rows == list(range(len(dec))) else self.cache.staging.send(dec_rows))
        self.offsets = offsets
        spec = self.cache.spec
        decode_only = len(dec) == len(seqs)
        self._window = (None if spec.layer_groups is None else
                        WindowStep(self.cache, seqs, num_new, self.group, offsets, spec.compute_dtype,
                                   native=self.native_ok and decode_only and self.kernel is None))
        if self.kernel is not None:
            self.decode, self.prefills = [], []
            self._begin_paged(seqs, num_new)
            return
        self.native = self._native_tables(seqs) if decode_only else None
        if self.native is not None:  # every layer reads the pool in place: no gather plan, no mask
            self.decode, self.prefills = [], []
            return
        self.decode: list[DecodePlan] = self._build_decode([seqs[i] for i in dec]) if dec else []
        self.prefills: list[PrefillPlan] = [
            self._build_prefill(i, seqs[i], n, slice(offsets[i], offsets[i + 1]))
            for i, n in enumerate(num_new) if n > 1]

    def _native_tables(self, seqs: list[SeqKV]) -> native_decode.DecodeTables | None:
        """A decode-only step's tables for the native kernel (``native_decode``), or None where it
        does not apply: no library, a pool it does not read (int8 / fp8, or stored in another dtype
        than the compute one), a compressed block, or values stood in for."""
        cache = self.cache
        if not (self.native_ok and self._plain_values()):
            return None
        # Handles are negative (``block_pool.is_compressed``); min() keeps the scan in C.
        if any(s.k_blocks and is_compressed(min(min(s.k_blocks), min(s.v_blocks))) for s in seqs):
            return None
        return native_decode.DecodeTables.build([s.k_blocks for s in seqs], [s.v_blocks for s in seqs],
                                                [s.num_slots + 1 for s in seqs], cache.null_block)

    def _plain_values(self) -> bool:
        """Whether this step's values are the pool's as they are (a subclass that stands values in,
        or records queries, says no when it does)."""
        return True

    def _build_decode(self, seqs: list[SeqKV]) -> list[DecodePlan]:
        return [self._decode_group(seqs[rows], rows) for rows in self._decode_groups(seqs)]

    def _decode_groups(self, seqs: list[SeqKV]) -> list[slice]:
        """Runs of consecutive rows whose padded gather fits ``max_gather_bytes`` (greedy, in step
        order, so outputs concatenate without an index; a row alone is always a group)."""
        if self.max_gather_bytes is None:
            return [slice(0, len(seqs))]
        block = gather_slot_bytes(self.cache.spec) * self.cache.spec.block_size
        groups, start, widest = [], 0, 0
        for i, s in enumerate(seqs):
            wider = max(widest, len(s.k_blocks))
            if i > start and (i + 1 - start) * wider * block > self.max_gather_bytes:
                groups.append(slice(start, i))
                start, wider = i, len(s.k_blocks)
            widest = wider
        return [*groups, slice(start, len(seqs))]

    def _decode_group(self, seqs: list[SeqKV], rows: slice, from_codes: bool = True) -> DecodePlan:
        bs, pad = self.cache.spec.block_size, self.cache.null_block
        split = codes.split(self.cache, seqs, self._codes_memo) if from_codes and self.from_codes else None
        k_tables = [s.k_blocks for s in seqs] if split is None else split.k_tables
        v_tables = [s.v_blocks for s in seqs] if split is None else split.v_tables
        width = max(1, max(len(t) for t in k_tables))
        table = [b for t in k_tables for b in t + [pad] * (width - len(t))]
        table += [b for t in v_tables for b in t + [pad] * (width - len(t))]
        lengths = self.cache.staging.send([s.num_slots + 1 for s in seqs] if split is None else split.lengths)
        if split is not None and self.native_ok and self._key_only() is None:
            # Values as the pool holds them: the native kernel reads the pool part in place, so no
            # gather plan or mask (a sliding-window layer builds ``whole``, which has them).
            native = native_decode.DecodeTables.build(k_tables, v_tables, split.lengths, pad)
            return DecodePlan(rows, None, width * bs, None, lengths, codes=split, seqs=seqs, native=native)
        visible = torch.arange(width * bs, device=self.cache.kv.device)[None, :] < lengths[:, None]
        return DecodePlan(rows, self.cache.gather_plan(table), width * bs, Mask(visible[:, None, None, :]),
                          lengths, codes=split, seqs=None if split is None else seqs)

    def _build_prefill(self, index: int, seq: SeqKV, n: int, rows: slice) -> PrefillPlan:
        bs = self.cache.spec.block_size
        ctx, cached = seq.num_slots + n, seq.num_slots
        if self.split and cached and self.from_codes:
            split = codes.split(self.cache, [seq], self._codes_memo, [cached])
            if split is not None and split.lengths[0]:  # the cached part's compressed blocks from codes
                nb = -(-split.lengths[0] // bs)
                table = self.cache.gather_plan(split.k_tables[0][:nb] + split.v_tables[0][:nb])
                return PrefillPlan(index, rows, table, ctx, cached, codes=split)
        nb = -(-(cached if self.split else ctx) // bs)
        table = self.cache.gather_plan(seq.k_blocks[:nb] + seq.v_blocks[:nb])
        if self.split:
            return PrefillPlan(index, rows, table, ctx, cached)
        dev = self.cache.kv.device
        limit = cached + torch.arange(n, device=dev)[:, None]  # [T, 1]
        visible = torch.arange(ctx, device=dev)[None, :] <= limit  # [T, ctx]
        return PrefillPlan(index, rows, table, ctx, cached, Mask(visible.repeat(self.group, 1)[None, None]))

    def _begin_paged(self, seqs: list[SeqKV], num_new: list[int]) -> None:
        """The kernel's view of the step: tables with compressed entries renumbered into the side
        tensor (the step's compressed blocks, decoded once per layer), no gather plan, no mask."""
        nb = self.cache.kv.shape[1]
        handles: dict[int, int] = {}
        tables = []
        for t in [s.k_blocks for s in seqs] + [s.v_blocks for s in seqs]:
            tables.append([nb + handles.setdefault(b, len(handles)) if is_compressed(b) else b for b in t])
        self._side = self.cache.gather_plan(list(handles)) if handles else None
        lens = [s.num_slots + n for s, n in zip(seqs, num_new, strict=True)]
        self.paged = PagedBatch.build(tables[:len(seqs)], tables[len(seqs):], lens, num_new,
                                      self._key_only(), self.cache.spec.block_size, self.cache.kv.device,
                                      send=self.cache.staging.send)

    def _key_only(self) -> list[tuple[int, int]] | None:
        """Per sequence of the step, its KEY_ONLY slots (first, count); None: none anywhere."""
        return None

    def _stand_in(self, layer: int) -> Tensor | None:
        """[N, Hkv, D] values standing in for each sequence's KEY_ONLY slots, or None."""
        return None

    def _attend_paged(self, layer: int, q: Tensor, window: int | None = None) -> Tensor:
        """The step's rows through the kernel; ``window``: this layer's sliding window, in slots."""
        side = None if self._side is None else self.cache.gather(layer, self._side)
        out, _ = cast(PagedKernel, self.kernel)(q, self.cache.kv[layer], cast(PagedBatch, self.paged), side,
                                                self._stand_in(layer), window=window)
        return out

    def end_step(self) -> None:
        """Record the appended slots (after the forward pass succeeded)."""
        for s, n in zip(self._seqs, self._num_new, strict=True):
            self.cache.commit(s, n)
        self._seqs, self._num_new = [], []

    # ---- per layer -----------------------------------------------------------------------------
    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
        group, layer = self.cache.place(layer)  # from here on ``layer`` is a pool layer
        self.cache.write(layer, self.writes, k, v, group)  # cast to the pool's dtype (kvCacheDtype)
        if group >= 0 and self._window is not None:  # a window group's layer: its own tables
            return self._window.attend(group, layer, q)
        if self.paged is not None:
            return self._attend_paged(layer, q, window)
        if self.native is not None:
            return native_decode.decode_attention(q, self.cache.kv[layer], self.native, window)
        parts = []
        if self.decode:
            q_dec = q[self.decode_rows]
            parts.extend(self._attend_decode(layer, q_dec[g.rows], g, window) for g in self.decode)
        for p in self.prefills:
            if window is not None:
                parts.append(self._attend_prefill_window(layer, p, q[p.rows], window))
                continue
            # A chunk's own keys and values as the pool holds them (kvCacheDtype), as any later read.
            own_k, own_v = (as_stored(x[p.rows], self.cache.spec.dtype) for x in (k, v))
            parts.append(self._attend_prefill(layer, p, q[p.rows], own_k, own_v))
        if len(parts) == 1:
            return parts[0]
        out = torch.cat(parts)
        if isinstance(self.decode_rows, slice):
            return out
        order = torch.cat([self.decode_rows.cpu()] + [torch.arange(p.rows.start, p.rows.stop)
                                                      for p in self.prefills])
        return torch.empty_like(out).index_copy_(0, order.to(out.device), out)

    def _attend_decode(self, layer: int, q: Tensor, plan: DecodePlan, window: int | None = None) -> Tensor:
        if plan.codes is not None and window is not None:  # windows count slots of the whole table
            if plan.whole is None:
                plan.whole = self._decode_group(cast(list[SeqKV], plan.seqs), plan.rows, from_codes=False)
            plan = plan.whole
        if plan.native is not None and plan.codes is not None:
            out, lse = native_decode.decode_attention_lse(q, self.cache.kv[layer], plan.native)
            return codes.merge(self.cache, layer, q, plan.codes, out, lse)
        b, hq, d = q.shape
        hkv = self.cache.spec.num_kv_heads
        table = cast(GatherPlan, plan.table)  # set on every plan without ``native``
        both = self._gather(layer, table).view(2, b, plan.width, hkv, d).transpose(2, 3)
        keys, vals = both[0], self._decode_values(layer, both[1], plan)  # [B, Hkv, S, D]
        mask = cast(Mask, plan.mask) if window is None else self._decode_window(plan, window)
        qg = q.view(b, hkv, self.group, d)
        if plan.codes is None:
            out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask.additive(q.dtype))
            return out.reshape(b, hq, d)
        out, lse = partial.attend_lse(qg, keys, vals, mask.additive(q.dtype))
        return codes.merge(self.cache, layer, q, plan.codes, out.reshape(b, hq, d), lse.reshape(b, hq))

    def _decode_window(self, plan: DecodePlan, window: int) -> Mask:
        plan.windowed = plan.windowed or {}
        if window not in plan.windowed:
            slots = torch.arange(plan.width, device=plan.lengths.device)[None, :]
            lengths = plan.lengths[:, None]
            visible = (slots < lengths) & (slots >= lengths - window)
            plan.windowed[window] = Mask(visible[:, None, None, :])
        return plan.windowed[window]

    def _attend_prefill_window(self, layer: int, p: PrefillPlan, q: Tensor, window: int) -> Tensor:
        """One masked call over the whole context (the chunk's keys are in the pool already)."""
        t, hq, d = q.shape
        hkv, g, bs = self.cache.spec.num_kv_heads, self.group, self.cache.spec.block_size
        p.windowed = p.windowed or {}
        if window not in p.windowed:
            seq, nb = self._seqs[p.index], -(-p.ctx // bs)
            dev = self.cache.kv.device
            query = p.cached + torch.arange(t, device=dev)[:, None]  # [T, 1] slot of each query
            slots = torch.arange(p.ctx, device=dev)[None, :]
            visible = (slots <= query) & (slots > query - window)
            p.windowed[window] = (self.cache.gather_plan(seq.k_blocks[:nb] + seq.v_blocks[:nb]),
                                  Mask(visible.repeat(g, 1)[None, None]))
        table, mask = p.windowed[window]
        both = self._gather(layer, table).view(2, -1, hkv, d)[:, : p.ctx].transpose(1, 2)
        keys, vals = both[0][None], self._prefill_values(layer, p, both[1][None], None)
        qg = q.view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * t, d)
        out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask.additive(q.dtype))
        return out.view(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, hq, d)

    def _attend_prefill(self, layer: int, p: PrefillPlan, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        t, hq, d = q.shape
        hkv, g = self.cache.spec.num_kv_heads, self.group
        if p.mask is not None:  # one masked call over the gathered context
            keys, vals = self._gather_slots(layer, p, p.ctx)
            qg = q.view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * t, d)
            out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=p.mask.additive(q.dtype))
            return out.view(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, hq, d)
        qh = q.transpose(0, 1)[None]  # [1, Hq, T, D]
        kh = k.repeat_interleave(g, dim=1).transpose(0, 1)[None]
        vh = v.repeat_interleave(g, dim=1).transpose(0, 1)[None]
        if not p.cached:
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)[0].transpose(0, 1)
        own = partial.attend_lse(qh, kh, vh, causal=True)
        keys, vals = self._gather_slots(layer, p, p.cached if p.codes is None else p.codes.lengths[0])
        qg = q.view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * t, d)
        old_out, old_lse = partial.attend_lse(qg, keys, vals)  # every cached slot is visible
        if p.codes is not None:  # fold the compressed blocks in, T x G queries per KV head
            old_out, old_lse = codes.merge_lse(self.cache, layer, qg.reshape(1, hq * t, d), p.codes,
                                               old_out.reshape(1, hq * t, d), old_lse.reshape(1, hq * t))
        old = (old_out.reshape(1, hq, t, d), old_lse.reshape(1, hq, t))
        return partial.combine([own, old])[0].transpose(0, 1)

    def _gather_slots(self, layer: int, p: PrefillPlan, n: int) -> tuple[Tensor, Tensor]:
        """Slots ``[0, n)`` of a prefill plan's tables as [1, Hkv, n, D] keys and values."""
        hkv, d = self.cache.spec.num_kv_heads, self.cache.spec.head_dim
        both = self._gather(layer, p.table).view(2, -1, hkv, d)[:, :n].transpose(1, 2)  # [2, Hkv, n, D]
        return both[0][None], self._prefill_values(layer, p, both[1][None], p.codes)

    def _gather(self, layer: int, plan: GatherPlan) -> Tensor:
        """The plan's blocks of ``layer``: [rows, bs, Hkv, D], a fresh tensor (the one place the pool is
        read, so a cache stored in another dtype casts here)."""
        return self.cache.gather(layer, plan)

    # Hooks for a subclass that stands in for some values (retention's KEY_ONLY tier); the tensors
    # are this layer's fresh gather, so they may be written in place. Prefill values hold
    # the chunk's cached slots (split kernel; compacted by ``split`` where its compressed blocks
    # are attended from codes, else None) or its whole context (masked call).
    def _decode_values(self, layer: int, vals: Tensor, plan: DecodePlan) -> Tensor:  # [B, Hkv, S, D]
        return vals

    def _prefill_values(self, layer: int, p: PrefillPlan, vals: Tensor,  # [1, Hkv, n, D]
                        split: codes.CodesSplit | None) -> Tensor:
        return vals


def gather_slot_bytes(spec: CacheSpec) -> int:
    """Bytes one token's K and V take in one layer's decode gather: the compute-dtype copy, plus the
    storage-dtype read it is cast from when the pool stores another dtype."""
    compute = torch.empty((), dtype=spec.compute_dtype).element_size()
    stored = torch.empty((), dtype=spec.dtype).element_size() if spec.dtype != spec.compute_dtype else 0
    return 2 * spec.num_kv_heads * spec.head_dim * (compute + stored)
