"""Static-buffer decode: CUDA graphs on CUDA, the same buffers run eagerly elsewhere.

``DecodeRunner`` owns one set of static input buffers sized for the largest decode batch: input
ids, positions, the write slots of K and V, the block tables padded to the most blocks a sequence
can hold (``ceil(max_model_len / block_size)``), the context lengths, and the constant per-row query
starts/lengths the paged kernels read. A decode batch of ``b`` sequences runs at the smallest
padded size ``>= b`` (``padded_sizes``: 1, 2, 4, 8, 16, then steps of 16, the last one
``maxBatchSize``): the step's rows are written into the first ``b`` rows of the buffers, and the
model runs over the first ``size`` rows with attention reading the pool in place through the block
tables (``attention.kernels``: the Triton kernel on CUDA, the CPU kernel elsewhere), no gather.

**Padding rows** take token 0 at position 0, write their K and V into slot 0 of the cache's null
block (reserved at start-up and never handed to a sequence; every reader of it masks it or
stands a value in for it) and attend that one slot. They touch no sequence's block, and their
positions are never recorded (the real rows' are, through ``KVCache.plan_writes``).

**On CUDA** (``engine.cudaGraphs``, on by default; ``--enforce-eager`` turns it off) every padded
size is captured once as a ``torch.cuda.CUDAGraph`` at start-up, after the memory plan has sized
the pool: largest size first, all sizes sharing one graph memory pool (a smaller graph's
activations fit in what the larger one reserved), each after two warm-up passes on a side stream
(Triton compiles its kernels and cuBLAS picks its workspaces outside the capture). A step then
only copies its rows into the buffers and replays. Elsewhere the same buffers run eagerly: the
path the CPU tests check against the eager engine.

**What a captured graph holds** is the static buffers and the pool tensor. The buffers are
rewritten every step from the sequences' tables, so a retention decision, a compaction or a
prefix-cache hit (all of which change tables) needs nothing refreshed. A pool resize reallocates
the pool tensor: the runner notices (the pool's storage changed) and captures again before its
next replay.

**Which batches fall back to the eager path** (``PagedAttention`` / ``RetentionAttention``), the
whole step at once:

- a step with a prefill chunk (more than one new token for some sequence);
- a sequence under a retention policy (conf-kv, h2o, streaming, ...): it records queries and
  positions on the host every step and stands values in for KEY_ONLY slots;
- a table holding a compressed block (mixed block kinds: the kernel would need a side tensor of
  decoded blocks, whose size changes from step to step);
- a pool whose dtype the paged kernels do not read in place (int8 / fp8: ``kernels.FLOAT_POOLS``),
  or a kernel the device lacks (``kernels.kernel_for`` answered None);
- a batch larger than ``maxBatchSize`` (never scheduled) or a model under tensor parallelism,
  which is given no runner (its collectives are not captured).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from confkv_engine.attention.kernels import PagedBatch, PagedKernel, kernel_for
from confkv_engine.cache.block_pool import is_compressed
from confkv_engine.cache.kv_cache import KVCache, SeqKV, WritePlan

log = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8, 16)
STEP = 16
WARMUP_PASSES = 2


def padded_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, then steps of 16, up to and including ``max_batch_size``."""
    sizes = [s for s in SMALL_SIZES if s < max_batch_size]
    sizes += list(range(SMALL_SIZES[-1] + STEP, max_batch_size, STEP))
    return [*sizes, max_batch_size]


