"""Memory planned before serving: how many bytes the KV pool gets, decided once from measured figures.

Pure arithmetic over numbers a reader measured (``cache.memory`` reads them; a test passes its own),
so the same code sizes an 80 GB GPU and this repository's CPU machine:

- ``maxCacheSize`` as a **fraction** is of the device's *total* memory, as vLLM's
  ``gpu_memory_utilization``: the engine as a whole may use that share, so the pool gets it less the
  weights, the activation peak of the largest step (measured by a profiling step on CUDA), the decode
  gather bound (attention's largest read of the pool, ``decode_gather_bound``) and a reserve (memory
  outside torch's allocator: the CUDA context, library workspaces, plus a fixed margin for
  fragmentation). ``80%`` of an 80 GB card with 65.5 GB of weights leaves nothing, and says so.
- As **bytes** the pool is that size.
- **Unset**: 90% of total memory on CUDA (vLLM's default), 1 GiB on CPU.

Whatever was asked, the pool never takes more than is free now less the activation, gather and
reserve bytes (another process on the GPU, or on CPU the host cap of ``layout.machine_cap``): a
larger request is capped and the plan says by what. When nothing is left for a pool of the minimum
size, ``NoMemoryLeft`` names every figure and what would fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_CUDA_FRACTION = 0.9
DEFAULT_CPU_POOL_BYTES = 1 << 30
# The decode step's gather of K and V is split by rows so that one layer's read never exceeds this
# (or one row at the longest context, whichever is larger): at the 32B example's settings a padded
# gather of 64 rows of 32K tokens would be 8 GiB per layer.
DEFAULT_GATHER_BYTES = 512 * MiB
CUDA_RESERVE_MARGIN = 256 * MiB  # allocator fragmentation beyond the measured non-torch memory


class NoMemoryLeft(ValueError):
    """The weights, activations and reserve leave no room for a KV pool of the minimum size."""


@dataclass(frozen=True)
class DeviceFigures:
    """What a memory reader measured, after the weights were loaded and before the pool exists."""

    device: str  # 'cuda:0', 'cpu'
    total_bytes: int  # the device's memory (on CPU: RAM, or the memory cgroup's limit)
    free_bytes: int  # what a pool may take now at most (CUDA: free memory; CPU: the host cap)
    weights_bytes: int
    reserve_bytes: int = 0  # memory outside torch's allocator, plus a margin (CUDA)


@dataclass(frozen=True)
class MemoryPlan:
    figures: DeviceFigures
    activation_bytes: int  # the profiled peak of the largest step, the allocator's reserve included
    gather_bytes: int  # the decode gather bound the attention backend is held to
    pool_bytes: int
    request: str  # how maxCacheSize was read, for messages
    capped_by: str | None = None  # set when the request was larger than what fits now

    @property
    def overhead_bytes(self) -> int:
        f = self.figures
        return f.weights_bytes + self.activation_bytes + self.gather_bytes + f.reserve_bytes

    def lines(self) -> list[str]:
        """The figures printed at start-up, one per line."""
        f = self.figures
        out = [f"memory plan on {f.device}: total {_gib(f.total_bytes)}, free now {_gib(f.free_bytes)}",
               f"  weights {_gib(f.weights_bytes)}, activation peak {_gib(self.activation_bytes)}, "
               f"decode gather bound {_gib(self.gather_bytes)}, reserve {_gib(f.reserve_bytes)}",
               f"  KV pool {_gib(self.pool_bytes)} ({self.request})"]
        if self.capped_by:
            out.append(f"  capped: {self.capped_by}")
        return out


def decode_gather_bound(slot_bytes: int, max_model_len: int, max_batch_size: int,
                        limit: int = DEFAULT_GATHER_BYTES) -> int:
    """Bytes one layer's decode gather may take: ``limit``, but at least one row at the longest
    context (a row cannot be split) and at most the whole batch at it (nothing larger is ever read).
    ``slot_bytes``: K and V of one token in one layer as the gather holds them."""
    row = slot_bytes * max_model_len
    return max(row, min(limit, row * max_batch_size))


def plan_memory(max_cache_size: tuple[str, float] | None, figures: DeviceFigures, activation_bytes: int,
                gather_bytes: int, min_pool_bytes: int = 1) -> MemoryPlan:
    """The pool's bytes for a parsed ``maxCacheSize`` (``confkv_api.units.parse_size``)."""
    plan = MemoryPlan(figures, activation_bytes, gather_bytes, 0, "")
    if max_cache_size is None:
        on_cuda = figures.device.startswith("cuda")
        max_cache_size = ("fraction", DEFAULT_CUDA_FRACTION) if on_cuda else ("bytes", DEFAULT_CPU_POOL_BYTES)
    kind, value = max_cache_size
    if kind == "bytes":
        wanted, request = int(value), f"maxCacheSize {_gib(int(value))}"
    else:
        share = int(value * figures.total_bytes)
        wanted = share - plan.overhead_bytes
        request = (f"{value:.0%} of total = {_gib(share)}, less weights, activation peak, "
                   f"gather bound and reserve")
        if wanted < min_pool_bytes:
            needed = math.ceil(1000 * (plan.overhead_bytes + min_pool_bytes) / figures.total_bytes) / 10
            raise NoMemoryLeft(
                f"maxCacheSize {value:.0%} of {_gib(figures.total_bytes)} total on {figures.device} is "
                f"{_gib(share)}, which leaves no KV pool after weights {_gib(figures.weights_bytes)}, "
                f"activation peak {_gib(activation_bytes)}, decode gather bound {_gib(gather_bytes)} "
                f"and reserve {_gib(figures.reserve_bytes)}: give at least {needed:.1f}%, or a size "
                f"in bytes")
    fits = figures.free_bytes - activation_bytes - gather_bytes - figures.reserve_bytes
    if fits < min_pool_bytes:
        raise NoMemoryLeft(
            f"no memory left for a KV pool on {figures.device}: {_gib(figures.free_bytes)} free after "
            f"the weights ({_gib(figures.weights_bytes)}), less activation peak {_gib(activation_bytes)}, "
            f"decode gather bound {_gib(gather_bytes)} and reserve {_gib(figures.reserve_bytes)}")
    if wanted > fits:
        return replace(plan, pool_bytes=fits, request=request,
                       capped_by=f"{request} asks for {_gib(wanted)}; {_gib(fits)} fit now "
                                 f"(free {_gib(figures.free_bytes)} less activation, gather and reserve)")
    return replace(plan, pool_bytes=wanted, request=request)


def requested_pool_bytes(plan: MemoryPlan, max_cache_size: tuple[str, float] | None) -> int:
    """A live ``maxCacheSize``: the bytes it asks for, uncapped, by the start-up plan's figures, so a
    fraction means the same live as at start-up (what fits now is checked by the pool's growth).
    Raises ``NoMemoryLeft`` when a fraction leaves nothing."""
    figures = replace(plan.figures, free_bytes=1 << 62)  # uncapped: growth checks what fits now
    return plan_memory(max_cache_size, figures, plan.activation_bytes, plan.gather_bytes).pool_bytes


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"
