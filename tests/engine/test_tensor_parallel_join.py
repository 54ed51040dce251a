"""Forming a tensor-parallel group: a rank that arrives later than the collective timeout is still
waited for (the ranks meet at rank 0's TCP store within the join timeout, as torchrun's rendezvous
does), while a group whose peer never comes gives up after the join timeout with the count."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from confkv_engine.parallel.group import TensorParallelError, destroy_group, init_group
from testkit.ranks import free_port, spawn_ranks

COLLECTIVE_S = 3.0
LATE_S = 8.0  # well past the collective timeout


def _late_rank_main(rank: int, world: int, port: int, out: str) -> None:
    if rank == 1:
        time.sleep(LATE_S)
    group = init_group(rank, world, port, "cpu", timeout_s=COLLECTIVE_S, join_timeout_s=60)
    total = group.all_reduce(torch.tensor([rank + 1.0]))
    (Path(out) / f"rank{rank}.txt").write_text(str(total.item()))
    destroy_group()


def test_a_late_rank_is_waited_for(tmp_path: Path) -> None:
    spawn_ranks(_late_rank_main, 2, str(tmp_path))
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["3.0", "3.0"]


def test_a_missing_rank_is_given_up_on_after_the_join_timeout() -> None:
    with pytest.raises(TensorParallelError, match="only 1 of 2 tensor-parallel ranks joined"):
        init_group(0, 2, free_port(), "cpu", timeout_s=COLLECTIVE_S, join_timeout_s=2)
