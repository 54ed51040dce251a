"""Device storage of the KV pool: the ``kv`` / ``pos`` / ``scale`` tensors, writes into them, growth.

``DeviceKV`` holds the tensors and nothing about who holds which block (that bookkeeping is
``kv_cache.KVCache``'s: ids, reference counts, tables, the prefix index), as nano-vllm keeps its
block manager free of tensors. It writes a step's keys and values into given slots, records and
clears slot positions, and grows.

Growing the pool live (a raised ``maxCacheSize``): one reallocation and copy, between two steps.

**One tensor, reallocated, not a list of slabs.** Growth allocates the larger ``kv`` and ``pos``
tensors, copies the old ones into their first blocks and swaps them in; every block id keeps its
bytes, so block tables, prefix entries, compressed arenas (whose hosts are pool block ids, read
through a byte view that is rebound), reference counts and the LRU-K history stay valid untouched.
The alternative, a list of slabs with ids mapped to (slab, offset), would grow without a copy and
without the transient peak, but every step pays for it: a write plan and each layer's gather become
one index operation per slab (or a gather through a slab table), and the attention backend, the
arena byte streams and compression would all have to learn the mapping. A live raise is rare (an
operator or the agent changing the policy); a step is not, so the copy is paid once instead.
Measured on this repository's CPU machine (2 cores) at SmolLM2-135M's block layout by
``bench/cache/pool_grow.py`` (half the old pool written; fp32 and bf16 alike, bound by memory
bandwidth, about 0.45 ms per MiB of the new pool): 64 MiB -> 128 MiB in 31 ms, 256 -> 512 MiB in
115 ms, 1 GiB -> 2 GiB (the CPU default pool doubled) in 0.46 s. The engine holds its lock for
that long, so the grow lands between two steps and delays the next one by as much. New blocks are
zeroed, not left uninitialised: attention masks unused slots, but a NaN bit pattern times a zero
weight would still poison a row.

**Memory.** The old and the new tensors coexist during the copy, so the new pool must fit in what
the machine can give a pool *now*: ``layout.machine_cap`` (the start-up cap: 90% of free CUDA memory,
or half the available RAM, cgroup-aware), measured with the old pool still allocated. A larger
request is refused, naming the bytes, and nothing changes; so is an allocation that fails anyway.
"""

from __future__ import annotations

import torch
from torch import Tensor

from confkv_engine.cache.layout import CacheSpec, SeqKV, WritePlan, int8_rows, machine_cap, to_storage
from confkv_engine.cache.staging import HostStaging


