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

The store of handles over the arenas is ``compressed_store``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from confkv_engine.cache.codec.group_quant import Runs
from confkv_engine.cache.codec.spec import KEY_SHRINK, VALUE_SHRINK, CodecSpec

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
            self._hosts_t = long_tensor(self.hosts, slots.device)
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
            return SlotReads(long_tensor(starts, device))
        index = self.byte_index(long_tensor([slots[i] for i in apart], device))
        return SlotReads(long_tensor(starts, device), long_tensor(apart, device), index)

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
        return SlotPieces(long_tensor(starts, device),
                          long_tensor(tails, device) if split else None)


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

    def read_layers(self, streams: Tensor, slot_bytes: int) -> Tensor:
        """``read`` of several layers' streams [l, NB * host_bytes] into one uint8 [l, N, slot_bytes]
        (a layer at a time: an index along a sliding view of all layers would materialise it)."""
        raw = torch.empty((streams.shape[0], self.starts.numel(), slot_bytes), dtype=torch.uint8,
                          device=streams.device)
        for stream, out in zip(streams, raw, strict=True):
            torch.index_select(stream.unfold(0, slot_bytes, 1), 0, self.starts, out=out)
            if self.apart is not None and self.index is not None:
                out.index_copy_(0, self.apart, stream.index_select(0, self.index).view(-1, slot_bytes))
        return raw


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


def long_tensor(values: list, device: torch.device) -> Tensor:
    """int64 tensor of ``values`` (block ids, rows, byte offsets; nested lists too) on ``device``: built
    on the host and, for an accelerator, copied from pinned memory without the host waiting (a
    ``torch.tensor(..., device=cuda)`` is a blocking copy from pageable memory in every step that
    reads compressed blocks)."""
    out = torch.tensor(values, dtype=torch.long)
    if device.type == "cpu":
        return out
    return out.pin_memory().to(device, non_blocking=True)
