"""Paged attention backend: writes a step's k/v into the sequences' slots and attends over them.

``begin_step`` builds everything that depends only on the batch (write indices, block-table
tensors, additive masks) once per step; ``attend`` (called once per layer) is then a handful of
tensor ops. The step's tokens are the sequences' new tokens flattened in the order given.

- Decode rows (sequences with one new token) are batched: their blocks are gathered into
  ``[B, S, Hkv, D]`` (S = longest table x block size) and one ``scaled_dot_product_attention``
  call runs with an additive float mask hiding each row's unused slots. Query heads are grouped
  by KV head (``[B, Hkv, G, D]``), so GQA never repeats K or V.
- Prefill-chunk rows are handled per sequence with a causal mask in slot space: query t of a
  chunk sees the slots below ``slots_before + t + 1``. Positions never enter the mask: RoPE was
  applied before caching.
- Compressed blocks (negative table entries) are dequantized on read: ``begin_step`` turns each
  table into a ``GatherPlan`` (pool ids with compressed entries pointing at the null block, plus
  per arena the rows and byte addresses to decode), and per layer the gather is one index_select
  followed by one batched decode per arena that overwrites those rows. A table without compressed
  entries costs exactly what it did before.
- Masks are additive floats (0 / -inf); boolean 4D masks are avoided (they silently give wrong
  results in eager attention). The softmax is fp32: on CPU half-precision inputs are upcast; CUDA
  kernels accumulate in fp32 already.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from confkv_engine.cache.arena import GatherPlan
from confkv_engine.cache.kv_cache import KVCache, SeqKV, WritePlan

_NEG_INF = float("-inf")


@dataclass
class PrefillPlan:
    """One prefill chunk's attention inputs, built once per step."""

    index: int  # the sequence's position in the step
    rows: slice
    k_table: GatherPlan  # nb blocks
    v_table: GatherPlan
    ctx: int  # slots visible to the last query of the chunk (slice of the gathered blocks)
    mask: Tensor  # [1, 1, G*T, ctx]