def padded_size(n: int, sizes: Seq[int]) -> int:
    """The smallest size that holds ``n`` rows."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"a decode batch of {n} is larger than the largest padded size {sizes[-1]}")


class StaticAttention:
    """The attention backend of the static path: writes the step's K and V into the buffered slots
    and attends through the buffered tables with a paged kernel (the pool read where it lies)."""

    def __init__(self, cache: KVCache, kernel: PagedKernel, batch: PagedBatch, writes: WritePlan) -> None:
        self.cache, self.kernel, self.batch, self.writes = cache, kernel, batch, writes

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
        self.cache.write(layer, self.writes, k, v)
        out, _ = self.kernel(q, self.cache.kv[layer], self.batch, None, None, window=window)
        return out


@dataclass
class _Buffers:
    """The static inputs, ``rows`` rows each (the largest padded size)."""

    ids: Tensor  # [rows] long
    positions: Tensor  # [rows] long
    slots: Tensor  # [2, rows] long: flat K slots, flat V slots
    tables: Tensor  # [2, rows, width] int32: K tables, V tables
    seq_lens: Tensor  # [rows] int32
    q_start: Tensor  # [rows] int32, constant 0..rows-1
    q_len: Tensor  # [rows] int32, constant 1
    key_only: Tensor  # [rows, 2] int32, constant 0

    @classmethod
    def allocate(cls, rows: int, width: int, device: torch.device) -> _Buffers:
        def ints(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        return cls(torch.zeros(rows, dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device),
                   torch.zeros(2, rows, dtype=torch.long, device=device), ints(2, rows, width), ints(rows),
                   torch.arange(rows, dtype=torch.int32, device=device), ints(rows) + 1, ints(rows, 2))


class DecodeRunner:
    """Decode steps over static buffers (see the module docstring); one owner of the buffers."""

    def __init__(self, model: Any, cache: KVCache, max_batch_size: int, max_model_len: int,
                 graphs: bool) -> None:
        """``graphs``: capture CUDA graphs (only on a CUDA pool; elsewhere the path runs eagerly)."""
        spec = cache.spec
        kernel = kernel_for(spec.device, spec.dtype, spec.block_size, spec.head_dim)
        if kernel is None:
            raise ValueError(f"no paged kernel reads a {spec.dtype} pool on {spec.device} in place")
        self.model, self.cache, self.kernel = model, cache, kernel
        self.sizes = padded_sizes(max_batch_size)
        self.width = -(-max_model_len // spec.block_size)
        self.graphs_wanted = graphs and spec.device.type == "cuda"
        self.buf = _Buffers.allocate(self.sizes[-1], self.width, spec.device)
        self._scratch = cache.null_block * spec.block_size  # slot 0 of the null block
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool_storage: int | None = None  # the pool tensor the graphs were captured over
        self.steps = 0  # decode steps run on this path (a counter for tests and metrics)
        self.last_size = 0  # the padded size of the last step
        self._pad(0, self.sizes[-1])

    @staticmethod
    def supported(cache: KVCache) -> bool:
        """Whether the pool can be read in place by a kernel on its device (one table per sequence)."""
        spec = cache.spec
        if spec.layer_groups is not None:  # window groups are read through their own tables (eager)
            return False
        return kernel_for(spec.device, spec.dtype, spec.block_size, spec.head_dim) is not None

    @property
    def captured(self) -> list[int]:
        """Padded sizes with a captured graph (none off CUDA)."""
        return sorted(self._graphs)

    def accepts(self, seqs: list[SeqKV], num_new: list[int], states: list[Any]) -> bool:
        """Whether this step can run here (the module docstring lists what falls back)."""
        if not seqs or len(seqs) > self.sizes[-1] or any(n != 1 for n in num_new):
            return False
        if any(st is not None for st in states):
            return False
        if max(max(len(s.k_blocks), len(s.v_blocks)) for s in seqs) > self.width:
            return False
        # Handles are negative (``block_pool.is_compressed``); min() keeps the scan in C.
        return not any(s.k_blocks and is_compressed(min(min(s.k_blocks), min(s.v_blocks))) for s in seqs)

    def run(self, seqs: list[SeqKV], ids: list[int], positions: list[int]) -> Tensor:
        """One decode step of ``seqs`` (slots reserved): hidden states [len(seqs), H]; the appended
        slots are committed."""
        b = len(seqs)
        size = self.last_size = padded_size(b, self.sizes)
        if self.graphs_wanted and self._pool_storage != self.cache.kv.untyped_storage().data_ptr():
            self.capture()  # first use, or a resize reallocated the pool (before the rows are written)
        self._fill(seqs, ids, positions)
        self._pad(b, size)
        if self.graphs_wanted:
            graph, out = self._graphs[size]
            graph.replay()
        else:
            out = self._forward(size)
        for s in seqs:
            self.cache.commit(s, 1)
        self.steps += 1
        return out[:b]

    # ---- buffers -------------------------------------------------------------------------------
    def _fill(self, seqs: list[SeqKV], ids: list[int], positions: list[int]) -> None:
        """The step's rows into the first ``len(seqs)`` rows of the buffers (staged sends, then
        device-to-device copies; the positions are recorded in the pool by ``plan_writes``)."""
        b, buf, staging = len(seqs), self.buf, self.cache.staging
        both = staging.send([ids, positions])
        buf.ids[:b].copy_(both[0])
        buf.positions[:b].copy_(both[1])
        plan = self.cache.plan_writes(seqs, [1] * b, buf.positions[:b])
        buf.slots[0, :b].copy_(plan.k_index)
        buf.slots[1, :b].copy_(plan.v_index)
        widest = max(len(t) for s in seqs for t in (s.k_blocks, s.v_blocks))
        tables = [[*t, *[0] * (widest - len(t))] for s in seqs for t in (s.k_blocks, s.v_blocks)]
        sent = staging.send(tables, torch.int32).view(b, 2, widest).transpose(0, 1)
        buf.tables[:, :b, :widest].copy_(sent)
        buf.seq_lens[:b].copy_(staging.send([s.num_slots + 1 for s in seqs], torch.int32))

    def _pad(self, lo: int, hi: int) -> None:
        """Rows ``[lo, hi)`` become padding rows (token 0, position 0, the scratch slot, one slot
        visible); they may hold an earlier, larger step's rows."""
        if lo >= hi:
            return
        buf = self.buf
        buf.ids[lo:hi] = 0
        buf.positions[lo:hi] = 0
        buf.slots[:, lo:hi] = self._scratch
        buf.tables[:, lo:hi, 0] = self.cache.null_block
        buf.seq_lens[lo:hi] = 1

    def _batch(self, size: int) -> PagedBatch:
        buf = self.buf
        return PagedBatch(buf.tables[0, :size], buf.tables[1, :size], buf.seq_lens[:size],
                          buf.q_start[:size], buf.q_len[:size], buf.key_only[:size], 1,
                          self.cache.spec.block_size)

    def _forward(self, size: int) -> Tensor:
        attn = StaticAttention(self.cache, self.kernel, self._batch(size),
                               WritePlan(self.buf.slots[0, :size], self.buf.slots[1, :size]))
        return self.model(self.buf.ids[:size], self.buf.positions[:size], attn)

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every padded size (CUDA only): largest first, one shared memory pool, each after
        warm-up passes on a side stream. The buffers hold padding rows only while capturing."""
        if not self.graphs_wanted:
            return
        self._graphs.clear()
        self._pad(0, self.sizes[-1])
        device, start = self.cache.spec.device, time.perf_counter()
        torch.cuda.synchronize(device)
        pool = None
        with torch.inference_mode():
            for size in sorted(self.sizes, reverse=True):
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_PASSES):
                        self._forward(size)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(size)
                pool = graph.pool()
                self._graphs[size] = (graph, out)
        torch.cuda.synchronize(device)
        self._pool_storage = self.cache.kv.untyped_storage().data_ptr()
        log.info("captured decode CUDA graphs at batch sizes %s in %.1f s", self.sizes,
                 time.perf_counter() - start)
