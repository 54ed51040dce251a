"""Where a decode step of the overhead scenario goes: ``torch.profiler`` over ``--steps`` decode
steps of ``--batch`` sequences with ``--seq-len`` cached tokens (one variant of
``bench.quality.kv_quality --scenario overhead``, default conf-kv+tiers at f = 0.25), the median step time
and the ops by self CPU time. The per-change profile lines in docs/notes/retention-journal.md come from it:

    python -m bench.micro.profile_tiers_decode --seq-len 2048 --batch 8 --steps 20

CPU, fp32 cache, 1 thread (``OMP_NUM_THREADS``), as the scenario. Profiling adds its own cost, so the
absolute times are above the scenario's; compare two runs of this script, not with it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.quality.kv_scenarios import greedy, make_engine, variant_config
from testkit.kv_runs import CHUNK, make_config, parse_args, pydoc_tokens

VARIANTS = ("full", "streaming", "conf-kv", "conf-kv+tiers")
WARMUP_STEPS = 4  # decode steps before the profiled ones (first-call allocations)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="conf-kv+tiers", choices=VARIANTS)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=20, help="ops printed")
    ap.add_argument("--in-place", action="store_true", help="attend with the paged kernels, not the gather")
    ap.add_argument("--codes", action="store_true",
                    help="attend compressed blocks from their codes instead of decoding them into the table")
    mine = ap.parse_args()
    from confkv_engine.model.loader import load_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    loaded = load_model("builtin:smollm2-135m", torch.float32, "cpu")
    loaded.model.eval()
    tokens = pydoc_tokens(loaded.tokenizer)
    args = parse_args([])  # the served settings the scenario uses
    total = WARMUP_STEPS + mine.steps + 2
    probe = make_engine(loaded, make_config("full", None, args))
    blocks = mine.batch * probe.cache.blocks_for_tokens(mine.seq_len + total) + 8
    eng = make_engine(loaded, variant_config(mine.variant, args), blocks=blocks, batched=mine.batch * CHUNK)
    if mine.in_place or mine.codes:
        import dataclasses

        from confkv_engine.attention.retention import RetentionAttention
        from confkv_engine.core.engine import LLMEngine

        backend = RetentionAttention(eng.parts.cache, loaded.model.args.num_heads, in_place=mine.in_place,
                                     from_codes=mine.codes)
        eng = LLMEngine(loaded, parts=dataclasses.replace(eng.parts, backend=backend))
    for i in range(mine.batch):
        eng.add_request(f"p{i}", tokens[i * mine.seq_len:(i + 1) * mine.seq_len], greedy(total))
    while not all(s.num_computed >= s.prompt_len for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # prefill
    for _ in range(WARMUP_STEPS):
        eng.step()
    times = []
    with torch.profiler.profile() as prof:
        for _ in range(mine.steps):
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
    path = " in place" if mine.in_place else " codes" if mine.codes else ""
    print(f"{mine.variant}{path}: batch {mine.batch} x {mine.seq_len} cached tokens, "
          f"{mine.steps} decode steps, median step {statistics.median(times) * 1e3:.1f} ms (profiled)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=mine.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
