"""Asyncio front of the synchronous ``LLMEngine``.

One dedicated thread owns the engine: it applies queued submissions and aborts, calls ``step()``
while there is work, and sleeps on a condition variable when idle (no busy spin; it wakes once a
second to refresh the stats snapshot). Outputs are
handed to per-request ``asyncio.Queue``s on the caller's loop with ``call_soon_threadsafe``, so the
event loop never waits for the model and ``/health`` answers while a long generation runs.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from confkv_engine.core.control_api import EngineStats
from confkv_engine.core.engine import QueueFull
from confkv_engine.core.outputs import RequestOutput
from confkv_engine.core.sampling_params import InvalidRequest, SamplingParams

log = logging.getLogger(__name__)

IDLE_REFRESH_SECONDS = 1.0

__all__ = ["AsyncEngine", "EngineUnavailable", "QueueFull", "configure_torch_threads"]


class EngineUnavailable(Exception):
    """The engine is draining for shutdown, or its thread has stopped; the HTTP layer answers 503."""


class EngineLike(Protocol):
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> EngineStats: ...


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (a pod's
    ``resources.limits.cpu``; ``os.cpu_count`` reports the node's cores, not the pod's)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit visible
    return max(1, cores)


def default_threads(cores: int) -> int:
    """Intra-op threads for ``cores`` usable cores. The engine thread runs the model; the event loop
    (HTTP, SSE, tokenisation) and the gRPC threads mostly wait, but a burst of theirs that preempts
    an OpenMP worker stalls every barrier of the step, so from 4 cores on one core is left to them.
    Below that a core is a third or more of the step's compute, worth more than the rare bursts."""
    return cores - 1 if cores >= 4 else cores


def configure_torch_threads(threads: int | None) -> int:
    """Set torch's intra-op threads from ``threads``, else ``CONFKV_THREADS``, else
    ``default_threads(usable_cores())``; inter-op threads are 1 (the engine never forks torch work,
    and every extra pool thread would compete with the intra-op workers)."""
    import torch

    if threads is None:
        env = os.environ.get("CONFKV_THREADS", "").strip()
        threads = int(env) if env else default_threads(usable_cores())
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or inter-op work already ran in this process (tests)
        log.debug("inter-op threads already fixed at %d", torch.get_num_interop_threads())
    return threads


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    accepted: asyncio.Future
    finished: bool = False


