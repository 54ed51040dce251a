"""CPU matmul kernels for quantized linears, and the per-row-count table that picks one.

A linear layer's best kernel depends on how many rows (tokens) the step sends through it and on the
CPU: weight-only int4 reads the fewest bytes and wins at a few rows, but its unpacking costs more
than it saves once the matmul is compute-bound, where oneDNN's bf16 GEMM (AMX / AVX-512 BF16) on a
dense copy of the same values wins. So every quantized linear keeps the representations that win
somewhere and dispatches on ``x.shape[0]``.

Candidates for an int4 weight: ``q4n``, the project's native kernel (``q8native.pack_int4``: 16-row
blocks of nibbles, int8 activations, integer dot products, AVX2 / AVX-512 VNNI / scalar paths;
present when the optional C library was built), PyTorch's weight-only ``int4`` (fast with bf16
activations on CPUs that compute bf16 natively, slow without), and ``dense``. For int8 weights:
``q8n``, the native int8 x int8 kernel (``q8native``: same library and blocks), PyTorch's
weight-only ``int8`` and ``dense``. Int8 weights with a scale per group (``int8g``: GGUF's Q8_0 /
Q5_0 as stored) are read by ``q8n`` only (or a dense copy); the loader makes them only where
``grouped_int8_served`` says ``q8n`` serves int8 at every row count.

The table (kernel per row bucket per layer shape) is **derived** from what the CPU reports
(``torch.backends.cpu.get_cpu_capability()`` and the flags in ``/proc/cpuinfo``) or **measured** at
start-up (``CONFKV_KERNEL_TUNE=1``): every candidate is timed on the model's real shapes at a few
row counts, interleaved and taking the best of several rounds, and the result is cached as JSON
keyed by CPU model, flags, torch version and thread count, so a restart costs nothing. Measuring is
opt-in because on a machine whose cores are shared with other work a short timing run can pick a
kernel that only looked faster; the derived rules encode measurements from such CPUs.

``CONFKV_CPU_ISA`` (read once) makes the CPU look smaller than it is, to measure what another CPU
would run: ``avx2`` hides AVX-512, AMX and AVX-VNNI (and so native bf16), ``generic`` hides AVX as
well; ``native`` (the default) hides nothing. It changes only this module's view (and so the
activation dtype, the table and the native kernel's path): cap PyTorch and oneDNN with their own
switches (``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``) for a full emulation.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from confkv_engine.model import native, q8native
from confkv_engine.model.quant import Int4Weight, Int8GroupWeight, Int8Weight, int4_scales_and_zeros

log = logging.getLogger(__name__)

ROW_GRID = (1, 4, 16, 64, 256)  # rows timed; a step with r rows uses the nearest bucket at or above
KernelFn = Callable[[Tensor], Tensor]
ArgmaxFn = Callable[[Tensor], Tensor]  # x [rows, K] -> [rows] int64: the index of each row's largest output


@dataclass(frozen=True)
class CpuInfo:
    capability: str  # torch's: DEFAULT, AVX2, AVX512, ...
    flags: frozenset[str]
    model: str

    @property
    def native_bf16(self) -> bool:
        """bf16 GEMMs run natively (AVX-512 BF16 or AMX); without them bf16 is emulated and slow."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)


ISA_SWITCH = "CONFKV_CPU_ISA"
# Flag prefixes each CONFKV_CPU_ISA level hides (``/proc/cpuinfo`` names).
_HIDDEN = {"native": (), "avx2": ("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma"),
           "generic": ("avx", "amx", "fma", "f16c")}


def mask_flags(flags: frozenset[str], level: str) -> frozenset[str]:
    """``flags`` less those a CPU of ``level`` (a ``CONFKV_CPU_ISA`` value) would not have."""
    if level not in _HIDDEN:
        raise ValueError(f"{ISA_SWITCH}={level!r}: use one of {', '.join(_HIDDEN)}")
    return frozenset(f for f in flags if not f.startswith(_HIDDEN[level]))


@functools.cache
def cpu_info() -> CpuInfo:
    flags: set[str] = set()
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags" and not flags:
                flags = set(value.split())
            elif key.strip() == "model name":
                model = value.strip()
    except OSError:
        pass  # not Linux: capability alone decides
    level = os.environ.get(ISA_SWITCH, "native").strip().lower() or "native"
    return CpuInfo(torch.backends.cpu.get_cpu_capability(), mask_flags(frozenset(flags), level), model)


