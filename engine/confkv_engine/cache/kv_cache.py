"""Paged KV cache: device tensors, per-sequence block tables and slot metadata.

Layout (chosen so token-level retention can land without rewriting the core):

- **One pool of blocks** (``BlockPool``). A block is ``block_size`` token slots for *one* of K or V,
  over all layers: ``kv[L, num_blocks, block_size, Hkv, D]`` (model dtype). A sequence holds a K
  block table and a separate V block table drawn from the same pool, so dropping a token's V
  (KEY_ONLY) can return whole V blocks that are then usable as K or V by anyone. Full-cache cost:
  2 blocks per ``block_size`` tokens.
- **Slots, not positions.** Within a sequence, K slot ``s`` of (layer l, KV head h) lives at
  ``kv[l, k_blocks[s // bs], s % bs, h]``. Keys are stored after RoPE, and ``pos[l, flat_slot, h]``
  (int32, pool-level, -1 = empty) records the absolute position of the token in every slot, so
  retention can keep *different token sets per layer and per KV head* (slot s of head 0 and head
  1 may hold different tokens) and never re-rotates anything.
- **Slot counts.** ``SeqKV.num_slots`` is the high-water mark over (layer, head); ``head_slots``
  ``[L, Hkv]`` holds per-(layer, head) counts once they diverge (None while all are equal, the fast
  path). New tokens of (l, h) are appended at slot ``head_slots[l, h]``; a query sees exactly the
  slots below its own, so attention needs no positions, only counts (see ``paged_attention``).
  The sequence's block count is ``ceil(num_slots / bs)`` per table, so equal per-head budgets
  release whole blocks.
- **V tied to K (today).** V slot s holds the value of K slot s. The KEY_ONLY tier adds a
  ``SeqKV.v_map [L, Hkv, num_slots]`` (V slot per K slot, -1 = V dropped) and shrinks
  ``v_blocks``; that map and the per-(sequence, layer, head) mean of dropped values are the
  retention work's additions (the backend reads V through the map when it is set).

Retention hooks (the policies live elsewhere):

- ``KVCache.compact(seq, keep[L, Hkv, num_slots])`` moves the kept slots of every (layer, head)
  forward in order (K, V and positions together) and returns the now-unused tail blocks to the pool
  in the same call. ``seq_bytes`` counts what a sequence holds from its block tables (the pool's
  own allocation), K and V separately.
- The engine calls ``RetentionPolicy.after_step(seq, cache)`` after every prefill chunk and decode
  step, and the scheduler cuts prefill chunks at multiples of ``block_size`` so that a policy
  acting only when ``num_computed % block_size == 0`` makes the same decisions on replay after
  preemption. The default ``FullCache`` policy keeps everything.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from confkv_engine.cache.block_pool import BlockPool

log = logging.getLogger("confkv.cache")

DEFAULT_CPU_CACHE_BYTES = 1 << 30
# On CPU the pool never takes more than half of the RAM available when the engine starts (a
# fraction such as "80%" is of total RAM, then capped): the model, activations and the OS need
# the rest. On CUDA it never takes more than 90% of the memory free after the model loaded.
CPU_AVAILABLE_CAP = 0.5
CUDA_FREE_CAP = 0.9


@dataclass(frozen=True)
class CacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (K or V for block_size tokens over all layers) incl. position metadata."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_slot = self.num_layers * self.num_kv_heads * (self.head_dim * elem + 4)
        return per_slot * self.block_size


def resolve_cache_bytes(max_cache_size: tuple[str, float] | None, device: torch.device) -> int:
    """Byte budget of the pool from a parsed ``maxCacheSize`` (see ``confkv_api.config.parse_size``).

    bytes: as given, but never more than the device can hold. Fraction: of free device memory on
    CUDA (measured now, after the model was loaded); on CPU of total RAM. Unset: 90% of free memory
    on CUDA, 1 GiB on CPU. Whatever was asked, the pool is capped at 90% of free CUDA memory, or on
    CPU at half the RAM available now (in a container: of what its memory cgroup still allows; the
    model, activations and the OS need the rest): a size the machine cannot hold is logged and
    capped rather than left to the OOM killer.
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cap = int(CUDA_FREE_CAP * free)
        if max_cache_size is None:
            return cap
        kind, value = max_cache_size
        wanted = value if kind == "bytes" else value * free
        return _capped(wanted, cap, f"{CUDA_FREE_CAP:.0%} of the free CUDA memory")
    if max_cache_size is None:
        return DEFAULT_CPU_CACHE_BYTES
    import psutil

    mem = psutil.virtual_memory()
    kind, value = max_cache_size
    wanted = value if kind == "bytes" else value * mem.total
    available = min(mem.available, _cgroup_headroom() or mem.available)
    return _capped(wanted, int(CPU_AVAILABLE_CAP * available),
                   f"{CPU_AVAILABLE_CAP:.0%} of the available RAM")


