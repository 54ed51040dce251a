"""Paged attention backend: writes a step's k/v into the sequences' slots and attends over them.

``begin_step`` builds everything that depends only on the batch (write indices, block-table
tensors, additive masks) once per step; ``attend`` (called once per layer) is then a handful of
tensor ops. The step's tokens are the sequences' new tokens flattened in the order given.

- Decode rows (sequences with one new token) are batched: their blocks are gathered into
  ``[B, S, Hkv, D]`` (S = longest table x block size) and one ``scaled_dot_product_attention``
  call runs with an additive float mask hiding each row's unused slots. Query heads are grouped
  by KV head (``[B, Hkv, G, D]``), so GQA never repeats K or V.
- Prefill-chunk rows are handled per sequence with a causal mask in slot space: query t of a
  chunk sees the slots below ``slots_before + t + 1`` (per (layer, head) once retention has
  made their counts diverge). Positions never enter the mask: RoPE was applied before caching.
- Masks are additive floats (0 / -inf); boolean 4D masks are avoided (see DESIGN.md). The softmax is
  fp32: on CPU half-precision inputs are upcast; CUDA kernels accumulate in fp32 already.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from confkv_engine.cache.kv_cache import KVCache, SeqKV

_NEG_INF = float("-inf")


@dataclass
class _Prefill:
    rows: slice
    k_table: Tensor  # [nb]
    v_table: Tensor
    ctx: int  # slots visible to the last query of the chunk (slice of the gathered blocks)
    mask: Tensor | None  # [1, 1, G*T, ctx] when the sequence is uniform
    before: Tensor | None  # [L, Hkv] slots before the step, for per-head masks


class PagedAttention:
    """``AttentionBackend`` over a ``KVCache``. Use: begin_step -> model.forward -> end_step."""

    def __init__(self, cache: KVCache, num_q_heads: int) -> None:
        self.cache = cache
        spec = cache.spec
        if num_q_heads % spec.num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads is not a multiple of {spec.num_kv_heads} KV heads")
        self.group = num_q_heads // spec.num_kv_heads
        self.upcast = spec.device.type == "cpu" and spec.dtype != torch.float32
        self._seqs: list[SeqKV] = []
        self._num_new: list[int] = []

    # ---- per-step metadata -------------------------------------------------------------------
    def begin_step(self, seqs: list[SeqKV], num_new: list[int], positions: Tensor) -> None:
        """Slots for ``num_new[i]`` tokens must already be reserved; ``positions`` [T] absolute."""
        dev = self.cache.kv.device
        self._seqs, self._num_new = seqs, num_new
        self.uniform = all(s.uniform for s in seqs)
        self._build_writes(seqs, num_new, positions.to(dev))
        offsets = [0]
        for n in num_new:
            offsets.append(offsets[-1] + n)
        dec = [i for i, n in enumerate(num_new) if n == 1]
        self.num_decode = len(dec)
        dec_rows = [offsets[i] for i in dec]
        # The engine puts decode rows first; otherwise fall back to an index.
        self.decode_rows: slice | Tensor = (
            slice(0, len(dec)) if dec_rows == list(range(len(dec))) else torch.tensor(dec_rows, device=dev))
        self._build_decode([seqs[i] for i in dec])
        self.prefills: list[_Prefill] = [
            self._build_prefill(seqs[i], n, slice(offsets[i], offsets[i + 1]))
            for i, n in enumerate(num_new) if n > 1]

    def _build_writes(self, seqs: list[SeqKV], num_new: list[int], positions: Tensor) -> None:
        bs, dev, spec = self.cache.spec.block_size, self.cache.kv.device, self.cache.spec
        if self.uniform:
            k_idx: list[int] = []
            v_idx: list[int] = []
            for s, n in zip(seqs, num_new, strict=True):
                for slot in range(s.num_slots, s.num_slots + n):
                    k_idx.append(s.k_blocks[slot // bs] * bs + slot % bs)
                    v_idx.append(s.v_blocks[slot // bs] * bs + slot % bs)
            self.k_write = torch.tensor(k_idx, dtype=torch.long, device=dev)
            self.v_write = torch.tensor(v_idx, dtype=torch.long, device=dev)
            self.cache.pos[:, self.k_write, :] = positions.to(torch.int32)[None, :, None]
            return
        # Per-(layer, head) write slots: [L, T, Hkv].
        k_parts, v_parts = [], []
        for s, n in zip(seqs, num_new, strict=True):
            base = (s.head_slots.to(dev) if s.head_slots is not None else
                    torch.full((spec.num_layers, spec.num_kv_heads), s.num_slots, device=dev))
            slots = base[:, None, :] + torch.arange(n, device=dev)[None, :, None]  # [L, n, Hkv]
            k_parts.append(self.cache.slot_index(s.k_blocks, slots))
            v_parts.append(self.cache.slot_index(s.v_blocks, slots))
        self.k_write_lh, self.v_write_lh = torch.cat(k_parts, 1), torch.cat(v_parts, 1)
        layer = torch.arange(spec.num_layers, device=dev)[:, None, None]
        head = torch.arange(spec.num_kv_heads, device=dev)[None, None, :]
        self.cache.pos[layer, self.k_write_lh, head] = positions.to(torch.int32)[None, :, None]

    def _build_decode(self, seqs: list[SeqKV]) -> None:
        if not seqs:
            return
        dev = self.cache.kv.device
        width = max(len(s.k_blocks) for s in seqs)
        self.dec_k_table = torch.tensor([s.k_blocks + [0] * (width - len(s.k_blocks)) for s in seqs],
                                        dtype=torch.long, device=dev).view(-1)
        self.dec_v_table = torch.tensor([s.v_blocks + [0] * (width - len(s.v_blocks)) for s in seqs],
                                        dtype=torch.long, device=dev).view(-1)
        self.dec_width = width * self.cache.spec.block_size
        slots = torch.arange(self.dec_width, device=dev)
        if all(s.uniform for s in seqs):
            lens = torch.tensor([s.num_slots + 1 for s in seqs], device=dev)
            self.dec_mask = self._additive(slots[None, :] < lens[:, None])[:, None, None, :]  # [B,1,1,S]
            self.dec_lens_lh = None
        else:
            self.dec_lens_lh = torch.stack([self._head_counts(s) + 1 for s in seqs])  # [B, L, Hkv]

    def _head_counts(self, seq: SeqKV) -> Tensor:
        spec, dev = self.cache.spec, self.cache.kv.device
        if seq.head_slots is not None:
            return seq.head_slots.to(dev)
        return torch.full((spec.num_layers, spec.num_kv_heads), seq.num_slots, device=dev)

    def _build_prefill(self, seq: SeqKV, n: int, rows: slice) -> _Prefill:
        dev = self.cache.kv.device
        ctx = seq.num_slots + n
        nb = -(-ctx // self.cache.spec.block_size)
        k_table = torch.tensor(seq.k_blocks[:nb], dtype=torch.long, device=dev)
        v_table = torch.tensor(seq.v_blocks[:nb], dtype=torch.long, device=dev)
        if not seq.uniform:
            return _Prefill(rows, k_table, v_table, ctx, None, self._head_counts(seq))
        limit = seq.num_slots + torch.arange(n, device=dev)[:, None]  # [T, 1]
        mask = self._additive(torch.arange(ctx, device=dev)[None, :] <= limit)  # [T, ctx]
        return _Prefill(rows, k_table, v_table, ctx, mask.repeat(self.group, 1)[None, None], None)

    def _additive(self, visible: Tensor) -> Tensor:
        dtype = torch.float32 if self.upcast else self.cache.spec.dtype
        zero = torch.zeros((), dtype=dtype, device=visible.device)
        return torch.where(visible, zero, torch.full((), _NEG_INF, dtype=dtype, device=visible.device))

    def end_step(self) -> None:
        """Record the appended slots (after the forward pass succeeded)."""
        for s, n in zip(self._seqs, self._num_new, strict=True):
            self.cache.commit(s, n)
        self._seqs, self._num_new = [], []

    # ---- per layer -----------------------------------------------------------------------------
    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        flat = self.cache.kv_flat[layer]  # [NB*bs, Hkv, D]
        if self.uniform:
            flat.index_copy_(0, self.k_write, k)
            flat.index_copy_(0, self.v_write, v)
        else:
            head = torch.arange(k.shape[1], device=k.device)[None, :]
            flat[self.k_write_lh[layer], head] = k
            flat[self.v_write_lh[layer], head] = v
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
        blocks = self.cache.kv[layer]  # [NB, bs, Hkv, D]
        hkv = blocks.shape[2]
        keys = blocks.index_select(0, self.dec_k_table).view(b, self.dec_width, hkv, d).transpose(1, 2)
        vals = blocks.index_select(0, self.dec_v_table).view(b, self.dec_width, hkv, d).transpose(1, 2)
        vals = self._decode_values(layer, vals)
        if self.dec_lens_lh is None:
            mask = self.dec_mask
        else:
            slots = torch.arange(self.dec_width, device=q.device)
            lens = self.dec_lens_lh[:, layer, :]  # [B, Hkv]
            mask = self._additive(slots[None, None, :] < lens[..., None])[:, :, None, :]  # [B,Hkv,1,S]
        out = self._sdpa(q.view(b, hkv, self.group, d), keys, vals, mask)  # [B, Hkv, G, D]
        return out.reshape(b, hq, d)

    def _attend_prefill(self, layer: int, p: _Prefill, q: Tensor) -> Tensor:
        t, hq, d = q.shape
        blocks = self.cache.kv[layer]
        hkv, g = blocks.shape[2], self.group
        keys = blocks.index_select(0, p.k_table).view(-1, hkv, d)[: p.ctx].transpose(0, 1)[None]
        vals = blocks.index_select(0, p.v_table).view(-1, hkv, d)[: p.ctx].transpose(0, 1)[None]
        vals = self._prefill_values(layer, p, vals)
        mask = p.mask
        if mask is None:  # per-(layer, head) counts: [1, Hkv, G*T, ctx]
            limit = p.before[layer][:, None] + torch.arange(t, device=q.device)[None, :]  # [Hkv, T]
            visible = torch.arange(p.ctx, device=q.device)[None, None, :] <= limit[..., None]
            mask = self._additive(visible).repeat(1, g, 1)[None]
        qg = q.view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * t, d)
        out = self._sdpa(qg, keys, vals, mask)  # [1, Hkv, G*T, D]
        return out.view(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, hq, d)

    # Hooks for a subclass that stands in for some values (retention's KEY_ONLY tier); the tensors
    # are fresh gathers, so they may be written in place.
    def _decode_values(self, layer: int, vals: Tensor) -> Tensor:  # [B, Hkv, S, D]
        return vals

    def _prefill_values(self, layer: int, p: _Prefill, vals: Tensor) -> Tensor:  # [1, Hkv, ctx, D]
        return vals

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        if self.upcast:
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
            return out.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
