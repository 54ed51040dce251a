"""Side streams for cache work (compression, disk spills, read-backs) and the events that order them.

On CUDA a step's kernels run on the *compute stream* (the stream current on the engine thread when
the parts were built). Cache work runs on side streams so it overlaps the steps instead of queueing
behind them, ordered by events only, never by a host synchronisation on the engine thread:

1. ``fence``: record an event on the compute stream once the source data is final (between two
   steps, under the engine lock); the side stream waits on it before it reads the pool.
2. The side work runs (``SideStream.running``) and records its own done-event (``record``).
3. ``hand_over``: before the engine uses the result (or writes a pool block the side stream still
   reads), the compute stream waits on that event; a tensor made on the side stream and read on the
   compute stream is marked as used there, so the caching allocator does not reuse its memory early.

``engine.cudaStreams`` is the number of side streams: spills use the first, read-backs the second,
and compression's encodes go round-robin over the rest (with one or two streams they share). On CPU
there are no streams: every method is a no-op and the same code runs inline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from itertools import cycle

import torch
from torch import Tensor

Event = torch.cuda.Event  # a recorded point of a stream; None stands for one on CPU


class SideStream:
    """One side stream, or none (CPU): the same calls work on both."""

    def __init__(self, stream: torch.cuda.Stream | None = None) -> None:
        self.stream = stream

    def wait(self, event: Event | None) -> None:
        """Order this stream's later work after ``event`` (a ``fence``)."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Issue the enclosed work on this stream."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def record(self) -> Event | None:
        """An event after the work issued so far (None on CPU)."""
        return None if self.stream is None else self.stream.record_event()


class CacheStreams:
    """The pool of side streams for cache work, and the compute stream they are ordered with."""

    def __init__(self, device: torch.device, count: int = 1) -> None:
        if count < 1:
            raise ValueError(f"cache work needs at least one side stream, got {count}")
        cuda = device.type == "cuda"
        self.compute = torch.cuda.current_stream(device) if cuda else None
        streams = [SideStream(torch.cuda.Stream(device) if cuda else None) for _ in range(count)]
        self.count = count
        self.spill = streams[0]
        self.readback = streams[1 % count]
        self._compression = cycle(streams[2:] or streams)

    @classmethod
    def none(cls) -> CacheStreams:
        """No side streams (CPU, and caches built outside an engine)."""
        return cls(torch.device("cpu"))

    def for_compression(self) -> SideStream:
        """The next compression stream (round-robin)."""
        return next(self._compression)

    def fence(self) -> Event | None:
        """An event on the compute stream: the pool as the steps issued so far leave it."""
        return None if self.compute is None else self.compute.record_event()

    def hand_over(self, event: Event | None, *tensors: Tensor | None) -> None:
        """The compute stream waits for ``event`` (side work done); ``tensors`` made on the side
        stream are marked as used by the compute stream."""
        if self.compute is None or event is None:
            return
        self.compute.wait_event(event)
        for t in tensors:
            if t is not None:
                t.record_stream(self.compute)


class PendingBytes:
    """Host bytes being copied off the device on a side stream: ``bytes()`` waits for the copy (on
    the thread that needs them, the disk writer, never the engine)."""

    def __init__(self, host: Tensor, done: Event | None = None) -> None:
        self._host, self._done = host, done

    def bytes(self) -> bytes:
        if self._done is not None:
            self._done.synchronize()
        return self._host.numpy().tobytes()


def copy_to_host(streams: CacheStreams, side: SideStream, parts: Callable[[], list[Tensor]]) -> PendingBytes:
    """The concatenated bytes of the tensors ``parts()`` reads off the device (any dtypes), as
    ``PendingBytes``: on CUDA read on ``side`` after a fence into a pinned buffer, the compute stream
    ordered after the copy (the blocks may be rewritten next step); on CPU a copy made now."""
    if streams.compute is None:
        return PendingBytes(_concat(parts()))
    side.wait(streams.fence())
    with side.running():
        data = _concat(parts())
        host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
        host.copy_(data, non_blocking=True)
    done = side.record()
    streams.hand_over(done)
    return PendingBytes(host, done)


def _concat(parts: list[Tensor]) -> Tensor:
    return torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in parts])
