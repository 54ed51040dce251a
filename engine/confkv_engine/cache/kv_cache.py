"""Paged KV cache: device tensors, per-sequence block tables and slot metadata.

The cache is the only writer of block tables, pool reference counts and slot positions: the
attention backend asks it where a step's keys and values go (``plan_writes``), retention asks it to
rewrite a sequence by a plan (``rewrite``), the scheduler asks it to reserve and free.

Layout:

- **One pool of blocks** (``BlockPool``). A block is ``block_size`` token slots for *one* of K or V,
  over all layers: ``kv[L, num_blocks, block_size, Hkv, D]`` (model dtype). A sequence holds a K
  block table and a separate V block table drawn from the same pool, so dropping a token's V
  (KEY_ONLY) returns whole V blocks that are then usable as K or V by anyone. Full-cache cost:
  2 blocks per ``block_size`` tokens.
- **Slots, not positions.** K slot ``s`` of a sequence lives at ``kv[l, k_blocks[s // bs], s % bs]``
  for every layer l. Keys are stored after RoPE, and ``pos[l, flat_slot, h]`` (int32, -1 = empty)
  records the absolute position of the token in every slot, so retention can keep a different
  token set per (layer, KV head) at the same slot count and never re-rotates anything. A query sees
  exactly the slots below its own, so attention needs counts, not positions.
- **V slot s holds the value of K slot s.** When retention drops the values of a sequence's first
  slots (KEY_ONLY), the V-table entries that cover only such slots point at the **null block**, one
  block reserved when the cache is created and never handed out; it is not counted as anyone's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from confkv_engine.cache.block_pool import BlockPool

DEFAULT_CPU_CACHE_BYTES = 1 << 30
# On CPU a fraction ("80%") means that fraction of total RAM, but never more than half of the RAM
# available when the engine starts: the model, activations and the OS need the rest.
CPU_AVAILABLE_CAP = 0.5


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

    bytes: as given. Fraction: of free device memory on CUDA (measured now, after the model was
    loaded); on CPU of total RAM, capped at half the available RAM. Unset: 90% of free memory on
    CUDA, 1 GiB on CPU.
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        if max_cache_size is None:
            return int(0.9 * free)
        kind, value = max_cache_size
        return int(value) if kind == "bytes" else int(value * free)
    if max_cache_size is None:
        return DEFAULT_CPU_CACHE_BYTES
    kind, value = max_cache_size
    if kind == "bytes":
        return int(value)
    import psutil

    mem = psutil.virtual_memory()
    return int(min(value * mem.total, CPU_AVAILABLE_CAP * mem.available))


@dataclass
class SeqKV:
    """One sequence's view of the pool (its tables are written by ``KVCache`` only)."""

    k_blocks: list[int] = field(default_factory=list)
    v_blocks: list[int] = field(default_factory=list)
    num_slots: int = 0  # slots used, the same in every (layer, KV head)


