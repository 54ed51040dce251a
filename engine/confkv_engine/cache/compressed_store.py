"""The compressed store: arenas (``arena``) and counted handles over one pool tensor.

**Handles.** A table entry (``SeqKV.k_blocks``, ``CachedBlock.k_block``) is a pool block id or a
handle naming (arena, slot); ``block_pool.is_compressed`` tells them apart. Handles are counted
references like pool blocks: the store keeps their counts and frees the slot at zero. Handle numbers
are never reused, so a stale handle can never alias a newer block. A K handle also remembers the
position of its first token: blocks compressed by the cache hold consecutive positions, so
positions need no storage; blocks of retention's precision tiers (``tiered``) hold any positions
and keep them with the handle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from confkv_engine.cache.arena import (
    Arena,
    DecodeGroup,
    GatherPlan,
    SlotPieces,
    SlotReads,
    long_tensor,
    row_runs,
)
from confkv_engine.cache.block_pool import BlockPool, is_compressed
from confkv_engine.cache.codec.blocks import decode_keys_transposed, decode_rows
from confkv_engine.cache.codec.spec import CodecSpec
from confkv_engine.cache.layout import to_storage


@dataclass(frozen=True)
class _Handle:
    arena: Arena
    slot: int
    first_pos: int | None  # K blocks: position of slot 0 (the block holds first_pos + 0..bs-1)
    # K blocks of retention's precision tiers hold any positions (each (layer, head) its own tokens):
    # kept here, [L, bs, Hkv] int32, and counted in the block's bytes like the pool's position ints.
    positions: Tensor | None = None
    nbytes: int = 0  # encoded bytes over all layers, stored positions included (``CompressedStore.nbytes``)


class CompressedStore:
    """Arenas and handle reference counts over a pool tensor ``kv[L, NB, bs, Hkv, D]``; the block
    reference operations (``ref`` / ``incref_all`` / ``release`` / ``block_data``) take either kind."""

    def __init__(self, kv: Tensor, pool: BlockPool) -> None:
        self.pool = pool
        self.num_layers = kv.shape[0]
        self.host_bytes = kv[0, 0].numel() * kv.element_size()
        self.dtype = kv.dtype
        self.rebind(kv)
        self.arenas: dict[CodecSpec, Arena] = {}
        self._handles: dict[int, _Handle] = {}
        self._refs: dict[int, int] = {}
        self._next = -1

    def rebind(self, kv: Tensor) -> None:
        """Read the pool through ``kv`` from now on (a grown pool: the same blocks at the same ids)."""
        self.kv = kv
        self.bytes = kv.view(torch.uint8).view(self.num_layers, kv.shape[1] * self.host_bytes)

    def __len__(self) -> int:
        return len(self._handles)

    @property
    def num_hosts(self) -> int:
        return sum(len(a.hosts) for a in self.arenas.values())

    @property
    def reclaimable_hosts(self) -> int:
        """Hosts that evicting every evictable entry would give back: those of arenas whose live
        slots are all held only by evictable entries."""
        return sum(len(a.hosts) for a in self.arenas.values() if a.live and a.idle == a.live)

    def set_idle(self, handle: int, delta: int) -> None:
        """``handle``'s only holder became evictable (+1) or stopped being so (-1)."""
        self._handles[handle].arena.idle += delta

    def hosts_pinned_by(self, handles: list[int]) -> int:
        """Reclaimable hosts that would stop being reclaimable if ``handles`` were shared now."""
        arenas = {id(a): a for a in (self._handles[h].arena for h in handles)}
        return sum(len(a.hosts) for a in arenas.values() if a.live and a.idle == a.live)

    @property
    def stored_bytes(self) -> int:
        """Encoded bytes of live compressed blocks (all layers)."""
        return sum(a.live * a.slot_bytes for a in self.arenas.values()) * self.num_layers

    def put(self, rows: Tensor, spec: CodecSpec, refs: int, first_pos: int | None,
            allocate_host: Callable[[], int], positions: Tensor | None = None) -> int:
        """Store one encoded block (rows [L, spec.nbytes]) with ``refs`` references; returns its handle.
        ``positions`` [L, bs, Hkv]: the K block's token positions when they are not consecutive."""
        arena = self.arenas.get(spec)
        if arena is None:
            arena = self.arenas[spec] = Arena(spec, self.host_bytes)
        slot = arena.take_slot(allocate_host)
        self.bytes.index_copy_(1, arena.byte_index(long_tensor([slot], self.bytes.device)),
                               rows.to(self.bytes.device).reshape(self.num_layers, -1))
        handle, self._next = self._next, self._next - 1
        stored = 0 if positions is None else positions.numel() * positions.element_size()
        self._handles[handle] = _Handle(arena, slot, first_pos, positions,
                                        spec.nbytes * self.num_layers + stored)
        self._refs[handle] = refs
        return handle

    def spec(self, handle: int) -> CodecSpec:
        """The codec a compressed block is stored with."""
        return self._handles[handle].arena.spec

    def ref_count(self, handle: int) -> int:
        return self._refs.get(handle, 0)

    # ---- pool blocks and handles alike ------------------------------------------------------
    def ref(self, block: int) -> int:
        return self.ref_count(block) if is_compressed(block) else self.pool.ref_count(block)

    def incref_all(self, blocks: list[int]) -> None:
        for b in blocks:
            if is_compressed(b):
                self.incref(b)
            else:
                self.pool.incref([b])

    def release(self, blocks: list[int]) -> None:
        """Drop one reference per entry; an arena emptied by it gives its hosts back to the pool."""
        self.pool.free([b for b in blocks if not is_compressed(b)])
        for h in blocks:
            if is_compressed(h):
                self.pool.free(self.free(h))

    def block_data(self, block: int) -> Tensor:
        """One block over all layers [L, bs, Hkv, D] (decoded when compressed)."""
        return self.decode_block(block) if is_compressed(block) else self.kv[:, block]

    def fill_positions(self, out: Tensor, table: list[int], block_size: int) -> None:
        """Write the positions of a K table's compressed blocks into ``out`` [L, num_slots, Hkv]
        (a compressed K block holds consecutive positions from its first one)."""
        n = out.shape[1]
        for i, b in enumerate(table[: -(-n // block_size)]):
            if is_compressed(b):
                first, end = self._handles[b].first_pos or 0, min(block_size, n - i * block_size)
                stored = self._handles[b].positions
                if stored is not None:
                    out[:, i * block_size:i * block_size + end, :] = stored[:, :end].to(out)
                    continue
                out[:, i * block_size:i * block_size + end, :] = torch.arange(
                    first, first + end, dtype=out.dtype, device=out.device)[None, :, None]

    def incref(self, handle: int) -> None:
        if self._refs.get(handle, 0) <= 0:
            raise ValueError(f"compressed block {handle} is free; cannot share it")
        self._refs[handle] += 1

    def free(self, handle: int) -> list[int]:
        """Drop one reference; returns the pool blocks an emptied arena hands back (zeroed)."""
        if self._refs.get(handle, 0) <= 0:
            raise ValueError(f"compressed block {handle} freed twice")
        self._refs[handle] -= 1
        if self._refs[handle]:
            return []
        del self._refs[handle]
        h = self._handles.pop(handle)
        hosts = h.arena.release_slot(h.slot)
        if hosts:  # no codec bytes go back to the pool (see the module docstring)
            index = long_tensor(hosts, self.bytes.device)
            self.bytes.view(self.num_layers, -1, self.host_bytes).index_fill_(1, index, 0)
        return hosts

    def slot_of(self, handle: int) -> tuple[CodecSpec, int]:
        """A compressed block's codec and slot in its arena (where ``slot_reads`` finds it)."""
        h = self._handles[handle]
        return h.arena.spec, h.slot

    def slot_reads(self, spec: CodecSpec, slots: list[int], device: torch.device) -> SlotReads:
        """Where ``slots`` of the arena of ``spec`` lie in a layer's bytes (read with ``read_slots``)."""
        return self.arenas[spec].slot_reads(slots, device)

    def slot_pieces(self, spec: CodecSpec, slots: list[int], device: torch.device) -> SlotPieces | None:
        """Where ``slots`` of the arena of ``spec`` lie in a layer's bytes, read where they lie, in
        pieces (``Arena.slot_pieces``); None when one spans more than two hosts."""
        return self.arenas[spec].slot_pieces(slots, device)

    def slot_bytes(self, layer: int, spec: CodecSpec, reads: SlotReads) -> tuple[Tensor, Tensor]:
        """The planned slots' encodings in ``layer`` as (uint8 1-D bytes, int64 [N] offsets): the
        layer's stream where every slot is contiguous in it (no copy), else a copy of them."""
        if reads.apart is None:
            return self.bytes[layer], reads.starts
        raw = reads.read(self.bytes[layer], spec.nbytes)
        return raw.view(-1), torch.arange(raw.shape[0], device=raw.device) * spec.nbytes

    def first_pos(self, handle: int) -> int | None:
        return self._handles[handle].first_pos

    def positions(self, handle: int) -> Tensor | None:
        return self._handles[handle].positions

    def nbytes(self, handle: int) -> int:
        """Encoded bytes of one block over all layers, its stored positions included."""
        return self._handles[handle].nbytes

    def total_nbytes(self, handles: list[int]) -> int:
        """``nbytes`` summed over ``handles`` (a sequence's tables read every step: one pass)."""
        found = self._handles
        return sum(found[h].nbytes for h in handles)

    def plan(self, table: list[int], null_block: int, device: torch.device) -> GatherPlan:
        """Gather plan of a table; no work beyond one tensor when nothing in it is compressed."""
        if not any(is_compressed(b) for b in table):
            return GatherPlan(long_tensor(table, device), ())
        by_arena: dict[CodecSpec, tuple[list[int], list[int]]] = {}
        for row, b in enumerate(table):
            if is_compressed(b):
                h = self._handles[b]
                rows, slots = by_arena.setdefault(h.arena.spec, ([], []))
                rows.append(row)
                slots.append(h.slot)
        groups = tuple(
            DecodeGroup(spec, long_tensor(rows, device), self.arenas[spec].slot_reads(slots, device),
                        row_runs(rows))
            for spec, (rows, slots) in by_arena.items())
        pool_rows = [row for row, b in enumerate(table) if not is_compressed(b)]
        return GatherPlan(long_tensor([null_block if is_compressed(b) else b for b in table], device), groups,
                          long_tensor(pool_rows, device), long_tensor([table[r] for r in pool_rows], device))

    def gather(self, blocks: Tensor, layer: int, plan: GatherPlan,
               dtype: torch.dtype | None = None, scales: Tensor | None = None) -> Tensor:
        """``blocks`` = kv[layer] ([NB, bs, Hkv, D]) gathered through the plan into ``dtype`` (default
        the pool's), times ``scales`` [NB, bs, Hkv] when given (an int8 pool), compressed rows
        decoded: one index_select of the pool entries, then per arena one byte gather and one batched
        decode, written in place run by run (``DecodeGroup.runs``)."""
        if not plan.groups:
            return _pool_rows(blocks, plan.table, dtype, scales)
        out = torch.empty((plan.table.numel(), *blocks.shape[1:]), dtype=dtype or blocks.dtype,
                          device=blocks.device)
        if plan.pool_ids is not None and plan.pool_ids.numel():
            out.index_copy_(0, plan.pool_rows, _pool_rows(blocks, plan.pool_ids, out.dtype, scales))
        for g in plan.groups:
            raw = g.reads.read(self.bytes[layer], g.spec.nbytes)
            if g.runs is not None:
                decode_rows(raw, g.spec, dtype=out.dtype, out=out, runs=g.runs)
            else:
                out.index_copy_(0, g.rows, decode_rows(raw, g.spec, dtype=out.dtype))
        return out

    def gather_layers(self, layers: range, plan: GatherPlan, dtype: torch.dtype) -> Tensor:
        """``gather`` of several layers at once (a float pool): [len(layers), len(table), bs, Hkv, D] in
        ``dtype``; one pool index and one decode per arena for them all, not one per layer."""
        kv = self.kv[layers.start:layers.stop]
        if not plan.groups:
            return _layer_rows(kv, plan.table).to(dtype)
        nl, nr = kv.shape[0], plan.table.numel()
        out = torch.empty((nl, nr, *kv.shape[2:]), dtype=dtype, device=kv.device)
        if plan.pool_ids is not None and plan.pool_ids.numel():
            out.index_copy_(1, plan.pool_rows, _layer_rows(kv, plan.pool_ids).to(dtype))
        flat = out.view(nl * nr, *kv.shape[2:])
        for g in plan.groups:
            raw = g.reads.read_layers(self.bytes[layers.start:layers.stop], g.spec.nbytes)  # [l, N, nbytes]
            n = raw.shape[1]
            runs = g.runs or tuple((int(r), i, 1) for i, r in enumerate(g.rows.tolist()))
            every = tuple((layer * nr + first, layer * n + src, count)
                          for layer in range(nl) for first, src, count in runs)
            decode_rows(raw.reshape(nl * n, -1), g.spec, dtype=dtype, out=flat, runs=every)
        return out

    def gather_keys_transposed(self, layers: range, plan: GatherPlan) -> Tensor:
        """Keys of several layers as K^T: [len(layers), Hkv * D, len(table) * bs] fp32, the layout a
        score matmul reads. Compressed key blocks decode straight into it (``decode_keys_transposed``);
        without the library, ``gather_layers`` and a transpose."""
        kv = self.kv[layers.start:layers.stop]
        nl, nr, (bs, hkv, d) = kv.shape[0], plan.table.numel(), kv.shape[2:]
        out = torch.empty((nl, hkv * d, nr * bs), dtype=torch.float32, device=kv.device)
        blocks = out.view(nl, hkv * d, nr, bs)
        for g in plan.groups:
            raw = g.reads.read_layers(self.bytes[layers.start:layers.stop], g.spec.nbytes)  # [l, N, nbytes]
            dst = (torch.arange(nl, device=kv.device)[:, None] * nr + g.rows[None, :]).reshape(-1)
            if not decode_keys_transposed(raw.reshape(-1, g.spec.nbytes), g.spec, out, dst):
                rows = self.gather_layers(layers, plan, torch.float32)  # [l, R, bs, Hkv, D]
                return rows.view(nl, nr * bs, hkv * d).transpose(1, 2).contiguous()
        pool_rows = plan.pool_rows if plan.groups else torch.arange(nr, device=kv.device)
        pool_ids = plan.pool_ids if plan.groups else plan.table
        if pool_ids is not None and pool_rows is not None and pool_ids.numel():
            full = _layer_rows(kv, pool_ids).to(torch.float32)  # [l, P, bs, Hkv, D]
            blocks.index_copy_(2, pool_rows, full.permute(0, 3, 4, 1, 2).reshape(nl, hkv * d, -1, bs))
        return out

    def decode_block(self, handle: int) -> Tensor:
        """All layers of one compressed block: [L, bs, Hkv, D] in the pool's dtype."""
        h = self._handles[handle]
        index = h.arena.byte_index(long_tensor([h.slot], self.bytes.device))
        raw = self.bytes[:, index]  # [L, slot_bytes]
        return to_storage(decode_rows(raw, h.arena.spec), self.dtype)


def _pool_rows(blocks: Tensor, ids: Tensor, dtype: torch.dtype | None, scales: Tensor | None) -> Tensor:
    """Pool blocks ``ids`` of one layer in ``dtype``, times their ``scales`` when given (int8 pool)."""
    if blocks.element_size() == 1:  # float8 lacks index_select on some devices: gather the bytes
        out = blocks.view(torch.uint8).index_select(0, ids).view(blocks.dtype)
    else:
        out = blocks.index_select(0, ids)
    if dtype is not None and out.dtype != dtype:
        out = out.to(dtype)
    if scales is not None:
        out.mul_(scales.index_select(0, ids).to(out.dtype).unsqueeze(-1))
    return out


def _layer_rows(kv: Tensor, ids: Tensor) -> Tensor:
    """Pool blocks ``ids`` of the layers ``kv`` [l, NB, ...] holds (float8 as bytes, as ``_pool_rows``)."""
    if kv.element_size() == 1:
        return kv.view(torch.uint8).index_select(1, ids).view(kv.dtype)
    return kv.index_select(1, ids)