class DeviceKV:
    """The pool's tensors for ``num_blocks`` blocks of ``spec`` (see ``kv_cache`` for the layout)."""

    def __init__(self, spec: CacheSpec, num_blocks: int, staging: HostStaging | None = None) -> None:
        """``staging``: how the write slots reach the device (default: a staging of its own)."""
        self.spec = spec
        self.staging = staging or HostStaging(spec.device)
        bs, h, d = spec.block_size, spec.num_kv_heads, spec.head_dim
        self.kv = torch.zeros(spec.num_layers, num_blocks, bs, h, d, dtype=spec.dtype, device=spec.device)
        # Flat views [L, num_blocks * bs, Hkv, D]: a slot's flat index is block * bs + offset.
        self.kv_flat = self.kv.view(spec.num_layers, num_blocks * bs, h, d)
        self.pos = torch.full((spec.num_layers, num_blocks * bs, h), -1, dtype=torch.int32,
                              device=spec.device)
        # An int8 pool's fp16 scale of every (layer, slot, KV head); None for float pools.
        self.scale = (torch.ones((spec.num_layers, num_blocks * bs, h), dtype=torch.float16,
                                 device=spec.device) if spec.dtype == torch.int8 else None)

    @property
    def kv_moved(self) -> Tensor:
        """``kv_flat`` as retention's rewrite moves it: float8 lacks indexing kernels on some
        devices, so a one-byte pool moves its bytes (the same values)."""
        return self.kv_flat.view(torch.uint8) if self.kv_flat.element_size() == 1 else self.kv_flat

    def clear_positions(self, blocks: list[int]) -> None:
        """Mark every slot of pool blocks ``blocks`` empty (position -1)."""
        if blocks:
            bs = self.spec.block_size
            idx = (self.staging.send(blocks)[:, None] * bs
                   + torch.arange(bs, device=self.pos.device)).view(-1)
            self.pos.index_fill_(1, idx, -1)

    def block_scales(self, block: int) -> Tensor:
        """An int8 pool's scales of one block, [L, bs, Hkv] fp16."""
        if self.scale is None:
            raise ValueError("a float pool keeps no scales")
        bs = self.spec.block_size
        return self.scale[:, block * bs:(block + 1) * bs].contiguous()

    def set_block(self, block: int, data: Tensor, scales: Tensor | None = None) -> None:
        """Overwrite pool block ``block`` (all layers, [L, bs, Hkv, D]) and, in an int8 pool, its scales."""
        # non_blocking: from pinned memory on CUDA the copy is queued on the current stream (a side
        # stream for read-backs); from anything else it is an ordinary copy.
        self.kv[:, block] = data.to(self.kv.device, non_blocking=True)
        if self.scale is not None and scales is not None:
            bs = self.spec.block_size
            self.scale[:, block * bs:(block + 1) * bs] = scales.to(self.kv.device, non_blocking=True)

    def plan_writes(self, seqs: list[SeqKV], num_new: list[int], positions: Tensor) -> WritePlan:
        """Flat K and V slots of a step's new tokens (reserved already), and record their positions.
        With window groups (``groups``) the plan also holds each group's slots (one row per table).

        Python touches only the few table entries each sequence writes into; the per-token slots come
        from a handful of tensor ops (``block[rel // bs] * bs + rel % bs``), whatever the token count."""
        groups = self.spec.layer_groups
        tables = [[s.k_blocks, s.v_blocks] for s in seqs]
        starts = [s.num_slots for s in seqs]
        rows = _flat_slots(tables, 2, starts, num_new, self.spec.block_size)
        if groups is not None:
            windows = [[w.k_blocks for w in s.windows] + [w.v_blocks for w in s.windows] for s in seqs]
            more = _flat_slots(windows, 2 * groups.num_window_groups, [s.window_slots for s in seqs],
                               num_new, self.spec.block_size)
            rows = rows + more if isinstance(rows, list) else torch.cat([rows, more])
        sent = self.staging.send(rows)
        if groups is None:
            return self.record(WritePlan(sent[0], sent[1]), positions)
        g = groups.num_window_groups
        return self.record(WritePlan(sent[0], sent[1], sent[2:2 + g], sent[2 + g:]), positions)

    def record(self, plan: WritePlan, positions: Tensor) -> WritePlan:
        """Record the positions of a step's new tokens in their K slots (window groups' included)."""
        pos = positions.to(self.kv.device, torch.int32)[None, :, None]
        self.pos[:, plan.k_index, :] = pos
        for index in () if plan.window_k is None else plan.window_k:
            self.pos[:, index, :] = pos
        return plan

    def write(self, layer: int, plan: WritePlan, k: Tensor, v: Tensor, group: int = -1) -> None:
        """Store a step's new keys and values [T, Hkv, D] (compute dtype) in pool layer ``layer``'s
        slots of the main tables (``group`` -1) or of window group ``group``, cast to the pool's dtype."""
        k_index, v_index = plan.k_index, plan.v_index
        if group >= 0 and plan.window_k is not None and plan.window_v is not None:
            k_index, v_index = plan.window_k[group], plan.window_v[group]
        flat = self.kv_flat[layer]
        if self.scale is not None:  # int8: each (token, head) row with its own scale
            for index, x in ((k_index, k), (v_index, v)):
                codes, scales = int8_rows(x)
                flat.index_copy_(0, index, codes)
                self.scale[layer].index_copy_(0, index, scales)
            return
        k, v = to_storage(k, flat.dtype), to_storage(v, flat.dtype)
        if flat.element_size() == 1:  # fp8: index_copy_ has no float8 kernel; copy the bytes
            flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
        flat.index_copy_(0, k_index, k)
        flat.index_copy_(0, v_index, v)

    def grow(self, physical_blocks: int, limit_bytes: int | None = None) -> None:
        """Reallocate the tensors to ``physical_blocks`` blocks (the null block included), the old
        blocks copied into the first ones. ``limit_bytes``: the most the new pool may take (None:
        ``machine_cap`` now). Raises ValueError, changing nothing, when it does not fit."""
        spec, old_blocks = self.spec, self.kv.shape[1]
        if physical_blocks <= old_blocks:
            return
        new_bytes = physical_blocks * spec.block_bytes
        cap, what = machine_cap(spec.device) if limit_bytes is None else (limit_bytes, "the limit given")
        if new_bytes > cap:
            raise ValueError(
                f"a pool of {new_bytes} bytes ({physical_blocks - 1} blocks) is more than this machine can "
                f"hold now: at most {cap} bytes ({what}, while the current {old_blocks * spec.block_bytes} "
                f"bytes are still allocated)")
        bs, h, d = spec.block_size, spec.num_kv_heads, spec.head_dim
        try:
            kv = torch.empty(spec.num_layers, physical_blocks, bs, h, d, dtype=spec.dtype, device=spec.device)
            pos = torch.empty(spec.num_layers, physical_blocks * bs, h, dtype=torch.int32, device=spec.device)
            scale = None if self.scale is None else torch.ones(
                spec.num_layers, physical_blocks * bs, h, dtype=self.scale.dtype, device=spec.device)
        except RuntimeError as err:  # torch.OutOfMemoryError included: nothing was changed
            raise ValueError(f"allocating a pool of {new_bytes} bytes failed: {err}") from None
        kv[:, :old_blocks].copy_(self.kv)
        kv[:, old_blocks:].zero_()
        pos[:, :old_blocks * bs].copy_(self.pos)
        pos[:, old_blocks * bs:].fill_(-1)
        if scale is not None and self.scale is not None:
            scale[:, :old_blocks * bs].copy_(self.scale)
            self.scale = scale
        self.kv, self.pos = kv, pos
        self.kv_flat = kv.view(spec.num_layers, physical_blocks * bs, h, d)


