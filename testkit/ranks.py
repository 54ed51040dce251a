"""Tensor-parallel ranks as real processes for tests: ``spawn_ranks`` starts ``target(rank, world,
port, *args)`` for every rank (``torch.multiprocessing`` spawn, one gloo group meeting on a free
local port) and fails unless every rank exits 0."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(target: Callable[..., None], world: int, *args: Any, timeout_s: float = 240.0) -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, world, port, *args)) for rank in range(world)]
    for proc in procs:
        proc.start()
    for rank, proc in enumerate(procs):
        proc.join(timeout_s)
        if proc.exitcode is None:
            proc.kill()
        assert proc.exitcode == 0, f"rank {rank} exited with {proc.exitcode}"
