"""The quantized-weight kernels side by side on real layer shapes: PyTorch's weight-only int8 (or
int4), bf16 (or fp32) GEMM on a dense copy, and the native block kernel (``q8n`` / ``q4n``,
model/_q8matmul.c), at a few row counts.

``--kind``: ``int8`` (one scale per row: ``quantize_int8``), ``int8g`` (a scale per row and group of
32, as GGUF's Q8_0 / Q5_0 are served, or of ``--group 16``, as Q6_K's sub-blocks; PyTorch's per-row
int8 of the same values beside it) or
``int4`` (groups of 32: ``quantize_int4``, PyTorch's int4 beside it). ``--codes q5`` (int8g, groups
of 32) / ``q6`` (``--group 16``): codes in Q5_0's -16..15 / Q6_K's -32..31, narrow blocks
(model/_q8avx2.c), with ``q8n-sign``, the same weight through the sign-trick tile, beside ``q8n``.
Random weights (N(0, 0.02)), activations N(0, 1) in the kernel table's
activation dtype, ``--threads`` threads. Every candidate is timed in the same rounds, interleaved
(a burst of outside load hits them alike), best of ``--rounds``; PyTorch's int8 is left out above
``--int8-max-rows`` (it grows linearly with the rows and already loses several times over at 64).

    python -m bench.micro.int8_kernels --out int8-kernels.json
    python -m bench.micro.int8_kernels --kind int4 --shapes 960x576,576x576,3072x576,576x1536 \
        --rows 1,4,16,32 --out int4-kernels.json
    python -m bench.micro.int8_kernels --kind int8g --codes q5 --shapes 4096x640,1536x640 \
        --rows 1,4,32,256,512,2048 --out int8g-q5-kernels.json

``--out NAME`` writes ``bench/results/micro/NAME`` (shapes, rows, milliseconds; no paths).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from confkv_engine.model import kernels, q8native
from confkv_engine.model.quant import Int8GroupWeight, quantize_int4, quantize_int8, quantize_int8_groups

OUT_DIR = Path(__file__).resolve().parents[1] / "results" / "micro"
# Gemma 3 270M: tied LM head, fused gate/up, fused q/k/v; SmolLM2 135M: tied LM head
SHAPES = "262144x640,4096x640,1536x640,49152x576"


def best_ms(fns: dict[str, kernels.KernelFn], x: torch.Tensor, rounds: int) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn(x)  # warm-up
    names = list(fns)
    for i in range(rounds):  # the order rotates: a call right after PyTorch's (whose OpenMP threads
        for name in names[i % len(names):] + names[:i % len(names)]:  # still spin) is no one's alone
            start = time.perf_counter()
            fns[name](x)
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def narrow_codes(w: torch.Tensor, group: int) -> Int8GroupWeight:
    """``w`` in groups of 32 with codes in -16..15 (Q5_0's range) or of 16 with codes in -32..31
    (Q6_K's), fp16 scales."""
    c = 16 if group == 32 else 32
    groups = w.view(w.shape[0], -1, group)
    scale = (groups.abs().amax(-1) / c).half().float().clamp_min(2 ** -14)
    q = torch.round(groups / scale[..., None]).clamp(-c, c - 1).to(torch.int8)
    return Int8GroupWeight(q.view(w.shape), scale, group)


def candidates(kind: str, w: torch.Tensor, dtype: torch.dtype, group: int = 32,
               codes: str = "int8") -> tuple[dict[str, kernels.KernelFn], Any]:
    """PyTorch's weight-only kernel and the dense copy for ``kind``, and the weight the native
    kernel gets."""
    if kind == "int4":
        weight: Any = quantize_int4(w)
        return {"int4": kernels.int4_kernel(weight, None, dtype),
                "dense": kernels.dense_kernel(weight.dequantize(), None, dtype)}, weight
    if kind == "int8g":
        weight = narrow_codes(w, group) if codes in ("q5", "q6") else quantize_int8_groups(w, group)
    else:
        weight = quantize_int8(w)
    per_row = quantize_int8(weight.dequantize())
    return {"int8": kernels.int8_kernel(per_row, None, dtype),
            "dense": kernels.dense_kernel(weight.dequantize(), None, dtype)}, weight


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="comma-separated NxK (out x in features)")
    p.add_argument("--rows", default="1,4,16,32,64,256")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--int8-max-rows", type=int, default=64)
    p.add_argument("--kind", choices=("int8", "int8g", "int4"), default="int8")
    p.add_argument("--group", type=int, default=32, choices=(16, 32), help="int8g: inputs per scale")
    p.add_argument("--codes", choices=("int8", "q5", "q6"), default="int8",
                   help="int8g: codes over int8's range, Q5_0's -16..15 (groups of 32) or Q6_K's -32..31 "
                        "(--group 16); q5 / q6: q8n-sign beside q8n")
    p.add_argument("--out", help="file name under bench/results/micro")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.codes != "int8" and (args.kind != "int8g" or args.group != {"q5": 32, "q6": 16}[args.codes]):
        p.error("--codes q5 needs --kind int8g (groups of 32), q6 --kind int8g --group 16")
    torch.set_num_threads(args.threads)
    dtype = kernels.activation_dtype()
    isa = kernels.native_int8_isa() if args.kind != "int4" else kernels.native_isa()
    native = "q4n" if args.kind == "int4" else "q8n"
    results = []
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        fns, weight = candidates(args.kind, torch.randn(n, k, generator=gen) * 0.02, dtype, args.group,
                                 args.codes)
        if isa is not None:
            fns[native] = (kernels.q4n_kernel if args.kind == "int4" else kernels.q8n_kernel)(
                weight, None, dtype)  # type: ignore[arg-type]
        if isa is not None and args.codes != "int8":  # the same packed codes without the narrow flags
            plain = dataclasses.replace(q8native.pack(weight), narrow=None)
            fns["q8n-sign"] = q8native.bound(plain, isa, dtype)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            timed = {name: fn for name, fn in fns.items()
                     if name not in ("int8", "int4") or rows <= args.int8_max_rows}
            ms = best_ms(timed, x, args.rounds)
            row = {"shape": shape, "rows": rows, "ms": ms}
            if native in ms:
                row[f"{native}_speedup"] = {name: ms[name] / ms[native] for name in ms if name != native}
            results.append(row)
            cells = ", ".join(f"{name} {v:.3f} ms" for name, v in ms.items())
            print(f"{shape} rows {rows}: {cells}", flush=True)
    if args.out:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python -m bench.micro.int8_kernels " + " ".join(argv),
                "cpu": kernels.cpu_info().model, "threads": args.threads, "dtype": str(dtype),
                "kind": args.kind, "group": args.group if args.kind == "int8g" else None, "native_isa": isa,
                "codes": args.codes,
                "rounds": args.rounds}
        (OUT_DIR / args.out).write_text(json.dumps({**meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
