"""Prefix-cache benchmark: the real cache manager on the traces of ``testkit.traces``, then the engine.

    python -m bench.cache.prefix_cache            # everything (a few minutes on one core)
    python -m bench.cache.prefix_cache --no-model # only the cache-manager replay (no model)

1. **Cache manager replay** (no model). Every request of a trace goes through ``KVCache`` exactly as
   the scheduler and the engine drive it: ``match`` (never the last prompt token) -> ``attach`` ->
   ``reserve`` -> ``commit`` -> ``register`` -> ``free``, serially, with the cache's own logical clock
   (one tick per admitted request). K/V contents are not written: only block ids, reference counts,
   the prefix index and the LRU-K order matter for the hit rate ("LRU-2 paper": LRU-K without chain
   history, for comparison). The pool holds ``2 * blocks + 1``
   blocks (K and V per cached block, plus the null block), so "blocks" is comparable with the
   simulator's in ``testkit.traces``, which this replay cross-checks: the two differ only where the
   simulator counts a fully cached block-aligned prompt as ``len - 1`` hit tokens (the engine
   recomputes that last block) and in how a request's own blocks compete with the cache.
2. **Engine, shared prefixes** (embedded SmolLM2-135M, fp32, one thread). A small seeded trace of
   hot system prompts and chats (token ids are random, only their equality matters), driven in
   process with four requests in flight (``bench.serving.peers.run_inprocess``), prefix cache on vs off:
   output tokens per second, time to first token, and how many greedy outputs agree.
3. **Repeated 2,000-token prompt**: time to first token of a cold prompt vs the same prompt again
   (every block but the last is shared), median of three distinct prompts; the cold time is also
   measured with the prefix cache off.

Results go to ``bench/results/cache/prefix_cache.json``; a table is printed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.common import results_dir, write_report
from bench.serving import peers
from confkv_engine.cache.eviction import LRUK
from testkit import traces
from testkit.prefix_replay import BLOCK_SIZE, replay

RESULTS = results_dir("cache") / "prefix_cache.json"
# name -> (K, chain history); "LRU-2 paper" is the paper's LRU-K (new blocks start with one reference)
POLICIES = {"LRU": (1, True), "LRU-2 paper": (2, False), "LRU-2": (2, True), "LRU-3": (3, True)}
TARGET_POINTS = 8.0  # LRU-2 over LRU on the scan-polluted trace at the middle size
TARGET_HIT_OVER_COLD = 0.2
# A trace small enough for the model on one core: a few hot prefixes, short chats, no scans.
ENGINE_TRACE = traces.TraceConfig(
    requests=24, prefixes=4, prefix_tokens=(300, 600), chat_share=0.5, active_chats=3, chat_turns=(2, 4),
    user_tokens=(10, 40), reply_tokens=(20, 60), question_tokens=(10, 60))
ENGINE_NEW_TOKENS = 8
ENGINE_CONCURRENCY = 4
REPEAT_PROMPT_TOKENS = 2000


def replay_table(seed: int) -> list[dict[str, Any]]:
    rows = []
    for name, cfg in traces.TRACES.items():
        trace = traces.make_trace(cfg, seed)
        for blocks in traces.CACHE_BLOCKS:
            row: dict[str, Any] = {"trace": name, "cache_blocks": blocks}
            for policy, (k, chain) in POLICIES.items():
                t0 = time.perf_counter()
                result = replay(trace, blocks, k, chain_history=chain)
                row[policy] = round(result.hit_rate, 4)
                row[f"{policy}_evictions"] = result.evictions
                row[f"{policy}_replay_s"] = round(time.perf_counter() - t0, 2)
                policy_factory = functools.partial(LRUK, k, chain_history=chain)
                sim = traces.simulate(trace, blocks, policy_factory, BLOCK_SIZE)
                row[f"{policy}_simulator"] = round(sim.hit_rate, 4)
            rows.append(row)
            print(f"  {name:<15} {blocks:>5} blocks: " + "  ".join(
                f"{p} {100 * row[p]:5.1f}%" for p in POLICIES), flush=True)
    return rows


# ------------------------------------------------------------------ engine


def make_engine(loaded: Any, prefix_cache: bool) -> Any:
    from confkv_api.config import ConfKVConfig
    from confkv_engine.core.engine import LLMEngine

    cfg = ConfKVConfig.model_validate({"confkv": {"maxCacheSize": "256Mi",
                                                  "prefixCache": {"enabled": prefix_cache}}})
    return LLMEngine(loaded, cfg)


def engine_shared_prefixes(loaded: Any, seed: int) -> dict[str, Any]:
    """The small hot-prefix trace through the engine, prefix cache on and off."""
    trace = traces.make_trace(ENGINE_TRACE, seed)
    reqs = [peers.Req(t, ENGINE_NEW_TOKENS) for t in trace]
    out: dict[str, Any] = {"requests": len(reqs), "prompt_tokens": sum(len(t) for t in trace),
                           "new_tokens": ENGINE_NEW_TOKENS, "concurrency": ENGINE_CONCURRENCY,
                           "trace": asdict(ENGINE_TRACE)}
    outputs: dict[str, list[list[int]]] = {}
    for label, enabled in (("off", False), ("on", True)):
        eng = make_engine(loaded, enabled)
        peers.run_inprocess(eng, [peers.Req(list(range(100, 140)), 2)], 1)  # warm-up
        base = eng.stats()
        result = peers.run_inprocess(eng, reqs, ENGINE_CONCURRENCY)
        stats = eng.stats()
        queried = stats.prefix_queried_tokens - base.prefix_queried_tokens
        hit = stats.prefix_hit_tokens - base.prefix_hit_tokens
        out[label] = {
            "wall_s": round(result.wall_s, 3),
            "output_tokens_per_s": round(result.tokens_per_s, 2),
            "total_tokens_per_s": round((result.output_tokens + out["prompt_tokens"]) / result.wall_s, 1),
            "ttft_p50_s": round(statistics.median(result.ttfts), 4),
            "ttft_mean_s": round(statistics.mean(result.ttfts), 4),
            "hit_rate": round(hit / queried, 4) if queried else 0.0,
            "num_preemptions": stats.num_preemptions,
        }
        outputs[label] = greedy_outputs(eng, trace)
        print(f"  engine prefix cache {label:<3}: {result.tokens_per_s:6.2f} out tok/s, "
              f"TTFT p50 {out[label]['ttft_p50_s']:.3f}s, hit rate {100 * out[label]['hit_rate']:.1f}%",
              flush=True)
    out["speedup_wall"] = round(out["off"]["wall_s"] / out["on"]["wall_s"], 3)
    out["ttft_p50_on_over_off"] = round(out["on"]["ttft_p50_s"] / out["off"]["ttft_p50_s"], 3)
    out["greedy_outputs_equal"] = sum(a == b for a, b in zip(outputs["on"], outputs["off"], strict=True))
    return out


def greedy_outputs(eng: Any, trace: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of a few of the trace's prompts (in one batch), for the on/off comparison."""
    from confkv_engine.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=ENGINE_NEW_TOKENS, ignore_eos=True)
    return [o.output_token_ids for o in eng.generate(trace[:6], params)]