@dataclass
class _Pending:
    adds: list[tuple[str, list[int], SamplingParams]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


class AsyncEngine:
    """Thread-owned engine with an async ``generate``."""

    def __init__(self, engine: EngineLike,
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 on_aborted: Callable[[str], None] | None = None) -> None:
        self._engine = engine
        self._on_finished = on_finished
        self._on_aborted = on_aborted
        self._cond = threading.Condition()
        self._pending = _Pending()
        self._streams: dict[str, _Stream] = {}
        self._draining = False
        self._stopped = False
        self._thread_error: BaseException | None = None
        self._stats: EngineStats = engine.stats()
        self._in_engine: set[str] = set()  # engine thread only: ids the engine holds
        self._thread = threading.Thread(target=self._run, name="confkv-engine", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def begin_drain(self) -> None:
        """Refuse new requests from now on; the ones in flight run to completion."""
        with self._cond:
            self._draining = True

    async def drain_and_stop(self, timeout: float | None = None) -> None:
        """Wait for in-flight requests to finish, then stop the engine thread."""
        self.begin_drain()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.num_in_flight() and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)
        if self.num_in_flight():  # the drain timed out: end the stragglers' streams
            self._fail_all(EngineUnavailable("the server shut down before the request finished"))

    # ---- snapshot for metrics and admission ------------------------------------------------
    def stats(self) -> EngineStats:
        """The engine's stats after the last step (read without touching the engine)."""
        return self._stats

    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._streams)

    # ---- the caller's side -----------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_ids: list[int],
                          params: SamplingParams) -> RequestStream:
        """Submit a request; returns once the engine accepted it (raises InvalidRequest, QueueFull,
        EngineUnavailable), so HTTP errors are known before a streaming response starts."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop=loop, queue=asyncio.Queue(), accepted=loop.create_future())
        with self._cond:
            if self._draining or self._stopped or self._thread_error is not None:
                raise EngineUnavailable("the server is shutting down" if self._draining
                                        else "the engine is not running")
            if request_id in self._streams:
                raise InvalidRequest(f"duplicate request id {request_id!r}")
            # The waiting-queue bound (maxWaiting) is enforced by the engine itself when the engine
            # thread applies this submission: exact, and reported here through ``accepted``.
            self._streams[request_id] = stream
            self._pending.adds.append((request_id, list(prompt_ids), params))
            self._cond.notify()
        try:
            await stream.accepted
        except BaseException:
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, stream)

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; abandoning the iterator aborts it."""
        outputs = await self.add_request(request_id, prompt_ids, params)
        async for out in outputs:
            yield out

    def abort(self, request_id: str) -> None:
        with self._cond:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return
            stream.finished = True
            self._pending.aborts.append(request_id)
            self._cond.notify()
        if self._on_aborted is not None:
            self._on_aborted(request_id)

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        busy = False
        try:
            while True:
                with self._cond:
                    if not (busy or self._pending.adds or self._pending.aborts or self._stopped):
                        # Idle: wake now and then anyway, so the snapshot shows what changed between
                        # steps (a compression, a live resize, the background worker's passes).
                        self._cond.wait(IDLE_REFRESH_SECONDS)
                    pending, self._pending = self._pending, _Pending()
                    stopping = self._stopped
                self._apply(pending)  # on stop too: late aborts still free their blocks
                if stopping:
                    return
                busy = self._engine.has_unfinished()
                if busy:
                    self._step()
                    busy = self._engine.has_unfinished()
                self._refresh_stats()
        except BaseException as err:  # a bug in the engine: fail every request instead of hanging
            log.exception("engine thread crashed")
            self._fail_all(err)

    def _apply(self, pending: _Pending) -> None:
        for request_id in pending.aborts:
            if request_id in self._in_engine:
                self._in_engine.discard(request_id)
                self._engine.abort_request(request_id)
        for request_id, prompt_ids, params in pending.adds:
            with self._cond:
                stream = self._streams.get(request_id)
            if stream is None:  # aborted before the engine saw it
                continue
            try:
                self._engine.add_request(request_id, prompt_ids, params)
            except Exception as err:  # InvalidRequest mostly; anything else is reported the same way
                with self._cond:
                    self._streams.pop(request_id, None)
                    stream.finished = True
                stream.loop.call_soon_threadsafe(_set_exception, stream.accepted, err)
                continue
            self._in_engine.add(request_id)
            stream.loop.call_soon_threadsafe(_set_result, stream.accepted)

    def _step(self) -> None:
        outputs = self._engine.step()
        for out in outputs:
            if out.finished:
                self._in_engine.discard(out.request_id)
            with self._cond:
                stream = self._streams.get(out.request_id)
                if stream is not None and out.finished:
                    del self._streams[out.request_id]
                    stream.finished = True
            if stream is None:  # aborted by its consumer: already counted
                continue
            if out.finished and self._on_finished is not None:
                self._on_finished(out)
            # A snapshot: the engine may reuse and mutate its output objects on the next step.
            snap = copy.copy(out)
            snap.new_token_ids = list(out.new_token_ids)
            snap.logprobs = list(out.logprobs)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, snap)

    def _refresh_stats(self) -> None:
        stats = self._engine.stats()
        with self._cond:
            self._stats = stats

    def _fail_all(self, err: BaseException) -> None:
        with self._cond:
            self._thread_error = err
            streams, self._streams = self._streams, {}
        failure = EngineUnavailable(f"engine failed: {err}")
        for stream in streams.values():
            stream.finished = True
            stream.loop.call_soon_threadsafe(_set_exception, stream.accepted, failure)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, failure)


class RequestStream:
    """The outputs of one request, ending with the finished one.

    Leaving early aborts the request in the engine (its blocks are freed): ``aclose()``, a
    cancellation while waiting (client disconnect), or the stream being dropped unread.
    """

    def __init__(self, owner: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self._owner = owner
        self.request_id = request_id
        self._stream = stream
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._stream.queue.get()
        except BaseException:
            self._abandon()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        self._abandon()

    def _abandon(self) -> None:
        self._done = True
        if not self._stream.finished:
            self._owner.abort(self.request_id)

    def __del__(self) -> None:
        if not self._stream.finished:
            self._owner.abort(self.request_id)


def _set_result(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future, err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)