def activation_dtype(info: CpuInfo | None = None) -> torch.dtype:
    """bf16 activations where the CPU computes bf16 natively, fp32 otherwise."""
    return torch.bfloat16 if (info or cpu_info()).native_bf16 else torch.float32


# ---------------------------------------------------------------- kernels (prepare -> run)


def dense_kernel(weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> KernelFn:
    w = weight.to(dtype).contiguous()
    b = None if bias is None else bias.to(dtype)
    return lambda x: F.linear(x, w, b)


def int4_kernel(weight: Int4Weight, bias: Tensor | None, dtype: torch.dtype) -> KernelFn:
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.contiguous(), 1)
    scales_zeros = int4_scales_and_zeros(weight, dtype)
    group = weight.group
    b = None if bias is None else bias.to(dtype)

    def run(x: Tensor) -> Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)
        return y if b is None else y + b
    return run


def native_isa(info: CpuInfo | None = None) -> str | None:
    """The native int4 kernel's path for this CPU, or None where the library is absent."""
    isa = native.isa_for((info or cpu_info()).flags)
    return isa if isa in q8native.supported_isas() else None


def q4n_kernel(weight: Int4Weight, bias: Tensor | None, dtype: torch.dtype) -> KernelFn:
    """The native 4-bit kernel: the int8 kernel's 16-row blocks with the weights' nibbles
    (``q8native.pack_int4``)."""
    return native_kernels("q4n", weight, bias, dtype)[0]


def native_kernels(name: str, weight: Int4Weight | Int8Weight | Int8GroupWeight, bias: Tensor | None,
                   dtype: torch.dtype) -> tuple[KernelFn, ArgmaxFn | None]:
    """``q4n`` / ``q8n``'s matmul and, over the same packed weights, its fused greedy argmax
    (``q8native.bound_argmax``; None with a bias, which the argmax does not add)."""
    if name == "q4n":
        isa = native_isa()
        if isa is None:
            raise RuntimeError("the native int4 kernel is not available on this machine")
        packed: q8native.PackedInt8 | q8native.PackedInt4Blocks = q8native.pack_int4(weight)  # type: ignore[arg-type]
    else:
        isa = native_int8_isa()
        if isa is None:
            raise RuntimeError("the native int8 kernel is not available on this machine")
        # Groups of 16 (Q6_K) round their scales to fp16 (``q8native.pack`` says by how much).
        packed = q8native.pack(weight, round_scales=getattr(weight, "group", 0) == 16)  # type: ignore[arg-type]
    argmax = q8native.bound_argmax(packed, isa, dtype) if bias is None else None
    return _with_bias(q8native.bound(packed, isa, dtype), bias, dtype), argmax


def _with_bias(fn: KernelFn, bias: Tensor | None, dtype: torch.dtype) -> KernelFn:
    if bias is None:
        return fn
    b = bias.to(dtype)
    return lambda x: fn(x) + b


def native_int8_isa(info: CpuInfo | None = None) -> str | None:
    """The native int8 kernel's path for this CPU, or None where the library is absent or
    ``CONFKV_NATIVE_INT8=0`` (read here, i.e. whenever a model's kernel table is made)."""
    if os.environ.get(q8native.SWITCH, "1").strip() == "0":
        return None
    isa = native.isa_for((info or cpu_info()).flags)
    return isa if isa in q8native.supported_isas() else None


def q8n_kernel(weight: Int8Weight | Int8GroupWeight, bias: Tensor | None, dtype: torch.dtype) -> KernelFn:
    return native_kernels("q8n", weight, bias, dtype)[0]


def int8_kernel(weight: Int8Weight, bias: Tensor | None, dtype: torch.dtype) -> KernelFn:
    q, scale = weight.q.contiguous(), weight.scale.to(dtype)
    b = None if bias is None else bias.to(dtype)

    def run(x: Tensor) -> Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x, q, scale)
        return y if b is None else y + b
    return run


# Which kernels can serve a weight of each kind: its weight-only kernel or a dense copy of the same
# values. fbgemm's dynamic int8 (activations quantized per tensor) is deliberately not a candidate:
# on this model's layers, whose activations have outlier channels, it measured 4-7 % relative
# output error against 0.3 % for int4 weight-only with bf16 activations.
CANDIDATES = {"int4": ("q4n", "int4", "dense"), "int8": ("q8n", "int8", "dense"), "int8g": ("q8n", "dense"),
              "int8g16": ("q8n", "dense"), "dense": ("dense",)}
