"""The disk store under tensor parallelism: every rank spills its own shard, and a read-back is
agreed by all ranks, so their caches (and so their schedules) stay identical.

**A shard per rank.** A rank's pool holds only its KV heads, so its spilled blocks are its shard
of each block (1/N of the bytes). Each rank's store lives in its own subdirectory of
``engine.cacheDir``, ``tp<N>-rank<r>`` (``rank_directory``): records of another degree or rank
(another shape) are never read, and a restart with the same degree finds each rank's shard again.

**Agreed read-backs.** On one GPU the read-back is asynchronous: the scheduler parks a request
until a reader thread has read what it could (``cache.readback``). Across ranks that timing (and
what each rank's writer has written so far, or dropped when its queue was full) differs, and
ranks that admitted a request at different steps, or with different hits, would stop being in
step. So under tensor parallelism ``start_load`` is synchronous and collective: every rank waits
for its pending spills, reads the chain from its own shard, and the ranks keep the longest run of
blocks that *every* rank read (the minimum, exchanged with ``all_gather_object``); the load is
returned already done with exactly those blocks (None, on every rank, when that run is empty).
Every rank asks for the same loads in the same order (its scheduler replays rank 0's), so the
collectives pair up. The cost: the engine step that admits such a request waits for the disk.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from confkv_engine.cache.disk.sink import DiskSink
from confkv_engine.cache.readback import ChainLink, ChainLoad
from confkv_engine.parallel.group import TPGroup

#: Seconds a rank waits for its own reader before counting what it has (a stuck disk reads as a miss).
READ_WAIT_SECONDS = 60.0


def rank_directory(cache_dir: str, group: TPGroup) -> str:
    return str(Path(cache_dir) / f"tp{group.world}-rank{group.rank}")


def landed(load: ChainLoad | None) -> int:
    """Links of ``load``, from the first, that are in memory or were read (install stops at a gap)."""
    if load is None:
        return 0
    count = 0
    for link in load.links:
        if not (link.cached or link.key in load.pairs):
            break
        count += 1
    return count


class RankDiskSink(DiskSink):
    """This rank's ``DiskSink`` on its own directory, with collective read-backs (module docstring)."""

    def __init__(self, cache_dir: str, group: TPGroup) -> None:
        super().__init__(rank_directory(cache_dir, group))
        self.group = group

    def start_load(self, links: list[ChainLink], shape: tuple[int, ...], dtype: torch.dtype,
                   scale_shape: tuple[int, ...] | None = None, pin: bool = False) -> ChainLoad | None:
        self.flush()  # what this rank spilled is on its disk before it looks
        load = super().start_load(links, shape, dtype, scale_shape, pin)
        if load is not None:
            load.done.wait(READ_WAIT_SECONDS)
        counts: list[int | None] = [None] * self.group.world
        dist.all_gather_object(counts, landed(load) if load is not None and load.done.is_set() else 0)
        agreed = min(int(c or 0) for c in counts)
        if load is None or not any(not link.cached for link in load.links[:agreed]):
            return None
        kept = {link.key for link in load.links[:agreed]}
        finished = ChainLoad(load.links[:agreed], load.shape, load.dtype, load.scale_shape,
                             {k: v for k, v in load.pairs.items() if k in kept})
        finished.done.set()
        return finished
