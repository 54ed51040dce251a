"""The paged cache's value types: block layout (``CacheSpec``), pool budget, per-sequence tables.

Kept apart from ``kv_cache.KVCache`` (which owns all the state) so the attention backend and the
tests can name the layout without the cache's machinery; ``kv_cache`` re-exports every name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from confkv_engine.cache.groups import LayerGroups

log = logging.getLogger("confkv.cache")

# ``machine_cap``: on CPU a pool never takes more than half of the RAM available now (the model,
# activations and the OS need the rest); on CUDA no more than 90% of the memory free now.
CPU_AVAILABLE_CAP = 0.5
CUDA_FREE_CAP = 0.9

# ``confkv.kvCacheDtype`` -> the pool's storage dtype ("auto" is the model's dtype). fp8 is e4m3 with
# a per-tensor scale of 1.0, vLLM's default: finite values up to 448, beyond it they saturate. int8
# is symmetric with one fp16 scale per (layer, slot, KV head), kept beside the positions: a token's
# head row is quantized on its own when written, so nothing is re-quantized later.
CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "fp8": torch.float8_e4m3fn, "int8": torch.int8}
STORAGE_DTYPES = tuple(CACHE_DTYPES.values())
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
INT8_LEVELS = 127


def resolve_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype for a ``kvCacheDtype`` value (validated by the config already)."""
    if name == "auto":
        return model_dtype
    if name not in CACHE_DTYPES:
        raise ValueError(f"kvCacheDtype {name!r} is not supported by this engine; "
                         f"use auto or one of {', '.join(CACHE_DTYPES)}")
    return CACHE_DTYPES[name]


def int8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., D] -> int8 codes [..., D] and fp16 scales [...] (rounded up: |x| / scale <= 127), so
    every element decodes within scale / 2. Scales are capped at fp16's largest value."""
    wanted = x.float().abs().amax(-1) / INT8_LEVELS
    scales = wanted.clamp(max=65504.0).half()
    scales = torch.where(scales.float() < wanted, torch.nextafter(scales, torch.full_like(scales, torch.inf)),
                         scales).clamp(max=65504.0)
    safe = torch.where(scales > 0, scales.float(), torch.ones_like(wanted))
    codes = torch.round(x.float() / safe[..., None]).clamp_(-INT8_LEVELS, INT8_LEVELS)
    return codes.to(torch.int8), scales


def to_storage(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` cast to the pool's dtype; fp8 saturates at +-448 on every device (a plain cast may give
    nan on some), since keys and values beyond it are rare and a clipped one is still finite."""
    if dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def as_stored(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` [..., D] as a read of it from a pool of ``dtype`` gives it back (in ``x``'s dtype): what
    attention over freshly computed keys and values must see, so every read has the pool's precision.
    Free when the pool stores ``x``'s dtype."""
    if dtype == x.dtype:
        return x
    if dtype == torch.int8:
        codes, scales = int8_rows(x)
        return (codes.float() * scales.float()[..., None]).to(x.dtype)
    return to_storage(x, dtype).to(x.dtype)


@dataclass(frozen=True)
class CacheSpec:
    """Block layout. ``dtype`` is what the pool stores K/V in (``kvCacheDtype``), ``compute_dtype``
    what attention reads them as (the model's dtype; default: ``dtype``). ``num_layers``: the layers
    a block holds: the model's, or with ``layer_groups`` (sliding-window layers keeping only their
    window, ``groups``) one group's."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    compute_dtype: torch.dtype | None = None
    layer_groups: LayerGroups | None = None

    def __post_init__(self) -> None:
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"the KV pool stores {', '.join(map(str, STORAGE_DTYPES))}, not {self.dtype}")
        if self.compute_dtype is None:
            object.__setattr__(self, "compute_dtype", self.dtype)
        if self.compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"attention computes in float32, bfloat16 or float16, not {self.compute_dtype}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (K or V for block_size tokens over all layers) incl. position metadata
        (and an int8 pool's scales)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        scale = 2 if self.dtype == torch.int8 else 0
        per_slot = self.num_layers * self.num_kv_heads * (self.head_dim * elem + scale + 4)
        return per_slot * self.block_size


def machine_cap(device: torch.device) -> tuple[int, str]:
    """The most bytes a pool allocated now may take, and how that was decided (for messages)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(CUDA_FREE_CAP * free), f"{CUDA_FREE_CAP:.0%} of the free CUDA memory"
    import psutil

    available = psutil.virtual_memory().available
    available = min(available, _cgroup_headroom() or available)
    return int(CPU_AVAILABLE_CAP * available), f"{CPU_AVAILABLE_CAP:.0%} of the available RAM"


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


@dataclass
class SeqKV:
    """One sequence's view of the pool (its tables are written by ``KVCache`` only)."""

    # Entries are pool block ids or compressed-block handles (``block_pool.is_compressed``).
    k_blocks: list[int] = field(default_factory=list)
    v_blocks: list[int] = field(default_factory=list)
    num_slots: int = 0  # slots used, the same in every (layer, KV head)
    block_keys: list[bytes] = field(default_factory=list)  # chain keys of its leading full blocks
    # Window groups (``groups``): one table pair per group, slot = token; entries before
    # ``window_first`` went back to the pool (the null block stands in).
    windows: list[WindowTable] = field(default_factory=list)
    window_slots: int = 0  # tokens written into the window tables
    window_first: int = 0  # first table entry still held


@dataclass
class WindowTable:
    """One window group's K and V block tables of a sequence (written by ``groups.WindowTables``)."""

    k_blocks: list[int] = field(default_factory=list)
    v_blocks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class WritePlan:
    """Where a step's new keys and values go: flat pool slot indices [T], in the step's token order."""

    k_index: Tensor
    v_index: Tensor
    window_k: Tensor | None = None  # [window groups, T] the same for the window groups' tables
    window_v: Tensor | None = None


@dataclass
class CompressResult:
    """What one compression call did. ``pool_blocks_freed`` is net of arena growth (hosts taken)."""

    blocks: int = 0  # table blocks (K or V) now stored compressed
    pool_blocks_freed: int = 0
    bytes_freed: int = 0  # pool_blocks_freed x block_bytes (position metadata included)
    discarded: int = 0  # encodings dropped: their blocks changed while they were encoded

    def add(self, other: CompressResult) -> None:
        self.blocks += other.blocks
        self.pool_blocks_freed += other.pool_blocks_freed
        self.bytes_freed += other.bytes_freed
        self.discarded += other.discarded
