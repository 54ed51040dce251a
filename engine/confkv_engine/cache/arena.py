"""Quantized KV blocks stored inside pool memory: arenas of encoded slots and negative block handles.

A compressed block never leaves the pool's tensor. Each **arena** (one per kind K|V and codec
settings) owns some pool blocks, its *hosts*, and reads their bytes as one stream: the kv tensor's
bytes of one (layer, pool block) are contiguous (``kv.view(uint8)`` is ``[L, NB, host_bytes]``), so
an arena's layer-l stream is the concatenation of its hosts' layer-l bytes. Slot ``s`` holds one
encoded block, each layer's encoding (``CodecSpec`` on the per-layer shape ``[bs, Hkv, D]``) at the
same virtual offset ``s * slot_bytes`` of that layer's stream. A slot may straddle two hosts, so
byte addresses are computed with tensors (host ``hosts[v // host_bytes]``, offset ``v % host_bytes``)
and the saving is the codec's exact byte ratio, with no rounding to whole pool blocks.

The arena grows one host at a time when it runs out of slots, and hands *all* its hosts back to
the pool when its last slot is freed, zeroed: read as the pool's dtype, codec bytes may be NaN or
inf, and a block's unwritten slots are read too (attention masks them, but a zero weight times NaN
is NaN), so a host handed to a sequence as a K or V block would poison its rows. Slots never move
(a handle stays valid while referenced), so a fragmented arena keeps its hosts until it empties; the
lowest free slot is reused first, which keeps the live slots packed at the start of the stream.

**Handles.** A table entry (``SeqKV.k_blocks``, ``CachedBlock.k_block``) is a pool block id or a
handle naming (arena, slot); ``block_pool.is_compressed`` tells them apart. Handles are counted
references like pool blocks: the store keeps their counts and frees the slot at zero. Handle numbers
are never reused, so a stale handle can never alias a newer block. A K handle also remembers the
position of its first token: blocks compressed by the cache hold consecutive positions, so
positions need no storage; blocks of retention's precision tiers (``tiered``) hold any positions
and keep them with the handle.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from confkv_engine.cache.block_pool import BlockPool, is_compressed
from confkv_engine.cache.codec.blocks import decode_rows
from confkv_engine.cache.codec.group_quant import Runs
from confkv_engine.cache.codec.spec import KEY_SHRINK, VALUE_SHRINK, CodecSpec
from confkv_engine.cache.layout import to_storage

# The int2 range fit (``codec.spec.KEY_SHRINK``, ``VALUE_SHRINK``) in the precision tiers' codecs
# (``tiered.tier_codecs``): off. Cold-block compression takes it (``compress``): it more than halves
# KIVI-int2's perplexity increase on the tuning windows, but in the precision chain it did not win
# all four tuning cells and made the k4v2 chain worse on prose (docs/notes/retention-journal.md, "A
# range fit for int2"); with it, two path-parity tests (in-place vs gathering echo for k4v2, codes vs
# decoded bf16 attention) also exceed their tolerances by 20%.
RANGE_FIT = False


def block_codecs(block_size: int, num_kv_heads: int, head_dim: int, bits: int, group: int,
                 element_bytes: int = 2, range_fit: bool = RANGE_FIT) -> tuple[CodecSpec, CodecSpec]:
    """Per-layer codec specs (keys, values) for ``[block_size, Hkv, D]`` blocks of a pool storing
    ``element_bytes`` per element.

    Keys are grouped per channel along tokens, values per token along head_dim (as
    ``codec.spec.key_spec`` / ``value_spec``). ``group`` is the value group; a key group cannot span more
    than one block's tokens, so keys use ``min(group, block_size)``. Key parameters are fp16 in an
    fp32 pool (0.31x / 0.19x of its block at int8 / int4 already, and the most accurate) and dq6 in a
    16-bit or smaller one, where fp16 parameters would hold 0.63x / 0.38x of a bf16 block.
    ``range_fit``: int2 groups take the least-error shrunk range (``codec.group_quant``), else min/max.
    """
    shape = (block_size, num_kv_heads, head_dim)
    if head_dim % min(group, head_dim):
        raise ValueError(f"compression groupSize {group} must divide head_dim {head_dim} "
                         f"(or be at least {head_dim})")
    k_group = min(group, block_size)
    if block_size % k_group:
        raise ValueError(f"compression groupSize {group} must divide the block size {block_size} "
                         f"(or be at least {block_size})")
    key_params = "fp16" if element_bytes >= 4 else "dq6"
    k_shrink, v_shrink = (KEY_SHRINK, VALUE_SHRINK) if range_fit else (1.0, 1.0)
    return (CodecSpec(shape, bits, axis=0, group=k_group, params=key_params, shrink=k_shrink),
            CodecSpec(shape, bits, axis=-1, group=min(group, head_dim), shrink=v_shrink))


@dataclass
class Arena:
    """Encoded slots of one codec spec in the byte stream of its host pool blocks."""

    spec: CodecSpec
    host_bytes: int
    hosts: list[int] = field(default_factory=list)
    live: int = 0
    idle: int = 0  # live slots held only by evictable prefix entries (evicting them all empties it)
    _free: list[int] = field(default_factory=list)  # heap of free slot numbers
    _hosts_t: Tensor | None = None

    @property
    def slot_bytes(self) -> int:
        return self.spec.nbytes

    @property
    def capacity(self) -> int:
        return len(self.hosts) * self.host_bytes // self.slot_bytes

    def take_slot(self, allocate_host: Callable[[], int]) -> int:
        """The lowest free slot, growing by one host block (from ``allocate_host``) when full."""
        if not self._free:
            before = self.capacity
            self.hosts.append(allocate_host())
            self._hosts_t = None
            for s in range(before, self.capacity):
                heapq.heappush(self._free, s)
        self.live += 1
        return heapq.heappop(self._free)

    def release_slot(self, slot: int) -> list[int]:
        """Free ``slot``; returns the hosts to give back to the pool (all of them when it empties)."""
        self.live -= 1
        heapq.heappush(self._free, slot)
        if self.live:
            return []
        hosts, self.hosts, self._free, self._hosts_t, self.idle = self.hosts, [], [], None, 0
        return hosts

    def byte_index(self, slots: Tensor) -> Tensor:
        """Flat indices into a layer's ``[NB * host_bytes]`` bytes: [len(slots) * slot_bytes]."""
        if self._hosts_t is None or self._hosts_t.device != slots.device:
            self._hosts_t = torch.tensor(self.hosts, dtype=torch.long, device=slots.device)
        v = (slots[:, None] * self.slot_bytes + torch.arange(self.slot_bytes, device=slots.device)).view(-1)
        return self._hosts_t[v // self.host_bytes] * self.host_bytes + v % self.host_bytes

    def slot_reads(self, slots: list[int], device: torch.device) -> SlotReads:
        """Where ``slots`` lie in a layer's bytes: the start of each one that is contiguous there, and
        byte indices for the few whose hosts are not neighbours in the pool."""
        starts, apart = [], []
        for i, slot in enumerate(slots):
            v = slot * self.slot_bytes
            first, last = v // self.host_bytes, (v + self.slot_bytes - 1) // self.host_bytes
            spanned = self.hosts[first:last + 1]
            if spanned == list(range(spanned[0], spanned[0] + len(spanned))):
                starts.append(self.hosts[first] * self.host_bytes + v % self.host_bytes)
            else:
                starts.append(0)  # read as a placeholder, then overwritten from ``index``
                apart.append(i)
        if not apart:
            return SlotReads(_longs(starts, device))
        index = self.byte_index(_longs([slots[i] for i in apart], device))
        return SlotReads(_longs(starts, device), _longs(apart, device), index)

    def slot_pieces(self, slots: list[int], device: torch.device) -> SlotPieces | None:
        """Where ``slots`` lie in a layer's bytes for a reader that joins a slot's two pieces itself
        (``codec.native.attend_codes``): nothing is copied. None when a slot spans more than two hosts
        (a pool of one-byte elements), which only ``slot_reads`` covers."""
        starts, tails, split = [], [], False
        for slot in slots:
            v = slot * self.slot_bytes
            first, last = v // self.host_bytes, (v + self.slot_bytes - 1) // self.host_bytes
            if last > first + 1:
                return None
            starts.append(self.hosts[first] * self.host_bytes + v % self.host_bytes)
            if last == first or self.hosts[last] == self.hosts[first] + 1:
                tails.append((self.slot_bytes, 0))  # contiguous in the layer's bytes
            else:
                tails.append(((first + 1) * self.host_bytes - v, self.hosts[last] * self.host_bytes))
                split = True
        return SlotPieces(_longs(starts, device),
                          torch.tensor(tails, dtype=torch.long, device=device) if split else None)


@dataclass(frozen=True)
class SlotPieces:
    """Where N slots lie in a layer's bytes: each at ``starts`` [N], except where ``tails`` [N, 2]
    (None: nowhere) says ``tails[i, 0] < slot_bytes``: the slot's first ``tails[i, 0]`` bytes are at
    ``starts[i]`` and the rest at ``tails[i, 1]`` (it straddles two hosts not adjacent in the pool)."""

    starts: Tensor
    tails: Tensor | None


@dataclass(frozen=True)
class SlotReads:
    """How to read N slots of one arena from a layer's bytes: ``starts`` [N] (the first byte of each
    slot), and for the slots that straddle hosts not adjacent in the pool, their rows ``apart`` and their
    byte indices ``index`` (``Arena.byte_index``)."""

    starts: Tensor
    apart: Tensor | None = None
    index: Tensor | None = None

    def read(self, stream: Tensor, slot_bytes: int) -> Tensor:
        """The slots' bytes from a layer's stream [NB * host_bytes]: uint8 [N, slot_bytes]. A row per
        slot through a sliding view, one copy of slot_bytes each, where a byte index per byte
        measured 6x slower at the sizes a decode step gathers."""
        raw = stream.unfold(0, slot_bytes, 1).index_select(0, self.starts)
        if self.apart is not None and self.index is not None:
            raw.index_copy_(0, self.apart, stream.index_select(0, self.index).view(-1, slot_bytes))
        return raw


@dataclass(frozen=True)
class _Handle:
    arena: Arena
    slot: int
    first_pos: int | None  # K blocks: position of slot 0 (the block holds first_pos + 0..bs-1)
    # K blocks of retention's precision tiers hold any positions (each (layer, head) its own tokens):
    # kept here, [L, bs, Hkv] int32, and counted in the block's bytes like the pool's position ints.
    positions: Tensor | None = None
    nbytes: int = 0  # encoded bytes over all layers, stored positions included (``CompressedStore.nbytes``)


MAX_RUNS = 64  # more runs of consecutive rows than this: decode into a buffer and index_copy


@dataclass(frozen=True)
class DecodeGroup:
    """One arena's compressed rows of a table: their rows in it, where their slots lie in a layer's
    stream and, when few, the runs of consecutive rows (each sequence's frozen blocks) as
    ``(first row in the table, first decoded row, rows)``, which decode in place."""

    spec: CodecSpec
    rows: Tensor
    reads: SlotReads
    runs: Runs | None


@dataclass(frozen=True)
class GatherPlan:
    """How to gather a table of blocks: ``table`` holds the pool ids (compressed entries read the
    null block); with compressed entries, ``pool_rows`` / ``pool_ids`` name the pool entries alone
    and each ``DecodeGroup`` decodes an arena's rows, so no row is read twice."""

    table: Tensor
    groups: tuple[DecodeGroup, ...]
    pool_rows: Tensor | None = None
    pool_ids: Tensor | None = None


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
        self.bytes.index_copy_(1, arena.byte_index(torch.tensor([slot], device=self.bytes.device)),
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
            index = torch.tensor(hosts, dtype=torch.long, device=self.bytes.device)
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
            return GatherPlan(torch.tensor(table, dtype=torch.long, device=device), ())
        by_arena: dict[CodecSpec, tuple[list[int], list[int]]] = {}
        for row, b in enumerate(table):
            if is_compressed(b):
                h = self._handles[b]
                rows, slots = by_arena.setdefault(h.arena.spec, ([], []))
                rows.append(row)
                slots.append(h.slot)
        groups = tuple(
            DecodeGroup(spec, _longs(rows, device), self.arenas[spec].slot_reads(slots, device),
                        row_runs(rows))
            for spec, (rows, slots) in by_arena.items())
        pool_rows = [row for row, b in enumerate(table) if not is_compressed(b)]
        return GatherPlan(_longs([null_block if is_compressed(b) else b for b in table], device), groups,
                          _longs(pool_rows, device), _longs([table[r] for r in pool_rows], device))

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

    def decode_block(self, handle: int) -> Tensor:
        """All layers of one compressed block: [L, bs, Hkv, D] in the pool's dtype."""
        h = self._handles[handle]
        index = h.arena.byte_index(torch.tensor([h.slot], device=self.bytes.device))
        raw = self.bytes[:, index]  # [L, slot_bytes]
        return to_storage(decode_rows(raw, h.arena.spec), self.dtype)


def _longs(values: list[int], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def row_runs(rows: list[int]) -> Runs | None:
    """Ascending ``rows`` as runs of consecutive rows ``(first row, index in rows, length)``; None
    when there are more than ``MAX_RUNS`` (one decode op per run would cost more than a copy)."""
    runs: list[list[int]] = []
    for i, r in enumerate(rows):
        if runs and runs[-1][0] + runs[-1][2] == r:
            runs[-1][2] += 1
        else:
            if len(runs) == MAX_RUNS:
                return None
            runs.append([r, i, 1])
    return tuple((a, b, n) for a, b, n in runs)


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
