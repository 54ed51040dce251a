"""Which threads run torch's intra-op parallelism: the engine thread only.

torch on CPU parallelises an op over an OpenMP team owned by the thread that calls it, and a thread
keeps its team (its pool of worker threads) for as long as it lives. libgomp counts the workers of
every pool in the process, and when they outnumber the cores it stops spin-waiting between parallel
regions and puts workers to sleep at once: every op then pays a futex wake-up per region. Measured
on a 2-core machine, one idle gRPC or compression thread that had run a single parallel op made
the engine thread's bf16 matmuls 2.3x slower (60 -> 136 us for a 576x1536 row) and the served
decode step 2x slower.

So a long-lived helper thread that runs torch ops (the control plane's workers, the background
compressor) first calls ``serial_torch_ops``: its own ops then run inline on itself, never creating
a team, and the engine thread's team stays the only one. The engine's own threads are set once by
``configure_torch_threads`` (``core.async_engine``).
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

# The OpenMP runtimes torch wheels are built against (GNU on Linux, Intel and LLVM elsewhere).
_OPENMP_LIBRARIES = ("libgomp.so.1", "libiomp5.so", "libomp.so")


@cache
def _omp_set_num_threads() -> ctypes._CFuncPtr | None:
    """The loaded OpenMP runtime's ``omp_set_num_threads``; None when torch uses none we know."""
    for name in _OPENMP_LIBRARIES:
        try:
            # RTLD_NOLOAD: only a runtime torch already loaded, never a second copy.
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


def serial_torch_ops() -> bool:
    """Make torch ops issued by the *calling thread* single-threaded, leaving every other thread's
    setting (and torch's global thread count) as it is. Returns False where no OpenMP runtime is
    loaded (nothing to do then)."""
    import torch

    torch.get_num_threads()  # torch initialises this thread's OpenMP setting lazily: do it first
    setter = _omp_set_num_threads()
    if setter is None:
        return False
    setter(1)  # OpenMP's thread count is a per-thread setting: this thread only
    return True
