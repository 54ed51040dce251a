"""``cache.staging.HostStaging``: lists reach the device as fresh tensors through one preallocated
host buffer per dtype, copied ``non_blocking`` (checked at the dispatcher: the copy is asked for
without waiting), and the buffer is written from the start again after ``begin_step``."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from confkv_engine.cache.staging import HostStaging


class _Copies(TorchDispatchMode):
    """Records the ``non_blocking`` flag of every ``copy_``."""

    def __init__(self) -> None:
        super().__init__()
        self.flags: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops.aten.copy_.default:
            self.flags.append(bool((kwargs or {}).get("non_blocking", args[2] if len(args) > 2 else False)))
        return func(*args, **(kwargs or {}))


def test_send_gives_fresh_tensors_with_the_values_and_dtype() -> None:
    staging = HostStaging(torch.device("cpu"), capacity=8)
    a = staging.send([1, 2, 3])
    b = staging.send([[4, 5], [6, 7]], torch.int32)
    assert a.tolist() == [1, 2, 3] and a.dtype == torch.long
    assert b.tolist() == [[4, 5], [6, 7]] and b.dtype == torch.int32
    a.fill_(0)  # a caller may write what it got: it never aliases the staging buffer
    assert staging.send([9]).tolist() == [9]
    assert not staging.pinned  # pinned only for a CUDA device


def test_sends_past_the_capacity_take_a_fresh_buffer_and_keep_earlier_tensors() -> None:
    staging = HostStaging(torch.device("cpu"), capacity=4)
    first = staging.send([1, 2, 3])
    big = staging.send(list(range(10)))
    assert first.tolist() == [1, 2, 3] and big.tolist() == list(range(10))
    staging.begin_step()
    assert staging.send([7, 8]).tolist() == [7, 8] and first.tolist() == [1, 2, 3]
    for _ in range(1000):  # many sends and no step: the buffer is replaced, never grown without bound
        assert staging.send([5, 6, 7]).tolist() == [5, 6, 7]
    assert staging.capacity(torch.long) <= 20


def test_the_device_copy_is_asked_for_without_waiting() -> None:
    staging = HostStaging(torch.device("cpu"))
    with _Copies() as copies:
        staging.send([1, 2, 3])
    # the first copy fills the host region (host to host), the second one goes to the device
    assert copies.flags == [False, True]