class PagedAttention:
    """``AttentionBackend`` over a ``KVCache``. Use: begin_step -> model.forward -> end_step."""

    def __init__(self, cache: KVCache, num_q_heads: int) -> None:
        self.cache = cache
        spec = cache.spec
        if num_q_heads % spec.num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads is not a multiple of {spec.num_kv_heads} KV heads")
        self.group = num_q_heads // spec.num_kv_heads
        self.upcast = spec.device.type == "cpu" and spec.compute_dtype != torch.float32
        self._seqs: list[SeqKV] = []
        self._num_new: list[int] = []

    # ---- per-step metadata -------------------------------------------------------------------
    def begin_step(self, seqs: list[SeqKV], num_new: list[int], positions: Tensor) -> None:
        """Slots for ``num_new[i]`` tokens must already be reserved; ``positions`` [T] absolute."""
        dev = self.cache.kv.device
        self._seqs, self._num_new = seqs, num_new
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
            slice(0, len(dec)) if dec_rows == list(range(len(dec))) else torch.tensor(dec_rows, device=dev))
        self._build_decode([seqs[i] for i in dec])
        self.prefills: list[PrefillPlan] = [
            self._build_prefill(i, seqs[i], n, slice(offsets[i], offsets[i + 1]))
            for i, n in enumerate(num_new) if n > 1]

    def _build_decode(self, seqs: list[SeqKV]) -> None:
        if not seqs:
            return
        dev = self.cache.kv.device
        width = max(len(s.k_blocks) for s in seqs)
        pad = self.cache.null_block
        self.dec_k_table = self.cache.gather_plan(
            [b for s in seqs for b in s.k_blocks + [pad] * (width - len(s.k_blocks))])
        self.dec_v_table = self.cache.gather_plan(
            [b for s in seqs for b in s.v_blocks + [pad] * (width - len(s.v_blocks))])
        self.dec_width = width * self.cache.spec.block_size
        slots = torch.arange(self.dec_width, device=dev)
        lens = torch.tensor([s.num_slots + 1 for s in seqs], device=dev)
        self.dec_mask = self._additive(slots[None, :] < lens[:, None])[:, None, None, :]  # [B,1,1,S]

    def _build_prefill(self, index: int, seq: SeqKV, n: int, rows: slice) -> PrefillPlan:
        dev = self.cache.kv.device
        ctx = seq.num_slots + n
        nb = -(-ctx // self.cache.spec.block_size)
        k_table = self.cache.gather_plan(seq.k_blocks[:nb])
        v_table = self.cache.gather_plan(seq.v_blocks[:nb])
        limit = seq.num_slots + torch.arange(n, device=dev)[:, None]  # [T, 1]
        mask = self._additive(torch.arange(ctx, device=dev)[None, :] <= limit)  # [T, ctx]
        return PrefillPlan(index, rows, k_table, v_table, ctx, mask.repeat(self.group, 1)[None, None])

    def _additive(self, visible: Tensor) -> Tensor:
        dtype = torch.float32 if self.upcast else self.cache.spec.compute_dtype
        zero = torch.zeros((), dtype=dtype, device=visible.device)
        return torch.where(visible, zero, torch.full((), _NEG_INF, dtype=dtype, device=visible.device))

    def end_step(self) -> None:
        """Record the appended slots (after the forward pass succeeded)."""
        for s, n in zip(self._seqs, self._num_new, strict=True):
            self.cache.commit(s, n)
        self._seqs, self._num_new = [], []

    # ---- per layer -----------------------------------------------------------------------------
    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.cache.write(layer, self.writes, k, v)  # cast to the pool's dtype (kvCacheDtype)
        parts = []
        if self.num_decode:
            parts.append(self._attend_decode(layer, q[self.decode_rows]))
        for p in self.prefills:
            parts.append(self._attend_prefill(layer, p, q[p.rows]))
        if len(parts) == 1:
            return parts[0]
        out = torch.cat(parts)
        if isinstance(self.decode_rows, slice):
            return out
        order = torch.cat([self.decode_rows.cpu()] + [torch.arange(p.rows.start, p.rows.stop)
                                                      for p in self.prefills])
        return torch.empty_like(out).index_copy_(0, order.to(out.device), out)

    def _attend_decode(self, layer: int, q: Tensor) -> Tensor:
        b, hq, d = q.shape
        hkv = self.cache.spec.num_kv_heads
        gather = self.cache.gather
        keys = gather(layer, self.dec_k_table).view(b, self.dec_width, hkv, d).transpose(1, 2)
        vals = gather(layer, self.dec_v_table).view(b, self.dec_width, hkv, d).transpose(1, 2)
        vals = self._decode_values(layer, vals)
        out = self._sdpa(q.view(b, hkv, self.group, d), keys, vals, self.dec_mask)  # [B, Hkv, G, D]
        return out.reshape(b, hq, d)

    def _attend_prefill(self, layer: int, p: PrefillPlan, q: Tensor) -> Tensor:
        t, hq, d = q.shape
        hkv, g = self.cache.spec.num_kv_heads, self.group
        keys = self.cache.gather(layer, p.k_table).view(-1, hkv, d)[: p.ctx].transpose(0, 1)[None]
        vals = self.cache.gather(layer, p.v_table).view(-1, hkv, d)[: p.ctx].transpose(0, 1)[None]
        vals = self._prefill_values(layer, p, vals)
        qg = q.view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * t, d)
        out = self._sdpa(qg, keys, vals, p.mask)  # [1, Hkv, G*T, D]
        return out.view(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, hq, d)

    # Hooks for a subclass that stands in for some values (retention's KEY_ONLY tier); the tensors
    # are fresh gathers, so they may be written in place.
    def _decode_values(self, layer: int, vals: Tensor) -> Tensor:  # [B, Hkv, S, D]
        return vals

    def _prefill_values(self, layer: int, p: PrefillPlan, vals: Tensor) -> Tensor:  # [1, Hkv, ctx, D]
        return vals

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        if self.upcast:
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
            return out.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