# int8 with a scale per row and group of 16 inputs (GGUF's Q6_K sub-blocks) doubles q8n's per-group
# work: Gemma 3's 640 x 2,048 Q6_K layers, 2 threads, bf16, best of 15 interleaved rounds
# (``bench.micro.int8_kernels --kind int8g --group 16``, EPYC, ``int8g16-kernels.json``): 0.039 /
# 0.052 / 0.090 / 0.133 / 0.250 ms at 1 / 2 / 4 / 8 / 16 rows against bf16 GEMM's 0.088 / 0.083 /
# 0.105 / 0.113 / 0.163. The dense copy is kept beside the codes (Gemma 3: +12 MB).
INT8G16_MAX_ROWS = 4
# Without native bf16 the dense alternative is fp32 GEMM, and q8n beats it further: Gemma 3's
# 640 x 2,048 Q6_K layer, 2 threads, fp32 activations, best of 15 interleaved rounds, AVX2-only AMD
# EPYC (scratch loop over ``kernels.q8n_kernel`` / ``dense_kernel``): 0.048 / 0.142 / 0.257 / 0.688 /
# 1.001 / 2.004 / 5.668 / 11.435 ms at 1 / 8 / 16 / 32 / 64 / 128 / 256 / 512 rows against 0.121 /
# 0.603 / 0.620 / 1.249 / 1.679 / 3.617 / 5.773 / 10.475. So q8n serves up to the 64-row bucket
# there; the last bucket (65-256 rows and every longer step: prefill chunks) keeps the dense copy.
INT8G16_MAX_ROWS_FP32 = 64


def candidates(kind: str) -> tuple[str, ...]:
    """The kernels that can serve ``kind`` here (``q4n`` / ``q8n`` only where the library runs)."""
    absent = {"q4n": native_isa() is None, "q8n": native_int8_isa() is None}
    return tuple(c for c in CANDIDATES[kind] if not absent.get(c, False))


def derived_choice(kind: str, rows: int, info: CpuInfo, native: bool | None = None,
                   native8: bool | None = None) -> str:
    """The rule a table falls back to: weight-only kernels while the matmul is memory-bound, and
    never one measured slower than the dense matmul on such a CPU. ``native`` / ``native8``: whether
    the native int4 / int8 kernel runs here (None: ask the library).

    Measured on the embedded model's four linear shapes, 2 threads, best of 15 interleaved rounds,
    summed over one layer (docs/performance.md, "Kernels per CPU"): without native bf16 (AVX2,
    fp32 activations) PyTorch's int4 loses to fp32 GEMM at every row count, one row included
    (8.1 vs 6.7 ms), and ``q4n`` wins up to 16 rows (5.7 vs 6.7, 8.1 vs 8.3, 2.3 vs 2.7 ms at
    1 / 4 / 16) and loses at 32 (4.2 vs 3.5 ms); the 16-row block kernel that replaced that
    ``q4n`` took 0.134 / 0.367 / 1.088 / 1.739 / 4.11 / 16.1 ms against fp32 GEMM's 0.435 / 1.214 /
    1.850 / 2.481 / 5.71 / 19.1 at 1 / 4 / 16 / 32 / 64 / 256 rows under the AVX2 emulation
    (``bench.micro.int8_kernels --kind int4``), so it serves every row count there (576 x 576 and
    576 x 1,536 alone lose at 256 rows, by 13 % and 11 %). With native bf16 (AMX) PyTorch's int4 and int8
    with bf16 activations beat bf16 GEMM up to 4 rows and it wins from 16 (int4: 0.70 vs 0.89 ms)."""
    if kind == "dense":
        return "dense"
    if kind == "int8g16":  # q8n while it wins, then the layer's dense copy (INT8G16_MAX_ROWS*)
        limit = INT8G16_MAX_ROWS if info.native_bf16 else INT8G16_MAX_ROWS_FP32
        return "q8n" if rows <= limit and _q8n_everywhere(info, native8) else "dense"
    if kind in ("int8", "int8g") and _q8n_everywhere(info, native8):
        return "q8n"
    if kind == "int8g":  # only q8n reads group scales (the loader makes them only where it runs)
        return "dense"
    if native is None:
        native = native_isa(info) is not None
    if kind == "int4" and native and (not info.native_bf16 or _vnni_without_amx(info)):
        # q4n at every row count without native bf16 (the block kernel's measurements in the
        # docstring) and on VNNI CPUs without AMX: no dense copy of the int4 weights is kept.
        return "q4n"
    if not info.native_bf16:
        # int8 weight-only with fp32 activations lost to fp32 GEMM even at one row (the 49,152 x
        # 576 LM head: 10.5 vs 5.0 ms under the AVX2 emulation), so without q8n int8 weights run
        # dense here (and int4 where q4n does not run).
        return "dense"
    # int8 (PyTorch's weight-only kernel, bf16 activations) also stops at 4 rows: its time grows
    # with the rows where bf16 GEMM's stays flat. Gemma 3's 262,144 x 640 LM head, 2 threads:
    # 20.1 vs 23.1 ms at 4 rows, 37.0 vs 23.2 at 8, 75.1 vs 23.9 at 16; its layers' 4,096 x 640
    # and 1,536 x 640 cross over between 4 and 8 rows as well.
    return kind if rows <= 4 else "dense"


