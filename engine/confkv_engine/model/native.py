"""The project's native CPU library (``_native``: ``_q8matmul.c``, the int8 / int4 block matmuls, with
``_q8argmax.c``, their fused greedy argmax, and ``_rowops.c``, the layers' row-wise blocks), found and
loaded with ctypes when it was built.

``pip install`` builds it next to this module (``setup.py``: an optional extension; without a C
compiler the install goes on, the library is absent and PyTorch's kernels serve). Nothing is
compiled or downloaded at run time. Its SIMD paths (``ISAS``): ``vnni`` (AVX-512 VNNI), ``avx2``
(AVX2 + FMA), ``scalar`` (portable C); ``isa_for`` picks the best one the CPU flags allow and the
library re-checks the CPU and refuses a path it cannot run. ``CONFKV_NATIVE_Q4=0`` (its historical
name) turns the whole library off, for comparisons with PyTorch's kernels.
"""

from __future__ import annotations

from confkv_engine.cache.codec.native import find_library

__all__ = ["ISAS", "LIBRARY", "SWITCH", "find_library", "isa_for"]

LIBRARY = "_native"
SWITCH = "CONFKV_NATIVE_Q4"
ISAS = {"scalar": 0, "avx2": 1, "vnni": 2}


def isa_for(flags: frozenset[str]) -> str:
    """The fastest path the CPU flags (``/proc/cpuinfo`` names) allow."""
    if {"avx512_vnni", "avx512vl"} <= flags:
        return "vnni"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "scalar"