# (limit, usage) files of the memory cgroup, v2 then v1: in a container psutil sees the node's RAM,
# while the OOM killer enforces the container's limit.
_CGROUP_MEMORY_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                         "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def _cgroup_headroom() -> int | None:
    """Bytes this process's memory cgroup can still take, or None (no limit, or not readable)."""
    for limit_file, usage_file in _CGROUP_MEMORY_FILES:
        try:
            with open(limit_file) as limit, open(usage_file) as usage:
                limit_text, used = limit.read().strip(), int(usage.read().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= 1 << 60:  # unlimited
            return None
        return max(0, int(limit_text) - used)
    return None


def _capped(wanted: float, cap: int, what: str) -> int:
    if wanted > cap:
        log.warning("maxCacheSize asks for %d bytes, more than this machine can hold; the KV pool is "
                    "capped at %d bytes (%s)", int(wanted), cap, what)
        return cap
    return int(wanted)


@dataclass
class SeqKV:
    """One sequence's view of the pool."""

    k_blocks: list[int] = field(default_factory=list)
    v_blocks: list[int] = field(default_factory=list)
    num_slots: int = 0  # slots used, max over (layer, KV head)
    head_slots: Tensor | None = None  # [L, Hkv] int64 per-(layer, head) counts; None = all num_slots

    @property
    def uniform(self) -> bool:
        return self.head_slots is None


class RetentionPolicy(Protocol):
    """Called by the engine after each prefill chunk / decode step of a running sequence.

    ``num_computed`` is the number of token positions processed so far (cached or evicted). A
    policy may call ``cache.compact`` (and, with KEY_ONLY, drop values); it must keep the most
    recent ``block_size`` slots of every (layer, head) because the scheduler has already counted on
    them. Policies should act only when ``num_computed % cache.spec.block_size == 0``.
    """

    def after_step(self, seq_kv: SeqKV, cache: KVCache, num_computed: int) -> None: ...


class FullCache:
    """The no-op policy: every token stays FULL."""

    def after_step(self, seq_kv: SeqKV, cache: KVCache, num_computed: int) -> None:
        return None


class KVCache:
    def __init__(self, spec: CacheSpec, num_blocks: int) -> None:
        self.spec = spec
        self.pool = BlockPool(num_blocks)
        bs, h, d = spec.block_size, spec.num_kv_heads, spec.head_dim
        self.kv = torch.zeros(spec.num_layers, num_blocks, bs, h, d, dtype=spec.dtype, device=spec.device)
        # Flat views [L, num_blocks * bs, Hkv, D]: a slot's flat index is block * bs + offset.
        self.kv_flat = self.kv.view(spec.num_layers, num_blocks * bs, h, d)
        self.pos = torch.full((spec.num_layers, num_blocks * bs, h), -1, dtype=torch.int32,
                              device=spec.device)

    @classmethod
    def from_budget(cls, spec: CacheSpec, budget_bytes: int) -> KVCache:
        num_blocks = budget_bytes // spec.block_bytes
        if num_blocks < 2:
            raise ValueError(
                f"KV cache budget of {budget_bytes} bytes holds {num_blocks} blocks of "
                f"{spec.block_bytes} bytes; at least 2 are needed (raise maxCacheSize)")
        return cls(spec, int(num_blocks))

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def total_bytes(self) -> int:
        return self.pool.num_blocks * self.spec.block_bytes

    @property
    def used_bytes(self) -> int:
        return self.pool.num_used * self.spec.block_bytes

    def seq_bytes(self, seq: SeqKV) -> int:
        """Bytes a sequence holds in the pool (K and V blocks, position metadata included)."""
        return (len(seq.k_blocks) + len(seq.v_blocks)) * self.spec.block_bytes

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a full (unevicted) cache of ``num_tokens`` needs: K and V tables."""
        return 2 * -(-num_tokens // self.spec.block_size)

    def blocks_needed(self, seq: SeqKV, num_new: int) -> int:
        """Extra blocks needed to append ``num_new`` tokens to every (layer, head)."""
        per_table = -(-(seq.num_slots + num_new) // self.spec.block_size)
        return max(0, per_table - len(seq.k_blocks)) + max(0, per_table - len(seq.v_blocks))

    def reserve(self, seq: SeqKV, num_new: int) -> None:
        """Allocate the blocks for ``num_new`` more slots (raises NoFreeBlocks, allocating nothing)."""
        per_table = -(-(seq.num_slots + num_new) // self.spec.block_size)
        need_k, need_v = max(0, per_table - len(seq.k_blocks)), max(0, per_table - len(seq.v_blocks))
        blocks = self.pool.allocate(need_k + need_v)
        seq.k_blocks.extend(blocks[:need_k])
        seq.v_blocks.extend(blocks[need_k:])

    def free(self, seq: SeqKV) -> None:
        """Return every block of the sequence to the pool (K table first, then V) and reset it."""
        self._clear_positions(seq.k_blocks)
        self.pool.free(seq.k_blocks)
        self.pool.free(seq.v_blocks)
        seq.k_blocks, seq.v_blocks, seq.num_slots, seq.head_slots = [], [], 0, None

    def _clear_positions(self, blocks: list[int]) -> None:
        if blocks:
            bs = self.spec.block_size
            idx = (torch.tensor(blocks, device=self.pos.device)[:, None] * bs
                   + torch.arange(bs, device=self.pos.device)).view(-1)
            self.pos.index_fill_(1, idx, -1)

    def slot_index(self, blocks: list[int], slots: Tensor) -> Tensor:
        """Flat pool index of slot numbers ``slots`` (any shape) through a block table."""
        bs = self.spec.block_size
        table = torch.tensor(blocks, dtype=torch.long, device=slots.device)
        return table[slots // bs] * bs + slots % bs

    def commit(self, seq: SeqKV, num_new: int) -> None:
        """Record that ``num_new`` tokens were appended to every (layer, head) of the sequence."""
        seq.num_slots += num_new
        if seq.head_slots is not None:
            seq.head_slots += num_new

    def slot_positions(self, seq: SeqKV) -> Tensor:
        """Absolute positions in the sequence's K slots: [L, Hkv, num_slots] int32 (-1 = empty)."""
        slots = torch.arange(seq.num_slots, device=self.pos.device)
        idx = self.slot_index(seq.k_blocks, slots)
        return self.pos[:, idx, :].permute(0, 2, 1)

    def compact(self, seq: SeqKV, keep: Tensor) -> int:
        """Keep only the slots where ``keep[L, Hkv, num_slots]`` is True; returns blocks freed.

        Kept slots of each (layer, head) move forward in order, together with their V and position;
        the tail blocks no (layer, head) uses any more go back to the pool now.
        """
        spec = self.spec
        n = seq.num_slots
        if keep.shape != (spec.num_layers, spec.num_kv_heads, n):
            raise ValueError(f"keep mask {tuple(keep.shape)} != {(spec.num_layers, spec.num_kv_heads, n)}")
        dev = self.kv.device
        keep = keep.to(dev)
        if seq.head_slots is not None:  # slots past a head's own count are already empty
            keep = keep & (torch.arange(n, device=dev) < seq.head_slots.to(dev)[..., None])
        counts = keep.sum(-1)  # [L, Hkv]
        # Stable sort puts each head's kept slots first, in their original order.
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices  # [L, Hkv, n]
        layer = torch.arange(spec.num_layers, device=dev)[:, None, None]
        head = torch.arange(spec.num_kv_heads, device=dev)[None, :, None]
        dst_slots = torch.arange(n, device=dev).expand_as(order)
        for blocks in (seq.k_blocks, seq.v_blocks):
            src, dst = self.slot_index(blocks, order), self.slot_index(blocks, dst_slots)
            self.kv_flat[layer, dst, head] = self.kv_flat[layer, src, head]
        k_src, k_dst = self.slot_index(seq.k_blocks, order), self.slot_index(seq.k_blocks, dst_slots)
        moved = self.pos[layer, k_src, head]
        self.pos[layer, k_dst, head] = torch.where(dst_slots < counts[..., None], moved, -1)
        return self._shrink(seq, counts)

    def _shrink(self, seq: SeqKV, counts: Tensor) -> int:
        new_max = int(counts.max()) if counts.numel() else 0
        uniform = bool((counts == new_max).all())
        seq.num_slots = new_max
        seq.head_slots = None if uniform else counts.to("cpu", torch.long)
        keep_blocks = -(-new_max // self.spec.block_size)
        freed = seq.k_blocks[keep_blocks:] + seq.v_blocks[keep_blocks:]
        self._clear_positions(seq.k_blocks[keep_blocks:])
        self.pool.free(freed)
        del seq.k_blocks[keep_blocks:]
        del seq.v_blocks[keep_blocks:]
        return len(freed)
