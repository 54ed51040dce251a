"""gRPC control plane of the engine: ``confkv.v1.EngineControl`` on a Unix socket.

The socket lives in a volume shared with the agent sidecar and is never bound on the network
(``unix://`` only; the file is made owner-only, both containers run as the same user). The server
starts with the HTTP server and answers UNAVAILABLE until the model is loaded and ``attach`` binds
the running engine.

What the engine can do today, and therefore what the RPCs do:

- GetStatus / WatchStatus: the engine's stats snapshot, latency counters from the HTTP layer's
  histogram, device memory, the live policy and the engine's capabilities.
- UpdatePolicy: through ``policy.PolicyStore``; ``engine.maxBatchSize`` takes effect at the next
  scheduler step (running sequences finish, admission waits). Other fields are validated, versioned
  and stored, and reported as deferred (the engine reads them at start only).
- Compress, RebuildIndex, Warmup: FAILED_PRECONDITION naming the missing capability (no quantized
  block compression, no cache-directory log, no prefix cache yet). Nothing pretends.

Threads: a sync gRPC server runs every RPC on a worker thread, and a WatchStatus stream holds its
worker for as long as it is open. Streams are therefore bounded on their own (``MAX_WATCH_STREAMS``;
the excess gets RESOURCE_EXHAUSTED at once) and the pool has ``UNARY_WORKERS`` more threads than
that, so open streams never starve GetStatus or UpdatePolicy. A stream whose client goes away
frees its worker at once (a termination callback wakes it), not after its interval.

Server integration (``server.py``): ``ControlPlane(config)``, ``start()`` at start-up, ``attach(...)``
once the engine runs, ``stop()`` at shutdown.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from confkv_api import metrics as names
from confkv_api.config import ConfKVConfig
from confkv_api.v1 import control_pb2 as pb
from confkv_api.v1 import control_pb2_grpc as pb_grpc
from confkv_engine.control.policy import (
    BATCH_FIELD,
    PolicyConflict,
    PolicyError,
    PolicyInvalid,
    PolicyNotLive,
    PolicySnapshot,
    PolicyStore,
    parse_patch,
)

log = logging.getLogger("confkv.control")

# Concurrent WatchStatus streams (the agent polls GetStatus; streams are for dashboards and tools).
MAX_WATCH_STREAMS = 8
# Worker threads beyond the streams' own, for the unary RPCs; and the RPCs admitted at once
# (beyond it grpc answers RESOURCE_EXHAUSTED).
UNARY_WORKERS = 8
MAX_CONCURRENT_RPCS = 64

# Longest path a sockaddr_un holds on Linux (108 bytes with the terminating NUL).
MAX_SOCKET_PATH = 107
MISSING = {
    "compress": "this engine has no KV block compression yet (capability 'compress' is missing): cold blocks "
                "are never quantized, so there is nothing to compress; nothing was changed",
    "rebuild-index": "this engine has no cache-directory log or block index yet (capability 'rebuild-index' "
                     "is missing): there is nothing to rebuild; nothing was changed",
    "prefix-cache": "this engine has no prefix cache yet (capability 'prefix-cache' is missing): there is "
                    "nothing to warm up; nothing was changed",
}


class ControlPlaneError(RuntimeError):
    """The control socket cannot be served (bad path, or another engine is serving it)."""


def socket_path(address: str) -> str:
    """``/run/x.sock`` or ``unix:///run/x.sock`` -> ``/run/x.sock``; anything network-like is refused."""
    path = address.removeprefix("unix://")
    if not path.startswith("/"):
        raise ControlPlaneError(f"engine.grpcSocket must be an absolute Unix socket path (the control plane "
                                f"never listens on the network), got {address!r}")
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ControlPlaneError(f"engine.grpcSocket {path!r} is longer than {MAX_SOCKET_PATH} bytes")
    return path


