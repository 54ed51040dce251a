"""gRPC control plane of the engine: ``confkv.v1.EngineControl`` on a Unix socket.

The socket lives in a volume shared with the agent sidecar and is never bound on the network
(``unix://`` only; the file is made owner-only, both containers run as the same user). The server
starts with the HTTP server and answers UNAVAILABLE until the model is loaded and ``attach`` binds
the running engine.

What the engine can do today, and therefore what the RPCs do:

- GetStatus / WatchStatus: the engine's stats snapshot, latency counters from the HTTP layer's
  histogram, device memory, the live policy and the engine's capabilities.
- UpdatePolicy: through ``policy.PolicyStore``; the fields the engine lists as live
  (``EngineControlTarget.live_fields``: ``engine.maxBatchSize`` and the retention defaults) take
  effect between two scheduler steps; other fields are validated, versioned and stored, and
  reported as deferred (the engine reads them at start only).
- RebuildIndex: rebuilds the disk store's index from its record files (FAILED_PRECONDITION without
  ``engine.cacheDir``). Warmup: prefills the given prompts, or the disk store's most-hit prefixes,
  into the prefix cache and answers once they are cached. Compress: the cache's quantized
  compression; FAILED_PRECONDITION when the engine cannot do what is asked. Nothing pretends.

Threads: a sync gRPC server runs every RPC on a worker thread, and a WatchStatus stream holds its
worker for as long as it is open. Streams are therefore bounded on their own (``MAX_WATCH_STREAMS``;
the excess gets RESOURCE_EXHAUSTED at once) and the pool has ``UNARY_WORKERS`` more threads than
that, so open streams never starve GetStatus or UpdatePolicy. A stream whose client goes away
frees its worker at once (a termination callback wakes it), not after its interval.

A request whose bytes are not a valid message is INVALID_ARGUMENT, never INTERNAL with a
traceback (``decoding``).

Server integration (``confkv_engine.server``): ``ControlPlane(config)``, ``start()`` at start-up,
``attach(target, ...)`` once the engine runs, ``stop()`` at shutdown. The servicer reaches the engine
only through ``core.control_api.EngineControlTarget`` and its typed ``EngineStats`` snapshot.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from confkv_api import metrics as names
from confkv_api.config import ConfKVConfig
from confkv_api.histograms import histogram_message
from confkv_api.v1 import control_pb2 as pb
from confkv_api.v1 import control_pb2_grpc as pb_grpc
from confkv_engine.cache.memory import device_memory
from confkv_engine.control import unix_socket
from confkv_engine.control.decoding import MalformedRequests
from confkv_engine.control.policy import (
    PolicyConflict,
    PolicyError,
    PolicyInvalid,
    PolicyNotLive,
    PolicySnapshot,
    PolicyStore,
    parse_patch,
)
from confkv_engine.core.control_api import CapacityInUse, EngineControlTarget, EngineStats, PolicyRejected
from confkv_engine.core.threads import serial_torch_ops

log = logging.getLogger("confkv.control")

MAX_WARMUP_PROMPTS = 256
DEFAULT_WARMUP_TOP_K = 8
# Concurrent WatchStatus streams (the agent polls GetStatus; streams are for dashboards and tools).
MAX_WATCH_STREAMS = 8
# Worker threads beyond the streams' own, for the unary RPCs; and the RPCs admitted at once
# (beyond it grpc answers RESOURCE_EXHAUSTED).
UNARY_WORKERS = 8
MAX_CONCURRENT_RPCS = 64
MISSING = {
    "prefix-cache": "this engine runs without a prefix cache (confkv.prefixCache.enabled is false): there "
                    "is nothing to warm up; nothing was changed",
}


class ControlPlaneError(RuntimeError):
    """The control socket cannot be served (bad path, or another engine is serving it)."""


def socket_path(address: str) -> str:
    """``/run/x.sock`` or ``unix:///run/x.sock`` -> ``/run/x.sock``; anything network-like is refused."""
    try:
        return unix_socket.socket_path(address)
    except unix_socket.ControlSocketError as err:
        raise ControlPlaneError(str(err)) from None


