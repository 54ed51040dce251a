"""Device memory readings: the GPU's memory on CUDA (NVML as a fallback), else this process's RSS.

Lives with the cache because sizing the pool and reporting what it occupies read the same figures;
the HTTP metrics and the control plane's GetStatus both call ``device_memory``.
"""

from __future__ import annotations

import psutil

from confkv_engine.cache.planner import CUDA_RESERVE_MARGIN, DeviceFigures


def device_memory(device: str) -> tuple[str, int, int]:
    """(label, used bytes, total bytes): the GPU's memory on CUDA, else this process's RSS and the RAM."""
    if device.startswith("cuda"):
        try:
            import torch

            index = torch.device(device).index or 0
            free, total = torch.cuda.mem_get_info(index)
            return f"cuda:{index}", int(total - free), int(total)
        except Exception:  # no usable CUDA runtime: fall through to NVML, then to process memory
            used_total = _nvml_memory()
            if used_total is not None:
                return "cuda:0", *used_total
    return "cpu", int(psutil.Process().memory_info().rss), int(psutil.virtual_memory().total)


def _nvml_memory() -> tuple[int, int] | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        return int(info.used), int(info.total)
    except Exception:
        return None


def device_figures(device: str, weights_bytes: int) -> DeviceFigures:
    """The memory planner's inputs, read now (after the weights loaded, before the pool exists).
    CUDA: total and free from the driver; the reserve is what torch's allocator does not hold (the
    CUDA context, library workspaces) plus a margin. CPU: the RAM, and what ``layout.machine_cap``
    lets a pool take (half the available RAM, cgroup-aware)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        outside_torch = max(0, int(total - free) - int(torch.cuda.memory_reserved(dev)))
        return DeviceFigures(str(dev), int(total), int(free), weights_bytes,
                             outside_torch + CUDA_RESERVE_MARGIN)
    from confkv_engine.cache.layout import machine_cap

    return DeviceFigures("cpu", int(psutil.virtual_memory().total), machine_cap(dev)[0], weights_bytes)
