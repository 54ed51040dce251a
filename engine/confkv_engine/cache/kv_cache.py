"""Paged KV cache: device tensors, per-sequence block tables and slot metadata.

The cache is the only writer of block tables, pool reference counts and slot positions: the
attention backend asks it where a step's keys and values go (``plan_writes``), retention asks it to
rewrite a sequence by a plan (``rewrite``), the scheduler asks it to reserve and free.

Layout:

- **One pool of blocks** (``BlockPool``). A block is ``block_size`` token slots for *one* of K or V,
  over all layers: ``kv[L, num_blocks, block_size, Hkv, D]`` (the cache dtype: ``CacheSpec.dtype``,
  ``kvCacheDtype``; writes cast to it, reads cast back to the compute dtype). A sequence holds a K
  block table and a separate V block table drawn from the same pool, so dropping a token's V
  (KEY_ONLY) returns whole V blocks that are then usable as K or V by anyone. Full-cache cost:
  2 blocks per ``block_size`` tokens.
- **Slots, not positions.** K slot ``s`` of a sequence lives at ``kv[l, k_blocks[s // bs], s % bs]``
  for every layer l. Keys are stored after RoPE, and ``pos[l, flat_slot, h]`` (int32, -1 = empty)
  records the absolute position of the token in every slot, so retention can keep a different
  token set per (layer, KV head) at the same slot count and never re-rotates anything. A query sees
  exactly the slots below its own, so attention needs counts, not positions.
- **V slot s holds the value of K slot s.** When retention drops the values of a run of slots
  (KEY_ONLY), the V-table entries that cover only such slots point at the **null block**, one
  block reserved when the cache is created and never handed out; it is not counted as anyone's.
- **Prefix cache** (``prefix.PrefixIndex``; lookup, sharing and registration in ``prefix_cache``):
  full blocks of requests without retention are registered under chained token hashes as soon as
  they are computed; a new request's longest cached prefix is
  shared by reference count (``match`` then ``attach``), never copied. Shared blocks are immutable:
  a sequence only ever writes slots past them, and ``rewrite`` refuses to touch them. Unreferenced
  cached blocks stay in the pool, evictable in LRU-K order, and are reclaimed only when the free
  list runs short.
- **Window groups** (``groups``): a model mixing global and sliding-window layers keeps its window
  layers in groups of their own tables, whose blocks before the window go back after each step.
- **Compressed blocks** (``arena``): a table entry or prefix entry may be a handle naming a
  quantized copy kept inside pool memory (``block_pool.is_compressed`` tells the kinds apart, the
  only place that knows how). Every reference-count operation dispatches on the kind;
  readers gather through ``gather_plan`` / ``gather``, which decode compressed rows. Only blocks
  whose every holder is known are compressed (all their table entries change at once), and only
  full blocks of consecutive positions, so a compressed K block needs no position metadata.

**One owner per block.** Block ids, reference counts, the free queue, the prefix index and the
evictable set change only here. Every reference that goes, goes through ``free_blocks`` (as vLLM's
``BlockPool.free_blocks``); blocks come only from ``take_blocks``, which evicts cached blocks in
LRU-K order when the free queue runs short. The helpers that rewrite tables (``compress``,
``tiered``, ``rewrite``) see the cache through ``owner.BlockOwner``, a small named interface of
public methods. The device tensors live apart, in ``storage.DeviceKV``.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
from torch import Tensor

from confkv_engine.cache.arena import GatherPlan
from confkv_engine.cache.block_pool import BlockPool, NoFreeBlocks, is_compressed
from confkv_engine.cache.compress import compress_now, select_cold, select_tables
from confkv_engine.cache.compressed_store import CompressedStore
from confkv_engine.cache.disk_tier import EvictionSink
from confkv_engine.cache.eviction import LRUK
from confkv_engine.cache.groups import GLOBAL
from confkv_engine.cache.layout import (
    CacheSpec,
    CompressResult,
    SeqKV,
    WritePlan,
)
from confkv_engine.cache.prefix import HitCounter, PrefixIndex
from confkv_engine.cache.prefix_cache import PrefixCache
from confkv_engine.cache.readback import PrefixHit
from confkv_engine.cache.rewrite import rewrite_seq
from confkv_engine.cache.staging import HostStaging
from confkv_engine.cache.storage import DeviceKV
from confkv_engine.cache.streams import CacheStreams
from confkv_engine.cache.window_tables import WindowTables

__all__ = ["CacheSpec", "CompressResult", "EvictionSink", "KVCache", "PrefixHit", "SeqKV", "WritePlan"]


class KVCache(PrefixCache):
    def __init__(self, spec: CacheSpec, num_blocks: int, prefix_salt: bytes | None = None,
                 eviction_k: int = 2, sink: EvictionSink | None = None, chain_history: bool = True,
                 streams: CacheStreams | None = None) -> None:
        """``prefix_salt``: None turns the prefix cache off; else it names what changes stored K/V
        besides the tokens (model, dtype), so two models never share an entry. ``sink``: where
        evicted prefix blocks go (the disk store), None for none. ``chain_history`` False: the
        paper's LRU-K, without the chain history new blocks otherwise inherit (a benchmark peer).
        ``streams``: the side streams cache work runs on (``streams``; None: none, as on CPU)."""
        self.spec = spec
        self.streams = streams or CacheStreams.none()
        self.pool = BlockPool(num_blocks)
        # The stored bytes depend on the storage dtype and, when it differs, on the dtype K/V were
        # computed in (a bf16 pool of an fp32 model holds other values than one of a bf16 model).
        computed = "" if spec.compute_dtype == spec.dtype else f"|{spec.compute_dtype}"
        layout = f"|{spec.dtype}{computed}|{spec.block_size}".encode()
        # A grouped model has no prefix cache (``groups``: a hit would need every window group's window).
        salt = None if prefix_salt is None or spec.layer_groups else prefix_salt + layout
        self.prefix = None if salt is None else PrefixIndex(salt)
        self.eviction = LRUK(eviction_k, chain_history=chain_history)
        self.hits = HitCounter()
        self._clock = 0  # one tick per prefix lookup that admits a request
        self.sink = sink
        self.retired: list[int] = []  # taken out of use by a live lower size (never handed out)
        # Step metadata goes to the device through pinned buffers, without the host waiting.
        self.staging = HostStaging(spec.device)
        self.storage = DeviceKV(spec, num_blocks, self.staging)
        # Reserved now, so the blocks a KEY_ONLY demotion needs are never short.
        self.null_block = self.pool.allocate(1)[0]
        groups = spec.layer_groups
        self.windows = None if groups is None else WindowTables(
            groups, spec.block_size, self.null_block, self.take_blocks, self.free_blocks)
        self.store = CompressedStore(self.kv, self.pool)
        self._evictable_handles = 0  # compressed entries of evictable prefix blocks (no pool block)
        self._cold: dict[bytes, float] = {}  # evictable entries with a pool block: release time, oldest first

    @classmethod
    def from_budget(cls, spec: CacheSpec, budget_bytes: int, prefix_salt: bytes | None = None,
                    eviction_k: int = 2, sink: EvictionSink | None = None,
                    streams: CacheStreams | None = None) -> KVCache:
        num_blocks = budget_bytes // spec.block_bytes
        if num_blocks < 3:
            raise ValueError(
                f"KV cache budget of {budget_bytes} bytes holds {num_blocks} blocks of "
                f"{spec.block_bytes} bytes; at least 3 are needed (raise maxCacheSize)")
        return cls(spec, int(num_blocks), prefix_salt, eviction_k, sink, streams=streams)

    # ---- the device tensors (``storage.DeviceKV``; growth swaps them, so they are read through) ----
    @property
    def kv(self) -> Tensor:
        """The pool ``[L, num_blocks, bs, Hkv, D]`` in the cache dtype."""
        return self.storage.kv

    @property
    def kv_flat(self) -> Tensor:
        return self.storage.kv_flat

    @property
    def pos(self) -> Tensor:
        """Absolute position of every (layer, flat slot, KV head), int32, -1 = empty."""
        return self.storage.pos

    @property
    def scale(self) -> Tensor | None:
        """An int8 pool's fp16 scales per (layer, flat slot, KV head); None for float pools."""
        return self.storage.scale

    @property
    def kv_moved(self) -> Tensor:
        return self.storage.kv_moved

    @property
    def prefix_enabled(self) -> bool:
        """True when the prefix cache is on (a ``prefix_salt`` was given)."""
        return self.prefix is not None

    # ---- capacity --------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks sequences can hold: the pool less the null block and blocks retired by a lower
        ``maxCacheSize``."""
        return self.pool.num_blocks - 1 - len(self.retired)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can get now: the free list plus evictable cached blocks."""
        return (self.pool.num_free + 2 * len(self.eviction) - self._evictable_handles
                + self.store.reclaimable_hosts)

    @property
    def num_cached_blocks(self) -> int:
        """Pool blocks the prefix index holds (in use or evictable)."""
        return 2 * len(self.prefix) if self.prefix is not None else 0

    @property
    def total_bytes(self) -> int:
        """The pool's bytes in effect, the null block included: what ``maxCacheSize`` sizes (at
        start-up and live), so a client that sets ``maxCacheSize`` from this figure (the agent's
        lowerMaxCacheSize: 80% of it) gets exactly that size, rounded down to whole blocks."""
        return (self.num_blocks + 1) * self.spec.block_bytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the pool tensors (retired blocks included: they stay allocated)."""
        return self.pool.num_blocks * self.spec.block_bytes

    @property
    def reserved_bytes(self) -> int:
        """Pool bytes the cache keeps for itself (the null block): neither used nor free."""
        return self.spec.block_bytes

    @property
    def used_bytes(self) -> int:
        return (self.pool.num_used - 1 - len(self.retired)) * self.spec.block_bytes

    @property
    def reclaimable_bytes(self) -> int:
        """Pool bytes holding nothing a running request needs: free, evictable and retired blocks."""
        return (self.num_free + len(self.retired)) * self.spec.block_bytes

    def resize(self, num_blocks: int, memory_limit: int | None = None) -> int:
        """Live size change to ``num_blocks`` usable blocks. Lowering evicts cached blocks first and
        retires free ones; raising gives retired blocks back, then grows the pool
        (``storage.DeviceKV.grow``: ids, tables, prefix entries and arenas stay valid; the new ids
        join the free queue before the retired ones) within ``memory_limit`` bytes (None: what the
        machine can give a pool now). Raises ValueError, changing nothing, when running requests
        hold more or the machine cannot hold the pool. Returns the usable blocks now. Call it
        between two steps (the engine holds its lock)."""
        held = self.num_blocks - self.num_free  # blocks running requests hold
        if num_blocks < max(held, 2):
            raise ValueError(f"running requests hold {held * self.spec.block_bytes} bytes "
                             f"({held} blocks), more than the new size allows ({num_blocks} blocks)")
        if num_blocks > self.pool.num_blocks - 1:  # then the retired blocks come back
            self.storage.grow(num_blocks + 1, memory_limit)
            self.store.rebind(self.kv)
            self.pool.grow(num_blocks + 1)
        while self.num_blocks > num_blocks:
            self.retired.extend(self.take_blocks(1))
        if self.num_blocks < num_blocks:
            give = num_blocks - self.num_blocks
            back, self.retired = self.retired[:give], self.retired[give:]
            self.free_blocks(back)
        return self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def held_blocks(self, seq: SeqKV) -> int:
        """Pool blocks the sequence holds (K and V tables, window groups' included; null entries are
        nobody's)."""
        held = len(seq.k_blocks) + sum(1 for b in seq.v_blocks if b != self.null_block)
        return held + (self.windows.held(seq) if self.windows is not None else 0)

    def window_bytes(self, seq: SeqKV) -> int:
        """Bytes the sequence's window groups hold (0 without groups); ``seq_bytes`` leaves them out,
        since budgets bound the global layers only."""
        return self.windows.held(seq) * self.spec.block_bytes if self.windows is not None else 0

    def place(self, layer: int) -> tuple[int, int]:
        """(group, pool layer) of model layer ``layer``: ``groups.GLOBAL`` and the layer itself
        without groups."""
        groups = self.spec.layer_groups
        return (GLOBAL, layer) if groups is None else groups.place(layer)

    def seq_bytes(self, seq: SeqKV) -> int:
        """Bytes a sequence holds in the pool (K and V blocks, position metadata included; a
        compressed block counts its encoded bytes)."""
        blocks = [b for b in seq.k_blocks + seq.v_blocks if b != self.null_block]
        handles = [b for b in blocks if is_compressed(b)]
        return (len(blocks) - len(handles)) * self.spec.block_bytes + self.store.total_nbytes(handles)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a full (unevicted) cache of ``num_tokens`` needs between steps: K and V tables (and
        the window groups' windows)."""
        extra = self.windows.blocks_for_tokens(num_tokens) if self.windows is not None else 0
        return 2 * -(-num_tokens // self.spec.block_size) + extra

    def blocks_needed(self, seq: SeqKV, num_new: int) -> int:
        """Extra blocks needed to append ``num_new`` tokens."""
        per_table = -(-(seq.num_slots + num_new) // self.spec.block_size)
        extra = self.windows.needed(seq, num_new) if self.windows is not None else 0
        return max(0, per_table - len(seq.k_blocks)) + max(0, per_table - len(seq.v_blocks)) + extra

    # ---- tables ----------------------------------------------------------------------------
    def reserve(self, seq: SeqKV, num_new: int) -> None:
        """Allocate the blocks for ``num_new`` more slots (raises NoFreeBlocks, allocating nothing)."""
        per_table = -(-(seq.num_slots + num_new) // self.spec.block_size)
        need_k, need_v = max(0, per_table - len(seq.k_blocks)), max(0, per_table - len(seq.v_blocks))
        if self.windows is not None and self.blocks_needed(seq, num_new) > self.num_free:
            raise NoFreeBlocks(f"need {self.blocks_needed(seq, num_new)} blocks, {self.num_free} free "
                               f"or evictable of {self.num_blocks}")
        blocks = self.take_blocks(need_k + need_v)
        seq.k_blocks.extend(blocks[:need_k])
        seq.v_blocks.extend(blocks[need_k:])
        if self.windows is not None:
            self.windows.reserve(seq, num_new)

    def free(self, seq: SeqKV) -> None:
        """Drop the sequence's references (K table first, then V) and reset it. Its blocks the prefix
        index holds stay cached and become evictable, the chain's tail first."""
        self.free_blocks(seq.k_blocks)
        self.free_blocks([b for b in seq.v_blocks if b != self.null_block])
        for i in reversed(range(len(seq.block_keys))):
            entry = self.prefix.get(seq.block_keys[i]) if self.prefix is not None else None
            mine = entry is not None and entry.k_block == seq.k_blocks[i]
            if mine and self.store.ref(entry.k_block) == 1:
                self._mark_evictable(entry)
        seq.k_blocks, seq.v_blocks, seq.num_slots, seq.block_keys = [], [], 0, []
        if self.windows is not None:
            self.windows.release(seq)

    # ---- the one way blocks come and go (``owner.BlockOwner``) --------------------------------
    def take_blocks(self, n: int) -> list[int]:
        """``n`` blocks from the free list, evicting cached blocks (LRU-K order) when it runs short
        (raises NoFreeBlocks, taking nothing, when even that cannot give ``n``)."""
        if n > self.num_free:
            raise NoFreeBlocks(f"need {n} blocks, {self.num_free} free or evictable of {self.num_blocks}")
        while self.pool.num_free < n:
            self._evict_one()
        return self.pool.allocate(n)

    def _evict_one(self) -> None:
        key = self.eviction.victim()
        if key is None or self.prefix is None:
            raise NoFreeBlocks("no evictable cached block")
        entry = self.prefix.remove(key)
        self._set_idle(entry, -1)
        self._cold.pop(key, None)
        if self.sink is not None:  # the disk store decides whether the block deserves the disk
            self.sink.spill(entry, self.spill_payload(entry), self.eviction.uses(key))
        self.free_blocks([entry.k_block, entry.v_block])
        self.eviction.forget(key)

    def free_blocks(self, blocks: list[int]) -> None:
        """Drop one reference per entry of ``blocks`` (pool blocks and compressed handles alike, never
        the null block), in order. A pool block whose last reference goes has its slots marked empty;
        an arena a handle empties gives its hosts back to the pool (``CompressedStore.release``)."""
        drops = Counter(b for b in blocks if not is_compressed(b))
        self.storage.clear_positions([b for b, n in drops.items() if self.pool.ref_count(b) <= n])
        self.store.release(blocks)

    # ---- compression (``cache.compress``; ``store`` counts them and their bytes) -------------
    def compress_cold(self, bits: int, group: int, cold_after: float, limit: int,
                      now: float | None = None) -> CompressResult:
        """Compress up to ``limit`` blocks of evictable prefix entries unused for ``cold_after``
        seconds, the longest unused first."""
        now = time.monotonic() if now is None else now
        return compress_now(self, select_cold(self, bits, group, cold_after, limit, now))

    def compress_tables(self, seqs: list[SeqKV], eligible: list[int], bits: int, group: int,
                        limit: int) -> CompressResult:
        """Compress blocks ``[0, eligible[i])`` of ``seqs[i]`` (K and V tables), at most ``limit``.
        ``seqs`` must list every sequence holding blocks: a block is compressed only when its
        holders there plus the prefix index account for all its references."""
        return compress_now(self, select_tables(self, seqs, eligible, bits, group, limit))

    def slot_index(self, blocks: list[int], slots: Tensor) -> Tensor:
        """Flat pool index of slot numbers ``slots`` (any shape) through a block table."""
        bs = self.spec.block_size
        table = self.staging.send(blocks).to(slots.device)
        return table[slots // bs] * bs + slots % bs

    def plan_writes(self, seqs: list[SeqKV], num_new: list[int], positions: Tensor) -> WritePlan:
        """Flat K and V slots of a step's new tokens (reserved already), their positions recorded
        (``storage.DeviceKV.plan_writes``)."""
        return self.storage.plan_writes(seqs, num_new, positions)

    def write(self, layer: int, plan: WritePlan, k: Tensor, v: Tensor, group: int = GLOBAL) -> None:
        """Store a step's new keys and values [T, Hkv, D] (compute dtype) in pool layer ``layer``'s
        slots of the main tables or of window group ``group`` (``place``), cast to the pool's dtype."""
        self.storage.write(layer, plan, k, v, group)

    def commit(self, seq: SeqKV, num_new: int) -> None:
        """Record that ``num_new`` tokens were appended (after the forward pass succeeded); window
        groups then give back the blocks no later query reads."""
        seq.num_slots += num_new
        if self.windows is not None:
            seq.window_slots += num_new
            self.windows.trim(seq)

    def slot_positions(self, seq: SeqKV) -> Tensor:
        """Absolute positions in the sequence's K slots: [L, Hkv, num_slots] int32 (-1 = empty)."""
        bs, n = self.spec.block_size, seq.num_slots
        slots = torch.arange(n, device=self.pos.device)
        idx = self.slot_index([self.null_block if is_compressed(b) else b for b in seq.k_blocks], slots)
        out = self.pos[:, idx, :]
        self.store.fill_positions(out, seq.k_blocks, bs)
        return out.permute(0, 2, 1)

    def read_values(self, seq: SeqKV) -> Tensor:
        """The sequence's values as [L, Hkv, num_slots, D] fp32 on the CPU (for retention's merge)."""
        return torch.stack([self.read_table(seq.v_blocks, layer, seq.num_slots)
                            for layer in range(self.spec.num_layers)]).permute(0, 2, 1, 3).float().cpu()

    # ---- reading through compressed blocks ------------------------------------------------
    def gather_plan(self, table: list[int]) -> GatherPlan:
        """Precomputed gather of a block table (once per step); see ``gather``."""
        if not any(is_compressed(b) for b in table):  # the common case: one staged send
            return GatherPlan(self.staging.send(table), ())
        return self.store.plan(table, self.null_block, self.kv.device)

    def gather(self, layer: int, plan: GatherPlan) -> Tensor:
        """Layer ``layer`` of the planned blocks: [len(table), bs, Hkv, D] in the compute dtype
        (``spec.compute_dtype``), compressed blocks dequantized (a fresh tensor: callers may write it)."""
        scales = None if self.scale is None else self.scale[layer].view(self.kv.shape[1:4])
        return self.store.gather(self.kv[layer], layer, plan, self.spec.compute_dtype, scales)

    def read_table(self, table: list[int], layer: int, num_slots: int,
                   plan: GatherPlan | None = None) -> Tensor:
        """Slots ``[0, num_slots)`` of a block table in one layer: [num_slots, Hkv, D]."""
        spec = self.spec
        plan = plan or self.gather_plan(table[: -(-num_slots // spec.block_size)])
        rows = self.gather(layer, plan)
        return rows.view(-1, spec.num_kv_heads, spec.head_dim)[:num_slots]

    def read_keys_transposed(self, table: list[int], layers: range, num_slots: int,
                             plan: GatherPlan | None = None) -> Tensor:
        """Keys of slots ``[0, num_slots)`` of several layers as K^T: [len(layers), Hkv, D, num_slots]
        fp32 (a view with the table's row stride: it reshapes to [l * Hkv, D, num_slots] for free)."""
        spec = self.spec
        plan = plan or self.gather_plan(table[: -(-num_slots // spec.block_size)])
        if self.scale is not None:  # an int8 pool: its scales apply per layer
            keys = torch.stack([self.read_table(table, layer, num_slots, plan) for layer in layers])
            return keys.float().permute(0, 2, 3, 1).contiguous()
        kt = self.store.gather_keys_transposed(layers, plan)
        return kt.view(len(layers), spec.num_kv_heads, spec.head_dim, -1)[..., :num_slots]

    def rewrite(self, seq: SeqKV, order: Tensor, n_key: int, base: int = 0) -> int:
        """Keep, per (layer, KV head), the slots ``order[L, Hkv, n_new]`` lists, in that order. The
        first ``base`` slots (a shared prefix, whole blocks) must be listed in place and are left
        untouched; slots ``[base, base + n_key)`` keep only their keys (V-table entries wholly inside
        become the null block). Tail blocks go back to the pool now; returns blocks freed (net)."""
        return rewrite_seq(self, seq, order, n_key, base)