def _socket_is_live(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(path)
        except OSError:
            return False
    return True


def _field(stats: Any, name: str, default: float = 0) -> Any:
    value = stats.get(name, default) if isinstance(stats, dict) else getattr(stats, name, default)
    return default if value is None else value


def _has_field(stats: Any, name: str) -> bool:
    return name in stats if isinstance(stats, dict) else hasattr(stats, name)


#: Fields a retention manager reads when a sequence (re)starts: live when the engine has one.
RETENTION_FIELDS = ("confkv.kvPolicy", "confkv.confidenceThresholds", "confkv.sinks", "confkv.window",
                    "confkv.budget", "confkv.budgetTokens", "confkv.budgetMode")


def _retention_manager(engine: Any) -> Any | None:
    """The engine's RetentionManager, found by type (whatever the attribute is called), if any."""
    from confkv_engine.retention.manager import RetentionManager

    return next((v for v in vars(engine).values() if isinstance(v, RetentionManager)), None)


@dataclass
class EngineBinding:
    """What the control plane needs from the running engine."""

    engine: Any  # LLMEngine: ``scheduler`` (live batch size) and its lock
    stats: Callable[[], Any]  # the stats snapshot (AsyncEngine.stats: never blocks on the engine thread)
    registry: Any | None  # prometheus CollectorRegistry holding the request-latency histogram
    device: str
    model_name: str

    def live_fields(self) -> list[str]:
        return [BATCH_FIELD, *(RETENTION_FIELDS if _retention_manager(self.engine) is not None else ())]

    def capabilities(self) -> list[str]:
        caps = [f"live:{field}" for field in self.live_fields()]
        if _has_field(self.stats(), "prefix_queried_tokens"):
            caps.append("prefix-stats")
        return caps

    def apply_policy(self, snapshot: PolicySnapshot, live: list[str]) -> None:
        """The one place a policy reaches the engine; called by the PolicyStore under its lock.
        Everything is computed and checked first, then set between two engine steps (all or nothing).
        Retention settings apply to sequences that start (or restart) from now on."""
        manager = _retention_manager(self.engine)
        retention = None
        if manager is not None and any(p.startswith(RETENTION_FIELDS) for p in live):
            from confkv_engine.retention.manager import config_from_section

            try:
                retention = config_from_section(snapshot.confkv, manager.defaults.scorer)
            except ValueError as err:
                raise PolicyInvalid(f"invalid policy: {err}") from None
            chunk = self.engine.scheduler.prefill_chunk
            if retention.policy != "full" and retention.tiers.window < chunk:
                raise PolicyInvalid(f"invalid policy: confkv.window ({retention.tiers.window}) must hold a "
                                    f"prefill chunk ({chunk}) when kvPolicy is {retention.policy!r}")
        lock = getattr(self.engine, "_lock", None) or threading.Lock()
        with lock:  # the engine steps under this lock: the change lands between two steps
            if BATCH_FIELD in live:
                self.engine.scheduler.max_batch_size = snapshot.max_batch_size
            if retention is not None:
                manager.defaults = retention

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
    def start(self) -> bool:
        """Serve the socket; False (logged) when it cannot, so the HTTP server keeps serving."""
        try:
            path = socket_path(self.address)
            Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            if os.path.exists(path):
                if _socket_is_live(path):
                    raise ControlPlaneError(f"another process is serving the control socket {path}")
                os.unlink(path)  # left behind by an engine that died
            workers = futures.ThreadPoolExecutor(max_workers=MAX_WATCH_STREAMS + UNARY_WORKERS,
                                                 thread_name_prefix="confkv-grpc")
            server = grpc.server(workers, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
            pb_grpc.add_EngineControlServicer_to_server(ControlServicer(self), server)
            if not server.add_insecure_port(f"unix://{path}"):
                raise ControlPlaneError(f"could not bind unix://{path}")
            server.start()
            os.chmod(path, 0o600)
        except (ControlPlaneError, OSError, RuntimeError) as err:
            log.error("gRPC control plane not started: %s", err)
            return False
        self._server, self._path = server, path
        log.info("gRPC control plane (confkv.v1.EngineControl) on unix://%s", path)
        return True

    def attach(self, engine: Any, stats: Callable[[], Any], registry: Any | None, device: str,
               model_name: str) -> None:
        binding = EngineBinding(engine, stats, registry, device, model_name)
        self.store = PolicyStore(self.config.confkv, int(engine.scheduler.max_batch_size),
                                 live_fields=binding.live_fields(), apply=binding.apply_policy)
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
        from confkv_engine.http.metrics import (
            device_memory,  # psutil/torch: imported only when a status is asked
        )

        label, used, capacity = device_memory(binding.device)
        policy = store.current
        caps = binding.capabilities()
        return pb.EngineStatus(
            model=binding.model_name, timestamp=time.time(),
            num_running=int(_field(s, "num_running")), num_waiting=int(_field(s, "num_waiting")),
            kv_blocks_total=int(_field(s, "num_total_blocks")),
            kv_blocks_free=int(_field(s, "num_free_blocks")),
            block_size=int(_field(s, "block_size")), kv_bytes_used=int(_field(s, "kv_bytes_used")),
            kv_bytes_total=int(_field(s, "kv_bytes_total")),
            kv_bytes_key_only=int(_field(s, "kv_bytes_key_only")),
            preemptions_total=int(_field(s, "num_preemptions")), oom_total=int(_field(s, "num_oom")),
            prompt_tokens_total=int(_field(s, "prompt_tokens_total")),
            generated_tokens_total=int(_field(s, "generated_tokens_total")),
            latency_count=count, latency_seconds_sum=total,
            avg_latency_seconds=total / count if count else 0.0,
            prefix_cache_enabled="prefix-stats" in caps,
            prefix_queried_tokens=int(_field(s, "prefix_queried_tokens")),
            prefix_hit_tokens=int(_field(s, "prefix_hit_tokens")),
            device_memory=pb.DeviceMemory(device=label, used_bytes=int(used), total_bytes=int(capacity)),
            policy_version=policy.version, policy_json=policy.to_json(),
            startup_policy_json=store.startup.to_json(), capabilities=caps)


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
        if request.strategy not in ("", "int8", "int4"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"strategy must be int8 or int4, got {request.strategy!r}")
        return self._missing("compress", context)

    def RebuildIndex(self, request: pb.RebuildIndexRequest,
                     context: grpc.ServicerContext) -> pb.ActionResponse:
        return self._missing("rebuild-index", context)

    def Warmup(self, request: pb.WarmupRequest, context: grpc.ServicerContext) -> pb.ActionResponse:
        return self._missing("prefix-cache", context)
