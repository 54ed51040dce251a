"""The tensor-parallel process group and the three collectives the model needs.

One ``TPGroup`` per rank: ``torch.distributed`` with gloo on CPU and NCCL on CUDA, created with a
timeout, so a collective that waits on a dead rank raises instead of hanging (the launcher turns
that into the server's exit). Nothing here is a communication layer of its own: every collective
is ``torch.distributed``'s.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_TIMEOUT_SECONDS = 60.0


class TensorParallelError(ValueError):
    """A tensor-parallel setting this model or machine cannot serve."""


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world: int

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum over ranks, in place (the row-parallel linears' partial outputs)."""
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: Tensor) -> Tensor:
        """Concatenate every rank's ``x`` along the last dimension (vocabulary shards)."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; the step plan, small)."""
        box = [obj if self.is_leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def check_degree(world: int, num_heads: int, num_kv_heads: int) -> None:
    """Refuse a degree that does not split the query heads and the KV heads evenly."""
    if world < 1:
        raise TensorParallelError(f"tensorParallel must be >= 1, got {world}")
    bad = [f"{n} {what}" for n, what in ((num_heads, "query heads"), (num_kv_heads, "KV heads")) if n % world]
    if bad:
        raise TensorParallelError(
            f"tensorParallel {world} does not divide the model's {' and '.join(bad)}; "
            f"use a degree that divides both {num_heads} query heads and {num_kv_heads} KV heads")


def init_group(rank: int, world: int, master_port: int, device: str,
               timeout_s: float = DEFAULT_TIMEOUT_SECONDS, master_addr: str = "127.0.0.1",
               local_rank: int | None = None, join_timeout_s: float | None = None) -> TPGroup:
    """Join the group as ``rank`` (torchrun's environment: MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE).
    ``local_rank``: this process's index on its node (its GPU); the global rank on one node.
    ``join_timeout_s`` (default ``timeout_s``): how long the ranks may take to meet, at rank 0's
    TCP store, before the group forms; across nodes a peer may still be pulling its image or
    downloading the weights. Collectives afterwards time out after ``timeout_s``."""
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    join = join_timeout_s or timeout_s
    store = dist.TCPStore(master_addr, master_port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=join), wait_for_workers=False)
    _meet(store, world, join)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return TPGroup(rank, world)


def _meet(store: dist.TCPStore, world: int, timeout_s: float) -> None:
    """Wait until every rank has checked in at the store (the group's own set-up then waits for
    no one); raises TensorParallelError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    arrived = store.add("confkv/joined", 1)
    while arrived < world:
        if time.monotonic() > deadline:
            raise TensorParallelError(f"only {arrived} of {world} tensor-parallel ranks joined within "
                                      f"{timeout_s:.0f} s")
        time.sleep(0.2)
        arrived = store.add("confkv/joined", 0)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class KVHeadShards:
    """This rank's contiguous share of the KV heads, for the retention policy (``HeadShards``)."""

    group: TPGroup

    @property
    def world(self) -> int:
        return self.group.world

    def gather(self, x: Tensor) -> Tensor:
        # Retention's mirrors live on the host; NCCL moves device tensors only.
        on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else x.device
        y = x.to(on).contiguous()
        parts = [torch.empty_like(y) for _ in range(self.group.world)]
        dist.all_gather(parts, y)
        return torch.cat(parts, dim=1).to(x.device)

    def local(self, x: Tensor) -> Tensor:
        per = x.shape[1] // self.group.world
        return x[:, self.group.rank * per:(self.group.rank + 1) * per].contiguous()