@dataclass
class EngineBinding:
    """What the control plane holds of the running engine: its typed control protocol, the stats
    snapshot (``AsyncEngine.stats``: never blocks on the engine thread), the latency histogram."""

    target: EngineControlTarget
    stats: Callable[[], EngineStats]
    registry: Any | None  # prometheus CollectorRegistry holding the request-latency histogram
    device: str
    model_name: str
    # Prefill prompts (or, given none, the top-k remembered hot prefixes) into the prefix cache and
    # wait for them: returns (prompts run, blocks cached now). From the server, which has the tokenizer.
    warmup: Callable[[list[str], int], tuple[int, int]] | None = None

    def capabilities(self) -> list[str]:
        caps = [f"live:{field}" for field in self.target.live_fields()]
        caps.extend(self.target.capabilities())
        if self.stats().prefix_cache_enabled:
            caps.append("prefix-stats")
        return caps

    def apply_policy(self, snapshot: PolicySnapshot, live: list[str]) -> None:
        """The one place a policy reaches the engine; called by the PolicyStore under its lock."""
        try:
            self.target.apply_policy(snapshot.confkv, snapshot.max_batch_size, live)
        except CapacityInUse as err:  # valid, but not now: FAILED_PRECONDITION
            raise PolicyNotLive(str(err)) from None
        except PolicyRejected as err:
            raise PolicyInvalid(str(err)) from None

    def latency(self) -> tuple[int, float]:
        if self.registry is None:
            return 0, 0.0
        count = self.registry.get_sample_value(f"{names.REQUEST_LATENCY_SECONDS}_count") or 0
        total = self.registry.get_sample_value(f"{names.REQUEST_LATENCY_SECONDS}_sum") or 0.0
        return int(count), float(total)