def ttft(eng: Any, prompt: list[int]) -> float:
    from confkv_engine.core.sampling_params import SamplingParams

    [out] = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return out.first_token_time - out.arrival_time


def repeated_prompt(loaded: Any, seed: int, repeats: int = 3) -> dict[str, Any]:
    """TTFT of a 2,000-token prompt: cold (cache on and off) vs the same prompt again (a hit)."""
    rng = random.Random(seed)
    on, off = make_engine(loaded, True), make_engine(loaded, False)
    ttft(on, list(range(100, 164)))  # warm-up
    ttft(off, list(range(100, 164)))
    cold_on, cold_off, hit = [], [], []
    for _ in range(repeats):
        prompt = [rng.randrange(traces.VOCAB) for _ in range(REPEAT_PROMPT_TOKENS)]
        cold_off.append(ttft(off, prompt))
        cold_on.append(ttft(on, prompt))
        hit.append(ttft(on, prompt))
    med = statistics.median
    out = {"prompt_tokens": REPEAT_PROMPT_TOKENS, "repeats": repeats,
           "shared_tokens": (REPEAT_PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE,
           "ttft_cold_cache_off_s": round(med(cold_off), 4), "ttft_cold_cache_on_s": round(med(cold_on), 4),
           "ttft_hit_s": round(med(hit), 4), "all_s": {"cold_off": cold_off, "cold_on": cold_on, "hit": hit}}
    out["hit_over_cold"] = round(out["ttft_hit_s"] / out["ttft_cold_cache_off_s"], 4)
    print(f"  2,000-token prompt: cold {out['ttft_cold_cache_off_s']:.3f}s (cache off), "
          f"{out['ttft_cold_cache_on_s']:.3f}s (on), hit {out['ttft_hit_s']:.3f}s "
          f"= {out['hit_over_cold']:.3f}x cold", flush=True)
    return out


# ------------------------------------------------------------------ report


def targets(report: dict[str, Any]) -> dict[str, Any]:
    middle = traces.CACHE_BLOCKS[len(traces.CACHE_BLOCKS) // 2]
    row = next(r for r in report["cache_manager"]
               if r["trace"] == "scan-polluted" and r["cache_blocks"] == middle)
    gain = round(100 * (row["LRU-2"] - row["LRU"]), 2)
    out: dict[str, Any] = {"lru2_minus_lru_points_scan_polluted_middle": gain,
                           "lru2_paper_minus_lru_points": round(100 * (row["LRU-2 paper"] - row["LRU"]), 2),
                           "lru2_gain_target_points": TARGET_POINTS, "lru2_gain_met": gain >= TARGET_POINTS}
    rep = report.get("repeated_prompt")
    if rep:
        out.update(hit_over_cold=rep["hit_over_cold"], hit_over_cold_target=TARGET_HIT_OVER_COLD,
                   hit_over_cold_met=rep["hit_over_cold"] <= TARGET_HIT_OVER_COLD)
    return out


def print_table(report: dict[str, Any]) -> None:
    names = list(POLICIES)
    head = f"{'trace':<15} {'blocks':>6} " + " ".join(f"{n:>11}" for n in names) + "  LRU-2-LRU  (simulator)"
    print("\n" + head + "\n" + "-" * len(head))
    for row in report["cache_manager"]:
        rates = " ".join(f"{100 * row[n]:10.1f}%" for n in names)
        sim = " ".join(f"{100 * row[f'{n}_simulator']:.1f}" for n in names)
        gain = 100 * (row["LRU-2"] - row["LRU"])
        print(f"{row['trace']:<15} {row['cache_blocks']:>6} {rates}  {gain:+6.1f} pt  ({sim})")
    eng = report.get("engine")
    if eng:
        print(f"\nengine, {eng['requests']} requests, C={eng['concurrency']}:  "
              f"{'':<4}{'out tok/s':>10} {'TTFT p50':>9} {'hit rate':>9}")
        for label in ("off", "on"):
            r = eng[label]
            print(f"  prefix cache {label:<3}{'':<22}{r['output_tokens_per_s']:>10.2f} "
                  f"{r['ttft_p50_s']:>8.3f}s {100 * r['hit_rate']:>8.1f}%")
        print(f"  wall speedup {eng['speedup_wall']:.2f}x, "
              f"greedy outputs equal {eng['greedy_outputs_equal']}/6")
    print("\ntargets:", json.dumps(report["targets"]))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-model", action="store_true", help="only the cache-manager replay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads for the engine runs")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "threads": args.threads, "load_average_at_start": os.getloadavg()},
        "seed": args.seed, "block_size": BLOCK_SIZE,
        "traces": {name: asdict(cfg) for name, cfg in traces.TRACES.items()},
    }
    print("cache manager replay (real KVCache, no model):", flush=True)
    report["cache_manager"] = replay_table(args.seed)
    if not args.no_model:
        from confkv_engine.model.loader import load_model

        torch.set_num_threads(args.threads)
        loaded = load_model("builtin:smollm2-135m", dtype=torch.float32, device="cpu")
        print("engine (SmolLM2-135M, fp32):", flush=True)
        with torch.inference_mode():
            report["engine"] = engine_shared_prefixes(loaded, args.seed)
            report["repeated_prompt"] = repeated_prompt(loaded, args.seed)
    report["targets"] = targets(report)
    report["machine"]["load_average_at_end"] = os.getloadavg()
    print_table(report)
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