def _vnni_without_amx(info: CpuInfo) -> bool:
    """Where ``q4n`` (the 16-row block kernel) serves int4 at every row count although bf16 is
    native: VNNI CPUs without AMX. Measured on an AMD EPYC (AVX-512 VNNI and BF16, no AMX), 2
    threads, bf16 activations (``bench.micro.int8_kernels --kind int4``, docs/performance.md
    "Activations quantized eight lanes at a time"): since the activations' quantization runs in
    SIMD on every thread, q4n beat bf16 GEMM on the embedded model's four shapes at 1-512 rows
    (576 x 576: 0.051 / 0.096 ms at 16 rows, 0.165 / 0.259 at 64, 0.749 / 0.847 at 512) and on Gemma
    3's int4 shapes at 128-512 rows (640 x 2,048: 2.72 / 3.27 ms at 512), so no dense copy of the
    int4 weights is kept here. (Before, q4n served up to 4 rows only: 0.675 / 0.714 ms at 16 rows,
    the four shapes summed, its activations quantized one element at a time through libm.)"""
    return "avx512_vnni" in info.flags and not any(f.startswith("amx") for f in info.flags)


def grouped_int8_served(info: CpuInfo | None = None) -> bool:
    """Whether int8 weights with group scales (``int8g``) are served here: where ``q8n`` serves int8
    weights at every row count. Elsewhere the loader rounds those types to per-row int8 as before."""
    return _q8n_everywhere(info or cpu_info(), None)


def _q8n_everywhere(info: CpuInfo, native8: bool | None) -> bool:
    """Whether int8 weights take ``q8n`` at every row count: where its AVX-512 VNNI or AVX2 path
    runs, on CPUs without AMX. Measured on an AMD EPYC (AVX-512 VNNI and BF16, no AMX), 2 threads,
    bf16 activations, best of 7 interleaved rounds (``bench.micro.int8_kernels``,
    docs/performance.md "Native int8 matmul"): Gemma 3's 262,144 x 640 LM head 6.3 / 26.4 / 51.3 /
    183 ms at 1 / 32 / 64 / 256 rows against 14.6 / 150 / 305 ms for PyTorch's int8 and 24.1 / 57.3
    / 88.3 / 252 ms for bf16 GEMM; SmolLM2's 49,152 x 576 head and Gemma's 4,096 x 640 and
    1,536 x 640 layers as fast or faster up to 64 rows (bf16 GEMM wins the two small layers at 256
    rows, by 3 % and 25 %: prefill chunks; the measured table may pick it there). Under the AVX2
    emulation (``CONFKV_CPU_ISA=avx2``, torch and oneDNN capped alike, fp32 activations; q8n's AVX2
    path) q8n beat fp32 GEMM 2-10x at 1-64 rows on the same shapes (head 5.6 vs 58.7 ms at 1 row,
    62.5 vs 174 ms at 32). One kernel at every row count also keeps one copy of the weights (the
    packed one) instead of int8 plus a dense copy. VNNI CPUs without native bf16 take it as well
    (their alternatives are fp32 GEMM and PyTorch's int8 with fp32 activations, slower than the ones
    measured). Not applied on AMX CPUs, unmeasured (oneDNN's bf16 GEMM on AMX may win at many rows)."""
    if native8 is None:
        native8 = native_int8_isa(info) in ("vnni", "avx2")
    return native8 and not any(f.startswith("amx") for f in info.flags) and (
        "avx512_vnni" in info.flags or {"avx2", "fma"} <= info.flags)


