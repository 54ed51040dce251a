"""The paged cache's value types: block layout (``CacheSpec``), pool budget, per-sequence tables.

Kept apart from ``kv_cache.KVCache`` (which owns all the state) so the attention backend and the
tests can name the layout without the cache's machinery; ``kv_cache`` re-exports every name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

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

    # Entries are pool block ids (>= 0) or compressed-block handles (< 0, see ``arena``).
    k_blocks: list[int] = field(default_factory=list)
    v_blocks: list[int] = field(default_factory=list)
    num_slots: int = 0  # slots used, the same in every (layer, KV head)
    block_keys: list[bytes] = field(default_factory=list)  # chain keys of its leading full blocks


@dataclass(frozen=True)
class WritePlan:
    """Where a step's new keys and values go: flat pool slot indices [T], in the step's token order."""

    k_index: Tensor
    v_index: Tensor


@dataclass
class CompressResult:
    """What one compression call did. ``pool_blocks_freed`` is net of arena growth (hosts taken)."""

    blocks: int = 0  # table blocks (K or V) now stored compressed
    pool_blocks_freed: int = 0
    bytes_freed: int = 0  # pool_blocks_freed x block_bytes (position metadata included)

    def add(self, other: CompressResult) -> None:
        self.blocks += other.blocks
        self.pool_blocks_freed += other.pool_blocks_freed
        self.bytes_freed += other.bytes_freed
