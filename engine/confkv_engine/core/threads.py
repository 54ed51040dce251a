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
a team, and the engine thread's team stays the only one. OpenMP's per-thread count is not enough
where torch is built with MKL: MKL's vector maths (``torch.log2`` among them) opens its own OpenMP
region sized by MKL's process-wide count, which ``torch.set_num_threads`` set, so a single ``log2``
in the compressor's codec created a second team and halved the served decode speed (54 -> 28
tokens/s, measured). MKL has a per-thread override, set to 1 here as well. The engine's own
threads are set once by ``configure_torch_threads`` (``core.async_engine``).
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

# The OpenMP runtimes torch wheels are built against (GNU on Linux, Intel and LLVM elsewhere).
_OPENMP_LIBRARIES = ("libgomp.so.1", "libiomp5.so", "libomp.so")


# Where torch links MKL statically (Linux x86 wheels), its symbols live in libtorch_cpu.
_MKL_LIBRARIES = ("libtorch_cpu.so", "libmkl_rt.so.2", "libmkl_rt.so")


def _loaded(names: tuple[str, ...], symbol: str) -> ctypes._CFuncPtr | None:
    """``symbol`` from the first of ``names`` this process has already loaded; None if none has it."""
    for name in names:
        try:
            # RTLD_NOLOAD: only a library torch already loaded, never a second copy.
            return getattr(ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY), symbol)
        except (OSError, AttributeError):
            continue
    return None


@cache
def _mkl_set_num_threads_local() -> ctypes._CFuncPtr | None:
    """MKL's per-thread count (its C entry point: the lower-case symbol is the Fortran one, which
    takes a pointer)."""
    setter = _loaded(_MKL_LIBRARIES, "MKL_Set_Num_Threads_Local")
    if setter is not None:
        setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
    return setter


@cache
def _omp_set_num_threads() -> ctypes._CFuncPtr | None:
    """The loaded OpenMP runtime's ``omp_set_num_threads``; None when torch uses none we know."""
    return _loaded(_OPENMP_LIBRARIES, "omp_set_num_threads")


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
    mkl_local = _mkl_set_num_threads_local()
    if mkl_local is not None:
        mkl_local(1)  # this thread's MKL calls too (0 would mean "follow the global count again")
    return True
