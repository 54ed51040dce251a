"""Step metadata sent to the device without the host waiting: ``HostStaging``.

A step's small integer tensors (input ids, positions, write slots, block tables, lengths, the rows
that sample) are built on the host from Python lists. ``torch.tensor(list, device=cuda)`` copies
from pageable memory, which makes the host wait for the stream; here each list is written into a
preallocated host buffer (pinned when the device is CUDA) and copied into a fresh device tensor
with ``non_blocking=True``, so the host goes on building the step while the copy is queued.

Reuse of the host buffer is what needs care: a region handed out in step n may still be read by
its queued copy when step n+1 starts. Each send records a CUDA event on the current stream (the
sender's, so a side stream's sends are covered too), and ``begin_step`` waits for those events
before the buffer is written from the start again. The engine's step already waits for the
sampled ids after all of its copies were queued, so that wait finds them done. A buffer that
fills up mid-step is replaced by a fresh one (the old one stays alive as long as a queued copy
holds it: PyTorch's pinned allocator keeps a block until the copies reading it have completed).

On a CPU device the same code runs: the copy is a plain memory copy into a fresh tensor, so a
caller may keep or write the tensor it got (it never aliases the staging buffer).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import Tensor

INITIAL_CAPACITY = 1 << 14  # elements per dtype; a decode step of 64 sequences needs a few hundred
MAX_EVENTS = 256


class HostStaging:
    """Preallocated host buffers (one per integer dtype) for a device's step metadata."""

    def __init__(self, device: torch.device, capacity: int = INITIAL_CAPACITY) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._capacity = capacity
        self._host: dict[torch.dtype, Tensor] = {}
        self._used: dict[torch.dtype, int] = {}
        self._events: list[torch.cuda.Event] = []
        self._lock = threading.Lock()  # sends may come from the step and from a worker thread

    def begin_step(self) -> None:
        """Start writing the buffers from the beginning, once the copies reading them are done."""
        with self._lock:
            for event in self._events:
                event.synchronize()
            self._events.clear()
            self._used = dict.fromkeys(self._used, 0)

    def send(self, values: Sequence[int] | Sequence[Sequence[int]] | Tensor,
             dtype: torch.dtype = torch.long) -> Tensor:
        """``values`` (a list, a list of equal-length lists, or a host tensor) as a fresh tensor on
        the device."""
        host = torch.as_tensor(values, dtype=dtype)
        n = host.numel()
        with self._lock:
            region = self._region(dtype, n)
            region.copy_(host.view(-1))
            out = torch.empty(host.shape, dtype=dtype, device=self.device)
            out.view(-1).copy_(region, non_blocking=True)
            if self.pinned:
                if len(self._events) >= MAX_EVENTS:  # sends with no step in between: drop done ones
                    self._events = [e for e in self._events if not e.query()]
                event = torch.cuda.Event()
                event.record()
                self._events.append(event)
        return out

    def capacity(self, dtype: torch.dtype) -> int:
        """Elements the host buffer of ``dtype`` holds now (0 before its first send)."""
        buf = self._host.get(dtype)
        return 0 if buf is None else buf.numel()

    def _region(self, dtype: torch.dtype, n: int) -> Tensor:
        buf, used = self._host.get(dtype), self._used.get(dtype, 0)
        if buf is None or used + n > buf.numel():
            # A fresh buffer of the same size (larger only for a larger send): sends with no step
            # in between (a worker's) never make it grow without bound.
            size = max(self._capacity if buf is None else buf.numel(), 2 * n)
            with torch.inference_mode(False):  # a normal tensor: written inside and outside steps
                buf = torch.empty(size, dtype=dtype, pin_memory=self.pinned)
            self._host[dtype], used = buf, 0
        self._used[dtype] = used + n
        return buf[used:used + n]


def send_pinned(values: Sequence[int] | Sequence[float] | Tensor, device: torch.device,
                dtype: torch.dtype | None = None) -> Tensor:
    """``values`` on ``device`` without the host waiting, for small per-row sampling inputs built
    where no ``HostStaging`` is at hand: a host tensor, pinned when the device is CUDA (PyTorch's
    pinned allocator keeps the block until the queued copy has read it), copied ``non_blocking``.
    On a CPU device the host tensor itself is returned."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
