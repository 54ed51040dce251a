"""Attention of a window group's layers over their own block tables (``cache.groups``).

A window group's table holds only the blocks from ``SeqKV.window_first`` on (earlier entries are
the null block), and its slot ``s`` is token ``s``. Per step, ``WindowStep`` builds once what the
batch needs: per sequence the held run of blocks and the mask of each query (it sees the tokens
after ``token - window`` up to itself); per layer a group's blocks are gathered through the group's
own tables (one gather plan per group, built on first use) and attended: decode rows batched in
one ``scaled_dot_product_attention`` call (padded to the widest run), each prefill chunk in one
masked call, or on CPU in query slices without a mask (``causal_chunks``). The chunk's own keys
are read back from the pool, where ``attend`` wrote them, so every read has the pool's precision.
A decode-only step whose pool the
native kernel reads (``kernels.native_decode``, ``native=True``) skips the gather and the mask: each
group's tables go to the kernel as they are, with the window, as the global layers' do. The window
groups hold no compressed block and no stood-in value (retention acts on the global group only), so
what the kernel reads is exactly what the gather would copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from confkv_engine.attention import causal_chunks
from confkv_engine.attention.kernels import native_decode
from confkv_engine.cache.arena import GatherPlan
from confkv_engine.cache.kv_cache import KVCache, SeqKV


@dataclass
class _Rows:
    """Sequences attended in one call: their block runs (first block, end block) and the mask."""

    seqs: list[int]  # indices into the step's sequences
    runs: list[tuple[int, int]]
    width: int  # blocks per row after padding
    mask: Tensor | None  # additive, [B, 1, G*T, width * bs]; None for a sliced prefill chunk
    plans: dict[int, GatherPlan]  # per window group, built on first use


class WindowStep:
    """One step's attention over the window groups' tables (see the module docstring)."""

    def __init__(self, cache: KVCache, seqs: list[SeqKV], num_new: list[int], group: int,
                 offsets: list[int], dtype: torch.dtype, native: bool = False) -> None:
        groups = cache.spec.layer_groups
        if groups is None:
            raise ValueError("a window step needs a cache with window groups")
        self.cache, self.seqs, self.num_new, self.group = cache, seqs, num_new, group
        self.offsets, self.window = offsets, groups.window
        dec = [i for i, n in enumerate(num_new) if n == 1]
        # Per window group, the native kernel's tables (built on first use); None: gather and mask.
        self.native: dict[int, native_decode.DecodeTables] | None = (
            {} if native and len(dec) == len(seqs) else None)
        if self.native is not None:
            self.calls: list[_Rows] = []
            return
        # On CPU a prefill chunk attends in query slices (``causal_chunks``), which needs no mask.
        sliced = cache.kv.device.type == "cpu"
        self.calls = ([self._rows(dec, dtype)] if dec else []) + [
            self._rows([i], dtype, masked=not sliced) for i, n in enumerate(num_new) if n > 1]

    def _rows(self, index: list[int], dtype: torch.dtype, masked: bool = True) -> _Rows:
        bs, dev = self.cache.spec.block_size, self.cache.kv.device
        runs = [(self.seqs[i].window_first, -(-(self.seqs[i].window_slots + self.num_new[i]) // bs))
                for i in index]
        width = max(hi - lo for lo, hi in runs)
        t = max(self.num_new[i] for i in index)
        if not masked:
            return _Rows(index, runs, width, None, {})
        first = torch.tensor([lo * bs for lo, _ in runs], device=dev)[:, None, None]  # [B, 1, 1]
        start = torch.tensor([self.seqs[i].window_slots for i in index], device=dev)[:, None, None]
        token = first + torch.arange(width * bs, device=dev)[None, None, :]  # [B, 1, S] token of each slot
        query = start + torch.arange(t, device=dev)[None, :, None]  # [B, T, 1]
        visible = (token <= query) & (token > query - self.window)
        zero = torch.zeros((), dtype=dtype, device=dev)
        mask = torch.where(visible, zero, torch.full_like(zero, float("-inf")))
        mask = mask.repeat(1, self.group, 1)[:, None]  # query heads grouped per KV head: [B, 1, G*T, S]
        return _Rows(index, runs, width, mask, {})

    def _plan(self, rows: _Rows, group: int) -> GatherPlan:
        plan = rows.plans.get(group)
        if plan is None:
            pad = self.cache.null_block
            tables = [self.seqs[i].windows[group] for i in rows.seqs]
            table = [b for (lo, hi), t in zip(rows.runs, tables, strict=True)
                     for b in t.k_blocks[lo:hi] + [pad] * (rows.width - hi + lo)]
            table += [b for (lo, hi), t in zip(rows.runs, tables, strict=True)
                      for b in t.v_blocks[lo:hi] + [pad] * (rows.width - hi + lo)]
            plan = rows.plans[group] = self.cache.gather_plan(table)
        return plan

    def _tables(self, group: int) -> native_decode.DecodeTables:
        tables = cast(dict[int, native_decode.DecodeTables], self.native)
        if group not in tables:
            own = [s.windows[group] for s in self.seqs]
            tables[group] = native_decode.DecodeTables.build(
                [t.k_blocks for t in own], [t.v_blocks for t in own], [s.window_slots + 1 for s in self.seqs],
                self.cache.null_block)
        return tables[group]

    def attend(self, group: int, layer: int, q: Tensor) -> Tensor:
        """Pool layer ``layer`` of window group ``group`` for the step's queries ``q`` [T, Hq, D]."""
        if self.native is not None:  # [B, Hq, D]: one decode row per sequence, in step order
            return native_decode.decode_attention(q, self.cache.kv[layer], self._tables(group), self.window)
        out = torch.empty_like(q)
        hkv, d = self.cache.spec.num_kv_heads, self.cache.spec.head_dim
        for rows in self.calls:
            b, t = len(rows.seqs), max(self.num_new[i] for i in rows.seqs)
            both = self.cache.gather(layer, self._plan(rows, group)).view(2, b, -1, hkv, d)
            if rows.mask is None:  # one prefill chunk; slot 0 of its run is token lo * bs
                i, lo = rows.seqs[0], rows.runs[0][0]
                first = self.seqs[i].window_slots - lo * self.cache.spec.block_size
                out[self.offsets[i]:self.offsets[i] + t] = causal_chunks.attend(
                    q[self.offsets[i]:self.offsets[i] + t], both[0, 0], both[1, 0], first, self.window)
                continue
            both = both.transpose(2, 3)  # [2, B, Hkv, S, D]
            qs = torch.stack([q[self.offsets[i]:self.offsets[i] + t] for i in rows.seqs])  # [B, T, Hq, D]
            qg = qs.view(b, t, hkv, self.group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, self.group * t, d)
            o = F.scaled_dot_product_attention(qg, both[0], both[1], attn_mask=rows.mask)
            o = o.view(b, hkv, self.group, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, -1, d)
            for j, i in enumerate(rows.seqs):
                out[self.offsets[i]:self.offsets[i] + t] = o[j]
        return out