@dataclass(frozen=True)
class WritePlan:
    """Where a step's new keys and values go: flat pool slot indices [T], in the step's token order."""

    k_index: Tensor
    v_index: Tensor


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
        # Reserved now, so the blocks a KEY_ONLY demotion needs are never short.
        self.null_block = self.pool.allocate(1)[0]

    @classmethod
    def from_budget(cls, spec: CacheSpec, budget_bytes: int) -> KVCache:
        num_blocks = budget_bytes // spec.block_bytes
        if num_blocks < 3:
            raise ValueError(
                f"KV cache budget of {budget_bytes} bytes holds {num_blocks} blocks of "
                f"{spec.block_bytes} bytes; at least 3 are needed (raise maxCacheSize)")
        return cls(spec, int(num_blocks))

    # ---- capacity --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks sequences can hold (the pool less the null block)."""
        return self.pool.num_blocks - 1

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.spec.block_bytes

    @property
    def used_bytes(self) -> int:
        return (self.pool.num_used - 1) * self.spec.block_bytes

    def can_allocate(self, n: int) -> bool:
        return self.pool.can_allocate(n)

    def held_blocks(self, seq: SeqKV) -> int:
        """Pool blocks the sequence holds (K and V tables; null entries are nobody's)."""
        return len(seq.k_blocks) + sum(1 for b in seq.v_blocks if b != self.null_block)

    def seq_bytes(self, seq: SeqKV) -> int:
        """Bytes a sequence holds in the pool (K and V blocks, position metadata included)."""
        return self.held_blocks(seq) * self.spec.block_bytes

    def shares_blocks(self, seq: SeqKV) -> bool:
        """True when another holder references one of the sequence's blocks (then they are immutable)."""
        ref = self.pool.ref_count
        return any(ref(b) > 1 for b in seq.k_blocks) or any(
            b != self.null_block and ref(b) > 1 for b in seq.v_blocks)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a full (unevicted) cache of ``num_tokens`` needs: K and V tables."""
        return 2 * -(-num_tokens // self.spec.block_size)

    def blocks_needed(self, seq: SeqKV, num_new: int) -> int:
        """Extra blocks needed to append ``num_new`` tokens."""
        per_table = -(-(seq.num_slots + num_new) // self.spec.block_size)
        return max(0, per_table - len(seq.k_blocks)) + max(0, per_table - len(seq.v_blocks))

    # ---- tables ----------------------------------------------------------------------------
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
        self.pool.free([b for b in seq.v_blocks if b != self.null_block])
        seq.k_blocks, seq.v_blocks, seq.num_slots = [], [], 0

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

    def plan_writes(self, seqs: list[SeqKV], num_new: list[int], positions: Tensor) -> WritePlan:
        """Flat K and V slots of a step's new tokens (reserved already), and record their positions."""
        bs, dev = self.spec.block_size, self.kv.device
        k_idx: list[int] = []
        v_idx: list[int] = []
        for s, n in zip(seqs, num_new, strict=True):
            for slot in range(s.num_slots, s.num_slots + n):
                k_idx.append(s.k_blocks[slot // bs] * bs + slot % bs)
                v_idx.append(s.v_blocks[slot // bs] * bs + slot % bs)
        plan = WritePlan(torch.tensor(k_idx, dtype=torch.long, device=dev),
                         torch.tensor(v_idx, dtype=torch.long, device=dev))
        self.pos[:, plan.k_index, :] = positions.to(dev, torch.int32)[None, :, None]
        return plan

    def commit(self, seq: SeqKV, num_new: int) -> None:
        """Record that ``num_new`` tokens were appended (after the forward pass succeeded)."""
        seq.num_slots += num_new

    def slot_positions(self, seq: SeqKV) -> Tensor:
        """Absolute positions in the sequence's K slots: [L, Hkv, num_slots] int32 (-1 = empty)."""
        slots = torch.arange(seq.num_slots, device=self.pos.device)
        idx = self.slot_index(seq.k_blocks, slots)
        return self.pos[:, idx, :].permute(0, 2, 1)

    def read_values(self, seq: SeqKV) -> Tensor:
        """The sequence's values as [L, Hkv, num_slots, D] fp32 on the CPU (for retention's merge)."""
        idx = self.slot_index(seq.v_blocks, torch.arange(seq.num_slots, device=self.kv.device))
        return self.kv_flat[:, idx].permute(0, 2, 1, 3).float().cpu()

    def rewrite(self, seq: SeqKV, order: Tensor, n_key: int) -> int:
        """Keep, per (layer, KV head), the slots ``order[L, Hkv, n_new]`` lists, moved to the front in that
        order; the first ``n_key`` keep only their keys (their V-table entries become the null block
        where a whole block is covered). Tail blocks go back to the pool now; returns blocks freed (net)."""
        spec, dev, bs = self.spec, self.kv.device, self.spec.block_size
        n_new = order.shape[-1]
        src = order.to(dev)
        layer = torch.arange(spec.num_layers, device=dev)[:, None, None]
        head = torch.arange(spec.num_kv_heads, device=dev)[None, :, None]
        k_src = self.slot_index(seq.k_blocks, src)
        keys, pos = self.kv_flat[layer, k_src, head], self.pos[layer, k_src, head]
        vals = self.kv_flat[layer, self.slot_index(seq.v_blocks, src[..., n_key:]), head]
        held_before = self.held_blocks(seq)

        nb = -(-n_new // bs)
        tail_k, tail_v = seq.k_blocks[nb:], seq.v_blocks[nb:]
        del seq.k_blocks[nb:], seq.v_blocks[nb:]
        self._clear_positions(tail_k)
        self.pool.free(tail_k + [b for b in tail_v if b != self.null_block])
        self._set_null_entries(seq, n_key // bs)

        dst = torch.arange(n_new, device=dev).expand_as(src)
        k_dst = self.slot_index(seq.k_blocks, dst)
        self.kv_flat[layer, k_dst, head] = keys
        self.kv_flat[layer, self.slot_index(seq.v_blocks, dst[..., n_key:]), head] = vals
        self.pos[layer, k_dst, head] = pos
        if n_new < nb * bs:  # the rest of the last block is empty now
            rest = self.slot_index(seq.k_blocks, torch.arange(n_new, nb * bs, device=dev))
            self.pos[:, rest, :] = -1
        seq.num_slots = n_new
        return held_before - self.held_blocks(seq)

    def _set_null_entries(self, seq: SeqKV, hole: int) -> None:
        """V-table entries below ``hole`` become the null block; the others real blocks."""
        for i, block in enumerate(seq.v_blocks):
            is_null = block == self.null_block
            if i < hole and not is_null:
                self.pool.free([block])
                seq.v_blocks[i] = self.null_block
            elif i >= hole and is_null:
                seq.v_blocks[i] = self.pool.allocate(1)[0]
