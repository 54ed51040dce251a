"""What a live raise of ``maxCacheSize`` costs: ``KVCache.resize`` past the allocated pool
(``cache.storage.DeviceKV.grow``: one reallocation and copy), at SmolLM2-135M's block layout
(30 layers, 3 KV heads, head_dim 64, 16-token blocks), with the pool half full of written blocks so
the copy is real.

    .venv/bin/python -m bench.cache.pool_grow [--device cuda] [--repeats 3]

Prints one line per (dtype, from -> to) with the best and median milliseconds of the grow, and
writes bench/results/cache/pool_grow.json. The engine holds its lock for that long: the grow lands
between two steps and delays the next one by as much.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import machine, results_dir
from confkv_engine.cache.kv_cache import CacheSpec, KVCache, SeqKV

MIB = 1 << 20
SIZES = ((64 * MIB, 128 * MIB), (256 * MIB, 512 * MIB), (1024 * MIB, 2048 * MIB))


def grow_once(spec: CacheSpec, start: int, end: int) -> float:
    cache = KVCache.from_budget(spec, start, prefix_salt=b"bench")
    seq = SeqKV()
    cache.reserve(seq, cache.num_blocks // 4 * spec.block_size)  # half the pool: K and V tables
    cache.plan_writes([seq], [len(seq.k_blocks) * spec.block_size],
                      torch.arange(len(seq.k_blocks) * spec.block_size))
    if spec.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    cache.resize(end // spec.block_bytes - 1, memory_limit=end + spec.block_bytes)
    if spec.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=results_dir("cache") / "pool_grow.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        spec = CacheSpec(30, 3, 64, 16, dtype, device)
        for start, end in SIZES:
            times = [grow_once(spec, start, end) for _ in range(args.repeats)]
            row = {"dtype": str(dtype), "from_mib": start // MIB, "to_mib": end // MIB,
                   "block_bytes": spec.block_bytes, "best_ms": round(min(times), 1),
                   "median_ms": round(statistics.median(times), 1)}
            rows.append(row)
            print(f"{row['dtype']:>14} {row['from_mib']:>5} MiB -> {row['to_mib']:>5} MiB: "
                  f"best {row['best_ms']} ms, median {row['median_ms']} ms")
    out = args.out
    out.write_text(json.dumps({"device": str(device), "machine": machine(),
                               "threads": torch.get_num_threads(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
