"""Sub-benchmarks of ``bench/kv_quality.py``, one per ``--scenario``:

- ``long``: the guide's scenario scaled to the embedded model: a short pydoc prompt, then
  ``--gen`` generated tokens (``ignore_eos``, greedy); peak KV bytes of the full cache vs conf-kv at
  f = 0.25, read from the pool, and their ratio.
- ``concurrency``: a pool that holds exactly 4 full-cache requests of ``--seq-len`` tokens
  (``--seq-len - 64`` prompt + 64 generated); ``--requests`` such requests submitted at once per
  policy at f = 0.25: the most running in one step, and the preemptions (the full cache gets 4
  requests: 5 cannot all be held, so 4 is its zero-preemption maximum by construction).
- ``overhead``: 8 sequences with ``--seq-len`` cached tokens decoding together; the median engine
  step time over the decode steps for full (its fastest attention path: no scoring), streaming and
  conf-kv at f = 0.25; ratios conf-kv / streaming and conf-kv / full, on the mean (amortised: the
  steps span whole decision intervals, so it includes scoring and compaction) and on the median
  (a plain decode step).

Results are merged into ``bench/results/kv_quality.json`` under ``scenarios`` (the perplexity
table is kept). All on CPU fp32, prefill chunks of 32, block 16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from kv_quality import CHUNK, RESULTS, load_results, make_config, pydoc_tokens

F = 0.25
GEN_TAIL = 64  # generated tokens per concurrency request
SIZES = {  # scenario -> (full size, quick size)
    "long": ({"gen": 4000}, {"gen": 1000}),
    "concurrency": ({"seq_len": 2048, "requests": 16}, {"seq_len": 512, "requests": 16}),
    # 64 / 40 decode steps cover two / one decision intervals (32), so the mean includes scoring.
    "overhead": ({"seq_len": 2048, "batch": 8, "repeats": 64}, {"seq_len": 512, "batch": 8, "repeats": 40}),
}


def make_engine(loaded, cfg, blocks: int | None = None, batched: int = CHUNK):
    from confkv_api.config import load_config
    from confkv_engine.cache.kv_cache import CacheSpec
    from confkv_engine.core.engine import LLMEngine

    a = loaded.model.args
    spec = CacheSpec(a.num_layers, a.num_kv_heads, a.head_dim, 16, torch.float32, torch.device("cpu"))
    size = blocks * spec.block_bytes if blocks else 512 * 2**20
    config = load_config({"engine": {"prefillChunk": CHUNK, "maxNumBatchedTokens": batched, "blockSize": 16,
                                     "maxBatchSize": 64},
                          "confkv": {"maxCacheSize": str(size)}})
    return LLMEngine(loaded, config, retention=cfg)


def greedy(max_tokens: int):
    from confkv_engine.core.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def scenario_long(loaded, tokens, args, size) -> dict:
    prompt = tokens[:64]
    out = {}
    for name, f in (("full", None), ("conf-kv", F)):
        eng = make_engine(loaded, make_config(name, f, args))
        t0 = time.time()
        res = eng.generate([prompt], greedy(size["gen"]))[0]
        out[name] = {"peak_kv_bytes": res.kv_usage.peak_kv_bytes, "generated": len(res.output_token_ids),
                     "tokens_discarded": res.kv_usage.tokens_discarded, "seconds": round(time.time() - t0, 1)}
    out["ratio_conf_kv_to_full"] = out["conf-kv"]["peak_kv_bytes"] / out["full"]["peak_kv_bytes"]
    full_mib = out["full"]["peak_kv_bytes"] / 2**20
    print(f"long: {size['gen']} generated tokens, peak KV full {full_mib:.1f} MiB, "
          f"conf-kv f={F} {out['conf-kv']['peak_kv_bytes'] / 2**20:.1f} MiB, "
          f"ratio {out['ratio_conf_kv_to_full']:.3f}")
    return out


def scenario_concurrency(loaded, tokens, args, size) -> dict:
    seq_len, plen = size["seq_len"], size["seq_len"] - GEN_TAIL
    probe = make_engine(loaded, make_config("full", None, args))
    blocks = 4 * probe.cache.blocks_for_tokens(seq_len)  # exactly 4 full-cache requests
    out = {"pool_blocks": blocks}
    print(f"concurrency: pool {blocks} blocks = 4 x {seq_len} tokens full; f={F}")
    print(f"{'policy':<12}{'submitted':>10}{'max running':>12}{'preemptions':>12}{'vs full':>9}")
    for name in ("full", "streaming", "h2o", "conf-kv"):
        f = None if name == "full" else F
        eng = make_engine(loaded, make_config(name, f, args), blocks=blocks, batched=16 * CHUNK)
        n = 4 if name == "full" else size["requests"]
        for i in range(n):
            eng.add_request(f"c{i}", tokens[i * plen:(i + 1) * plen], greedy(GEN_TAIL))
        most, t0 = 0, time.time()
        while eng.has_unfinished():
            eng.step()
            most = max(most, len(eng.scheduler.running))
        out[name] = {"submitted": n, "max_running": most, "preemptions": eng.scheduler.num_preemptions,
                     "seconds": round(time.time() - t0, 1)}
        out[name]["vs_full"] = most / out["full"]["max_running"]
        print(f"{name:<12}{n:>10}{most:>12}{eng.scheduler.num_preemptions:>12}{out[name]['vs_full']:>9.2f}")
    return out


def scenario_overhead(loaded, tokens, args, size) -> dict:
    seq_len, batch = size["seq_len"], size["batch"]
    out: dict = {}
    probe = make_engine(loaded, make_config("full", None, args))
    blocks = batch * probe.cache.blocks_for_tokens(seq_len + size["repeats"] + 2) + 8  # all 8 full caches fit
    for name in ("full", "streaming", "conf-kv"):
        f = None if name == "full" else F
        eng = make_engine(loaded, make_config(name, f, args), blocks=blocks, batched=batch * CHUNK)
        for i in range(batch):
            eng.add_request(f"o{i}", tokens[i * seq_len:(i + 1) * seq_len], greedy(size["repeats"] + 2))
        times = []
        while eng.has_unfinished():
            decoding = all(s.num_computed >= s.prompt_len for s in eng.scheduler.running)
            full_batch = len(eng.scheduler.running) == batch and not eng.scheduler.waiting
            t0 = time.perf_counter()
            eng.step()
            if decoding and full_batch:
                times.append(time.perf_counter() - t0)
        out[name] = {"median_step_s": statistics.median(times), "mean_step_s": statistics.mean(times),
                     "steps": len(times)}
    for stat in ("mean", "median"):
        conf, key = out["conf-kv"][f"{stat}_step_s"], f"{stat}_step_s"
        out[f"conf_kv_vs_streaming_{stat}"] = conf / out["streaming"][key]
        out[f"conf_kv_vs_full_{stat}"] = conf / out["full"][key]
        print(f"overhead: batch {batch}, {seq_len} cached tokens, f={F}; {stat} decode step: " + ", ".join(
            f"{n} {out[n][key] * 1e3:.1f} ms" for n in ("full", "streaming", "conf-kv")))
        print(f"  conf-kv / streaming {out[f'conf_kv_vs_streaming_{stat}']:.3f}, "
              f"conf-kv / full {out[f'conf_kv_vs_full_{stat}']:.3f}")
    return out


SCENARIOS = {"long": scenario_long, "concurrency": scenario_concurrency, "overhead": scenario_overhead}


def run_scenario(args: argparse.Namespace) -> int:
    import os

    from confkv_engine.model.loader import load_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    loaded = load_model("builtin:smollm2-135m", torch.float32, "cpu")
    loaded.model.eval()
    tokens = pydoc_tokens(loaded.tokenizer)
    size = SIZES[args.scenario][1 if args.quick else 0]
    result = SCENARIOS[args.scenario](loaded, tokens, args, size)
    result.update({"size": size, "quick": args.quick, "f": F, "chunk": CHUNK, "torch": torch.__version__})
    out = Path(args.out) if args.out else RESULTS / "kv_quality.json"
    data = load_results(out)  # merge: the perplexity table stays
    key = f"{args.scenario}{'_quick' if args.quick else ''}"
    data.setdefault("scenarios", {})[key] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, default=str))
    return 0
