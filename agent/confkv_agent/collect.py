"""Collect: GPU memory from NVML (``nvidia-ml-py``) and the engine's status over gRPC.

VRAM comes from NVML for every GPU this container can see (``CUDA_VISIBLE_DEVICES`` narrows the
set when it is given); the alert uses the fullest GPU. Without NVML (no driver, no library, no
GPU) the agent falls back to the engine's own memory report (GetStatus ``device_memory``: the GPU
as torch sees it, or on CPU the engine process's memory over the machine's RAM). The source is
logged once when it changes and exported as the ``source`` label of the VRAM metric.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from .rules import Buckets, Observation

log = logging.getLogger("confkv.agent.collect")


@dataclass(frozen=True)
class GpuMemory:
    index: int
    uuid: str
    used_bytes: int
    total_bytes: int

    @property
    def fraction(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes else 0.0


@dataclass(frozen=True)
class VramReading:
    source: str  # "nvml" or "engine"
    device: str  # "gpu0,gpu1", "cuda:0", "cpu"
    fraction: float | None
    gpus: tuple[GpuMemory, ...] = ()


def _visible(index: int, uuid: str, visible: str | None) -> bool:
    if visible is None or visible.strip() in ("", "all"):
        return True
    wanted = {v.strip() for v in visible.split(",") if v.strip()}
    prefixes = [w for w in wanted if w.startswith("GPU-")]  # short UUID prefixes are allowed
    return str(index) in wanted or uuid in wanted or any(uuid.startswith(w) for w in prefixes)


class NvmlReader:
    """NVML when it works; ``available`` False (and ``reason`` set) otherwise."""

    def __init__(self, nvml: Any | None = None) -> None:
        self.reason = ""
        self._nvml = nvml
        if nvml is None:
            try:
                import pynvml  # nvidia-ml-py

                self._nvml = pynvml
            except ImportError:  # a declared dependency; a trimmed image may still lack it
                self.reason = "nvidia-ml-py is not installed"
                return
        try:
            self._nvml.nvmlInit()
            self._count = int(self._nvml.nvmlDeviceGetCount())
        except Exception as err:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            self.reason = f"NVML unavailable: {err or type(err).__name__}"
            self._nvml = None
            return
        if self._count == 0:
            self.reason = "NVML sees no GPU"
            self._shutdown()

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception as err:  # nothing to release is not a problem
            log.debug("nvmlShutdown: %s", err)

    @property
    def available(self) -> bool:
        return self._nvml is not None and self._count > 0

    def read(self) -> tuple[GpuMemory, ...]:
        if not self.available:
            return ()
        nvml, visible = self._nvml, os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = []
        for index in range(self._count):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = nvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            if _visible(index, uuid, visible):
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                gpus.append(GpuMemory(index, uuid, int(mem.used), int(mem.total)))
        return tuple(gpus)


def _effective(gpus: tuple[GpuMemory, ...], status: Any | None) -> tuple[GpuMemory, ...]:
    """NVML counts the engine's pre-allocated KV pool as used even when it holds nothing: take the
    pool's reclaimable bytes (free and evictable blocks) off the GPU the engine runs on, so an empty
    pool does not read as a full GPU."""
    reclaimable = int(getattr(status, "kv_bytes_reclaimable", 0) or 0) if status is not None else 0
    device = status.device_memory.device if status is not None and status.HasField("device_memory") else ""
    if not reclaimable or not device.startswith("cuda"):
        return gpus
    index = int(device.partition(":")[2] or 0)  # cuda:N is the N-th visible GPU
    return tuple(GpuMemory(g.index, g.uuid, max(0, g.used_bytes - reclaimable), g.total_bytes)
                 if i == index else g for i, g in enumerate(gpus))


def vram_reading(nvml: NvmlReader, status: Any | None) -> VramReading:
    """The fullest visible GPU from NVML, else the engine's own report, else no data; both less the
    KV pool's reclaimable bytes (the engine's ``effective_used_bytes``)."""
    if nvml.available:
        try:
            gpus = nvml.read()
        except Exception as err:  # a GPU fell off the bus: use the engine's report this time
            log.warning("NVML read failed: %s", err)
            gpus = ()
        if gpus:
            device = ",".join(f"gpu{g.index}" for g in gpus)
            gpus = _effective(gpus, status)
            return VramReading("nvml", device, max(g.fraction for g in gpus), gpus)
    if status is not None and status.HasField("device_memory") and status.device_memory.total_bytes > 0:
        mem = status.device_memory
        used = mem.effective_used_bytes or mem.used_bytes  # 0: an engine that does not report it
        return VramReading("engine", mem.device, used / mem.total_bytes)
    return VramReading("none", "", None)


def buckets(status: Any, field: str) -> Buckets | None:
    """One latency histogram of an EngineStatus; None when the engine does not report it."""
    if not status.HasField(field):
        return None
    hist = getattr(status, field)
    bounds = tuple(hist.upper_bounds)
    if not bounds or len(bounds) != len(hist.cumulative_counts) or not math.isinf(bounds[-1]):
        return None  # not a Prometheus histogram: no data rather than a wrong quantile
    return Buckets(bounds, tuple(float(c) for c in hist.cumulative_counts))


def observation(status: Any, vram: VramReading) -> Observation:
    """The rules' input from one EngineStatus."""
    return Observation(
        vram_fraction=vram.fraction, latency_count=status.latency_count,
        latency_seconds_sum=status.latency_seconds_sum, oom_total=status.oom_total,
        prefix_cache=status.prefix_cache_enabled, prefix_queried_tokens=status.prefix_queried_tokens,
        prefix_hit_tokens=status.prefix_hit_tokens,
        ttft=buckets(status, "time_to_first_token"), tpot=buckets(status, "time_per_output_token"),
        e2e=buckets(status, "request_latency"), num_waiting=status.num_waiting,
        preemptions_total=status.preemptions_total)