@dataclass
class KernelTable:
    """(kind, out_features, in_features) -> kernel name per ``ROW_GRID`` bucket."""

    choices: dict[str, list[str]]
    source: str  # 'derived' or 'measured'

    @staticmethod
    def key(kind: str, n: int, k: int) -> str:
        return f"{kind}:{n}x{k}"

    def plan(self, kind: str, n: int, k: int) -> list[tuple[int, str]]:
        """[(max rows, kernel)] ascending; rows above the last bucket use the last kernel."""
        names = self.choices.get(self.key(kind, n, k))
        if names is None:
            names = [derived_choice(kind, r, cpu_info()) for r in ROW_GRID]
        return list(zip(ROW_GRID, names, strict=True))


def derive_table(shapes: Sequence[tuple[str, int, int]], info: CpuInfo | None = None) -> KernelTable:
    info = info or cpu_info()
    return KernelTable({KernelTable.key(*s): [derived_choice(s[0], r, info) for r in ROW_GRID]
                        for s in shapes}, "derived")


def _time_candidates(fns: dict[str, KernelFn], x: Tensor, rounds: int) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn(x)  # warm-up (first-call packing, oneDNN primitive creation)
    for _ in range(rounds):  # interleaved, so a burst of outside load hits every candidate alike
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(x)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _make(name: str, kind: str, w: Tensor, dtype: torch.dtype) -> KernelFn:
    from confkv_engine.model.quant import quantize_int4, quantize_int8, quantize_int8_groups

    if name == "dense":
        return dense_kernel(w, None, dtype)
    if name in ("int4", "q4n"):
        return (int4_kernel if name == "int4" else q4n_kernel)(quantize_int4(w), None, dtype)
    if kind in ("int8g", "int8g16"):
        return q8n_kernel(quantize_int8_groups(w, 16 if kind == "int8g16" else 32), None, dtype)
    return (int8_kernel if name == "int8" else q8n_kernel)(quantize_int8(w), None, dtype)


def measure_table(shapes: Sequence[tuple[str, int, int]], dtype: torch.dtype, rounds: int = 5) -> KernelTable:
    """Time every candidate on random weights of each shape at every ``ROW_GRID`` row count."""
    choices: dict[str, list[str]] = {}
    gen = torch.Generator().manual_seed(0)
    for kind, n, k in shapes:
        w = torch.randn(n, k, generator=gen) * 0.02
        fns = {name: _make(name, kind, w, dtype) for name in candidates(kind)}
        names = []
        for rows in ROW_GRID:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            times = _time_candidates(fns, x, rounds)
            names.append(min(times, key=times.__getitem__))
        choices[KernelTable.key(kind, n, k)] = names
    return KernelTable(choices, "measured")


def _cache_path(shapes: Sequence[tuple[str, int, int]], dtype: torch.dtype, cache_dir: Path) -> Path:
    info = cpu_info()
    ident = json.dumps([info.model, info.capability, sorted(info.flags), torch.__version__,
                        torch.get_num_threads(), str(dtype), sorted(shapes), ROW_GRID])
    return cache_dir / f"kernels-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "confkv"


def load_or_measure(shapes: Sequence[tuple[str, int, int]], dtype: torch.dtype,
                    measure: bool | None = None, cache_dir: Path | None = None) -> KernelTable:
    """The measured table from the cache, else measured now (and cached) when tuning is on, else
    the derived one. ``measure`` None reads ``CONFKV_KERNEL_TUNE``."""
    if measure is None:
        measure = os.environ.get("CONFKV_KERNEL_TUNE", "").strip().lower() in ("1", "true", "yes")
    if not measure:
        return derive_table(shapes)
    path = _cache_path(shapes, dtype, cache_dir or default_cache_dir())
    try:
        return KernelTable(json.loads(path.read_text()), "measured")
    except (OSError, ValueError):
        pass
    start = time.perf_counter()
    table = measure_table(shapes, dtype)
    log.info("kernel table measured in %.1f s (cached in %s)", time.perf_counter() - start, path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table.choices, indent=1))
    except OSError as err:
        log.warning("could not cache the kernel table in %s: %s", path, err)
    return table
