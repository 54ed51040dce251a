"""Per-layer cost of the decode attention pieces at long context, outside the engine.

For B sequences of S cached tokens (SmolLM2-135M's 3 KV heads x 64, 3 query heads per KV head,
16-token blocks, bf16), one layer's: block gather into a fresh tensor and into a reused one, the
bf16 flash kernel on the gathered K/V, the fp32 path the backend used to take (upcast q, K, V,
then the fp32 kernel), and attending the pool in place per 512-token run with a log-sum-exp
combine (the layout chunked prefill produces). Numbers for docs/performance.md.

    python -m bench.micro.decode_attention --threads 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from confkv_engine.attention.partial import attend_lse, combine

HKV, G, D, BS, CHUNK = 3, 3, 64, 16, 512


def ms(fn: Callable[[], object], n: int = 30) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return round((time.perf_counter() - start) / n * 1e3, 3)


def case(b: int, s: int) -> dict[str, float]:
    per_chunk = CHUNK // BS
    chunks = s // CHUNK
    pool = torch.randn(2 * b * s // BS + 8, BS, HKV, D).bfloat16()
    # As chunked prefill reserves: per sequence and chunk, its K blocks then its V blocks.
    table = torch.arange(2 * b * s // BS).view(b, chunks, 2, per_chunk).permute(2, 0, 1, 3).reshape(-1)
    q = torch.randn(b, HKV, G, D).bfloat16()
    mask = torch.zeros(b, 1, 1, s).bfloat16()
    buf = torch.empty(table.numel(), BS, HKV, D, dtype=torch.bfloat16)
    both = pool.index_select(0, table).view(2, b, s, HKV, D).transpose(2, 3)
    k, v = both[0], both[1]
    flat = pool.view(-1, HKV, D)

    def in_place() -> None:
        for row in range(b):
            parts = []
            for c in range(chunks):
                k0 = (row * chunks + c) * 2 * CHUNK
                keys = flat[k0:k0 + CHUNK].transpose(0, 1)[None]
                vals = flat[k0 + CHUNK:k0 + 2 * CHUNK].transpose(0, 1)[None]
                out, lse = attend_lse(q[row:row + 1], keys, vals)
                parts.append((out[0], lse[0]))
            combine(parts)

    return {
        "gather_fresh": ms(lambda: pool.index_select(0, table)),
        "gather_reused": ms(lambda: torch.index_select(pool, 0, table, out=buf)),
        "sdpa_bf16": ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
        "upcast_sdpa_fp32": ms(lambda: F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                      attn_mask=mask.float())),
        "pool_runs_in_place": ms(in_place),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batches", default="1,8,32")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"ms per layer, {args.context} cached tokens per sequence, {args.threads} threads")
    for b in (int(x) for x in args.batches.split(",")):
        print(b, case(b, args.context), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
