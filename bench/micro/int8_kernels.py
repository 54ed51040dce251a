"""The int8-weight kernels side by side on real layer shapes: PyTorch's weight-only int8, bf16 (or
fp32) GEMM on a dense copy, and the native ``q8n`` (model/_q8matmul.c), at a few row counts.

Random weights (``quantize_int8`` of N(0, 0.02)), activations N(0, 1) in the kernel table's
activation dtype, ``--threads`` threads. Every candidate is timed in the same rounds, interleaved
(a burst of outside load hits them alike), best of ``--rounds``; PyTorch's int8 is left out above
``--int8-max-rows`` (it grows linearly with the rows and already loses several times over at 64).

    python -m bench.micro.int8_kernels --out int8-kernels.json

``--out NAME`` writes ``bench/results/micro/NAME`` (shapes, rows, milliseconds; no paths).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from confkv_engine.model import kernels
from confkv_engine.model.quant import quantize_int8

OUT_DIR = Path(__file__).resolve().parents[1] / "results" / "micro"
# Gemma 3 270M: tied LM head, fused gate/up, fused q/k/v; SmolLM2 135M: tied LM head
SHAPES = "262144x640,4096x640,1536x640,49152x576"


def best_ms(fns: dict[str, kernels.KernelFn], x: torch.Tensor, rounds: int) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn(x)  # warm-up
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(x)
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="comma-separated NxK (out x in features)")
    p.add_argument("--rows", default="1,4,16,32,64,256")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--int8-max-rows", type=int, default=64)
    p.add_argument("--out", help="file name under bench/results/micro")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = kernels.activation_dtype()
    isa = kernels.native_int8_isa()
    results = []
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        weight = quantize_int8(torch.randn(n, k, generator=gen) * 0.02)
        fns = {"int8": kernels.int8_kernel(weight, None, dtype),
               "dense": kernels.dense_kernel(weight.dequantize(), None, dtype)}
        if isa is not None:
            fns["q8n"] = kernels.q8n_kernel(weight, None, dtype)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            timed = {name: fn for name, fn in fns.items() if name != "int8" or rows <= args.int8_max_rows}
            ms = best_ms(timed, x, args.rounds)
            row = {"shape": shape, "rows": rows, "ms": ms}
            if "q8n" in ms:
                row["q8n_speedup"] = {name: ms[name] / ms["q8n"] for name in ms if name != "q8n"}
            results.append(row)
            cells = ", ".join(f"{name} {v:.3f} ms" for name, v in ms.items())
            print(f"{shape} rows {rows}: {cells}", flush=True)
    if args.out:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python -m bench.micro.int8_kernels " + " ".join(argv),
                "cpu": kernels.cpu_info().model, "threads": args.threads, "dtype": str(dtype),
                "q8n_isa": isa, "rounds": args.rounds}
        (OUT_DIR / args.out).write_text(json.dumps({**meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