def _flat_slots(tables: list[list[list[int]]], n_tables: int, starts: list[int], num_new: list[int],
                bs: int) -> list[list[int]] | Tensor:
    """Flat pool slots [n_tables, T] of a step's new tokens: per sequence its ``n_tables`` tables from
    slot ``starts[i]`` on, ``num_new[i]`` tokens each."""
    if all(n == 1 for n in num_new):  # decode: one slot per sequence, nothing per token to vectorise
        return [[t[i][n // bs] * bs + n % bs for t, n in zip(tables, starts, strict=True)]
                for i in range(n_tables)]
    rows: list[list[int]] = [[] for _ in range(n_tables)]
    first: list[int] = []  # per sequence: where its entries start in each row
    lead: list[int] = []  # per sequence: offset of its first new slot inside its first entry
    for seq_tables, start, n in zip(tables, starts, num_new, strict=True):
        lo, hi = start // bs, -(-(start + n) // bs)
        first.append(len(rows[0]) * bs)
        lead.append(start % bs)
        for row, table in zip(rows, seq_tables, strict=True):
            row.extend(table[lo:hi])
    counts = torch.tensor(num_new, dtype=torch.long)
    offsets = torch.cumsum(counts, 0) - counts
    base = torch.tensor(first, dtype=torch.long) + torch.tensor(lead, dtype=torch.long) - offsets
    rel = torch.arange(int(counts.sum())) + torch.repeat_interleave(base, counts)  # [T]
    block, offset = rel // bs, rel % bs
    return torch.stack([torch.tensor(row, dtype=torch.long)[block] * bs + offset for row in rows])
