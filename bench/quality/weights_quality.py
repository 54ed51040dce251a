"""Perplexity of the embedded model under every ``--weights`` mode, against the fp32 dequantized model.

Text: the same ``pydoc_data.topics`` text as ``bench/quality/kv_quality.py`` (tokenized without BOS);
four 1,024-token windows from the start. Each window runs through the model with the dense
reference attention in chunks of ``--chunk`` tokens (default 16: a chunk that size is served by
the quantized weight-only kernels, as decode steps are; prefill-sized chunks run on the dense copy
of the same weights and so measure the dense model). Perplexity = exp(mean NLL of every token
after the first of each window, pooled).

    python -m bench.quality.weights_quality    # all modes, JSON in bench/results/quality/weights_quality.json

``--model`` picks another model; ``--q8n-ab`` runs every mode listed a second time with the native
int8 kernel turned off (``CONFKV_NATIVE_INT8=0``, row label ``MODE/q8n-off``), in the same process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from bench.common import results_dir
from confkv_engine.model.llama import DenseAttention
from confkv_engine.model.loader import WEIGHT_MODES, load_model

MODEL = "builtin:smollm2-135m"


def pydoc_tokens(tokenizer) -> list[int]:
    from pydoc_data.topics import topics

    return tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)), add_bos=False)


def window_nll(model, tokens: list[int], chunk: int) -> tuple[float, int]:
    backend = DenseAttention()
    ids = torch.tensor(tokens)
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, chunk):
        end = min(start + chunk, len(tokens) - 1)
        hidden = model(ids[start:end], torch.arange(start, end), backend)
        logprobs = model.compute_logits(hidden).log_softmax(-1)
        total -= logprobs.gather(1, ids[start + 1:end + 1, None]).sum().item()
        count += end - start
    return total, count


def perplexity(model: str, mode: str, windows: list[list[int]], chunk: int, q8n: bool = True) -> dict:
    if q8n:
        os.environ.pop("CONFKV_NATIVE_INT8", None)
    else:
        os.environ["CONFKV_NATIVE_INT8"] = "0"  # read when the model's kernel table is made
    start = time.perf_counter()
    loaded = load_model(model, torch.float32, "cpu", weights=mode)
    load_s = time.perf_counter() - start
    total, count = 0.0, 0
    with torch.inference_mode():
        for w in windows:
            t, c = window_nll(loaded.model, w, chunk)
            total, count = total + t, count + c
    return {"weights": loaded.weights, "dtype": str(loaded.dtype).removeprefix("torch."),
            "kernel_table": loaded.kernel_table, "load_s": round(load_s, 2),
            "ppl": math.exp(total / count), "tokens": count}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default=",".join(("fp32", "bf16", "int8", "int4", "auto")))
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--threads", type=int)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--q8n-ab", action="store_true", help="each mode also with CONFKV_NATIVE_INT8=0")
    p.add_argument("--out", type=Path, default=results_dir("quality") / "weights_quality.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = args.weights.split(",")
    unknown = sorted(set(modes) - set(WEIGHT_MODES))
    if unknown:
        p.error(f"unknown weights mode(s) {unknown}; choose from {WEIGHT_MODES}")
    tokens = pydoc_tokens(load_model(args.model, torch.float32, "cpu").tokenizer)
    windows = [tokens[i * args.size:(i + 1) * args.size] for i in range(args.windows)]
    rows = {mode: perplexity(args.model, mode, windows, args.chunk) for mode in modes}
    if args.q8n_ab:
        rows.update({f"{mode}/q8n-off": perplexity(args.model, mode, windows, args.chunk, q8n=False)
                     for mode in modes if mode not in ("fp32", "bf16")})
    base = rows.get("fp32", next(iter(rows.values())))["ppl"]
    print("| --weights | served as | activations | perplexity | vs fp32 | load s |")
    print("|---|---|---|---|---|---|")
    for mode, r in rows.items():
        r["vs_fp32_pct"] = round(100 * (r["ppl"] / base - 1), 3)
        print(f"| {mode} | {r['weights']} | {r['dtype']} | {r['ppl']:.4f} | {r['vs_fp32_pct']:+.2f}% "
              f"| {r['load_s']:.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "chunk": args.chunk, "windows": args.windows,
                                    "size": args.size, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