class ControlPlane:
    def __init__(self, config: ConfKVConfig) -> None:
        self.config = config
        self.address = config.engine.control_socket
        self._binding: EngineBinding | None = None
        self.store: PolicyStore | None = None
        self._server: grpc.Server | None = None
        self._path: str | None = None
        self._stopping = threading.Event()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Serve the socket (a no-op when already serving); ControlPlaneError when it cannot be served
        safely: the caller exits rather than run an engine its agent cannot reach (or reaches through
        a socket somebody else made)."""
        if self._server is not None:
            return
        try:
            path = unix_socket.prepare(self.address)
            workers = futures.ThreadPoolExecutor(max_workers=MAX_WATCH_STREAMS + UNARY_WORKERS,
                                                 thread_name_prefix="confkv-grpc",
                                                 initializer=serial_torch_ops)
            server = grpc.server(workers, interceptors=[MalformedRequests()],
                                 maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
            pb_grpc.add_EngineControlServicer_to_server(ControlServicer(self), server)
            with unix_socket.owner_only_umask():
                bound = server.add_insecure_port(f"unix://{path}")
            if not bound:
                raise unix_socket.ControlSocketError(f"could not bind unix://{path}")
            os.chmod(path, 0o600)
            server.start()
        except unix_socket.ControlSocketError as err:
            raise ControlPlaneError(str(err)) from None
        except (OSError, RuntimeError) as err:
            raise ControlPlaneError(f"the gRPC control plane cannot start on {self.address}: {err}") from None
        self._server, self._path = server, path
        log.info("gRPC control plane (confkv.v1.EngineControl) on unix://%s", path)

    def attach(self, target: EngineControlTarget, stats: Callable[[], EngineStats], registry: Any | None,
               device: str, model_name: str,
               warmup: Callable[[list[str], int], tuple[int, int]] | None = None) -> None:
        binding = EngineBinding(target, stats, registry, device, model_name, warmup)
        self.store = PolicyStore(self.config.confkv, target.max_batch_size,
                                 live_fields=target.live_fields(), apply=binding.apply_policy)
        self._binding = binding

    def stop(self, grace: float = 1.0) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.stop(grace).wait(grace + 1.0)
            self._server = None
        if self._path and os.path.exists(self._path):
            os.unlink(self._path)

    @property
    def stopping(self) -> threading.Event:
        return self._stopping

    def bound(self) -> tuple[EngineBinding, PolicyStore] | None:
        if self._binding is None or self.store is None:
            return None
        return self._binding, self.store

    # ---- status ----------------------------------------------------------------------------
    def status(self) -> pb.EngineStatus:
        bound = self.bound()
        if bound is None:
            raise RuntimeError("the engine is not attached")
        binding, store = bound
        s = binding.stats()
        count, total = binding.latency()
        label, used, capacity = device_memory(binding.device)
        policy = store.current
        return pb.EngineStatus(
            model=binding.model_name, timestamp=time.time(),
            num_running=s.num_running, num_waiting=s.num_waiting,
            kv_blocks_total=s.num_total_blocks, kv_blocks_free=s.num_free_blocks,
            block_size=s.block_size, kv_bytes_used=s.kv_bytes_used, kv_bytes_total=s.kv_bytes_total,
            kv_bytes_key_only=s.kv_bytes_key_only,
            preemptions_total=s.num_preemptions, oom_total=s.num_oom,
            prompt_tokens_total=s.prompt_tokens_total, generated_tokens_total=s.generated_tokens_total,
            latency_count=count, latency_seconds_sum=total,
            avg_latency_seconds=total / count if count else 0.0,
            prefix_cache_enabled=s.prefix_cache_enabled,
            prefix_queried_tokens=s.prefix_queried_tokens, prefix_hit_tokens=s.prefix_hit_tokens,
            device_memory=pb.DeviceMemory(device=label, used_bytes=int(used), total_bytes=int(capacity),
                                          effective_used_bytes=max(0, int(used) - s.kv_bytes_reclaimable)),
            kv_bytes_reclaimable=s.kv_bytes_reclaimable, eviction_k=s.eviction_k,
            prefix_hit_ratio_window=s.prefix_hit_ratio_window,
            disk_records=s.disk_records, disk_bytes=s.disk_bytes,
            rebuild_records_skipped=s.rebuild_records_skipped,
            kv_blocks_compressed=s.kv_blocks_compressed, kv_bytes_compressed=s.kv_bytes_compressed,
            policy_version=policy.version, policy_json=policy.to_json(),
            startup_policy_json=store.startup.to_json(), capabilities=binding.capabilities(),
            time_to_first_token=histogram_message(binding.registry, names.TIME_TO_FIRST_TOKEN_SECONDS),
            time_per_output_token=histogram_message(binding.registry, names.TIME_PER_OUTPUT_TOKEN_SECONDS),
            request_latency=histogram_message(binding.registry, names.REQUEST_LATENCY_SECONDS))


def _once(action: Callable[[], object]) -> Callable[[], None]:
    """``action`` made idempotent and thread-safe (a stream's slot is released by whichever of its
    termination callback and its own ``finally`` comes first)."""
    lock, done = threading.Lock(), [False]

    def run() -> None:
        with lock:
            if done[0]:
                return
            done[0] = True
        action()
    return run


_POLICY_CODES = {PolicyInvalid: grpc.StatusCode.INVALID_ARGUMENT,
                 PolicyNotLive: grpc.StatusCode.FAILED_PRECONDITION,
                 PolicyConflict: grpc.StatusCode.ABORTED}


class ControlServicer(pb_grpc.EngineControlServicer):
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self._watch_slots = threading.BoundedSemaphore(MAX_WATCH_STREAMS)

    def _require(self, context: grpc.ServicerContext) -> tuple[EngineBinding, PolicyStore]:
        bound = self.plane.bound()
        if bound is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        return bound  # type: ignore[return-value]  # abort raises

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.EngineStatus:
        self._require(context)
        return self.plane.status()

    def WatchStatus(self, request: pb.WatchStatusRequest,
                    context: grpc.ServicerContext) -> Iterator[pb.EngineStatus]:
        self._require(context)
        if not self._watch_slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{MAX_WATCH_STREAMS} WatchStatus streams are already open; close one, or poll "
                          f"GetStatus")
        ended = threading.Event()
        release = _once(self._watch_slots.release)
        context.add_callback(ended.set)  # client gone or server stopping: wake the wait below
        context.add_callback(release)
        interval = min(max(request.interval_seconds or 1.0, 0.1), 3600.0)
        try:
            while context.is_active() and not self.plane.stopping.is_set():
                yield self.plane.status()
                ended.wait(interval)
        finally:
            release()

    def UpdatePolicy(self, request: pb.UpdatePolicyRequest,
                     context: grpc.ServicerContext) -> pb.UpdatePolicyResponse:
        _, store = self._require(context)
        reason = request.reason or "unspecified"
        batch = request.max_batch_size if request.HasField("max_batch_size") else None
        try:
            patch = parse_patch(request.confkv_json)
            change = store.update(patch, replace=request.replace, max_batch_size=batch,
                                  expected_version=request.expected_version,
                                  require_live=request.require_live, reason=reason)
        except PolicyError as err:
            log.warning("policy update refused (%s): %s", reason, err)
            context.abort(_POLICY_CODES.get(type(err), grpc.StatusCode.INTERNAL), str(err))
        message = (f"policy version {change.snapshot.version}" if change.changed
                   else f"no change; policy version stays {change.snapshot.version}")
        if change.deferred:
            message += f"; stored but not live in this engine: {', '.join(change.deferred)}"
        return pb.UpdatePolicyResponse(version=change.snapshot.version, policy_json=change.snapshot.to_json(),
                                       changed_fields=change.changed, live_fields=change.live,
                                       deferred_fields=change.deferred, message=message)

    def _missing(self, capability: str, context: grpc.ServicerContext) -> pb.ActionResponse:
        self._require(context)
        log.info("control request refused: %s", MISSING[capability])
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, MISSING[capability])
        raise AssertionError("unreachable")  # context.abort raises

    def Compress(self, request: pb.CompressRequest, context: grpc.ServicerContext) -> pb.ActionResponse:
        binding, _ = self._require(context)
        if request.strategy not in ("", "int8", "int4", "quantization"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"strategy must be int8, int4 or quantization (the policy's bits), "
                          f"got {request.strategy!r}")
        bits = {"int8": 8, "int4": 4}.get(request.strategy)
        result = binding.target.compress(bits, request.force)
        message = (f"compressed {result.blocks} KV blocks"
                   f"{' (forced)' if request.force else ''}: {result.pool_blocks_freed} pool blocks "
                   f"({result.bytes_freed} bytes) freed")
        log.info("Compress: %s", message)
        return pb.ActionResponse(message=message, blocks_affected=result.blocks)

    def RebuildIndex(self, request: pb.RebuildIndexRequest,
                     context: grpc.ServicerContext) -> pb.ActionResponse:
        binding, _ = self._require(context)
        try:
            message = binding.target.rebuild_index()
        except PolicyRejected as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        log.info("RebuildIndex: %s", message)
        return pb.ActionResponse(message=message, blocks_affected=binding.stats().disk_records)

    def Warmup(self, request: pb.WarmupRequest, context: grpc.ServicerContext) -> pb.ActionResponse:
        binding, _ = self._require(context)
        if request.top_k < 0 or len(request.prompts) > MAX_WARMUP_PROMPTS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"top_k must be >= 0 and at most {MAX_WARMUP_PROMPTS} prompts are accepted")
        if binding.warmup is None or not binding.stats().prefix_cache_enabled:
            return self._missing("prefix-cache", context)
        before = binding.stats().prefix_hit_tokens
        try:
            prompts, cached = binding.warmup(list(request.prompts), request.top_k or DEFAULT_WARMUP_TOP_K)
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        message = (f"warmed {prompts} prompt(s) into the prefix cache ({cached} blocks cached now)"
                   if prompts else "nothing to warm up: no prompts given and no remembered hot prefixes")
        log.info("Warmup: %s (hits so far %d)", message, before)
        return pb.ActionResponse(message=message, blocks_affected=cached)
