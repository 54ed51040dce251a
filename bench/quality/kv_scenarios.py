"""Sub-benchmarks of ``bench/quality/kv_quality.py``, one per ``--scenario``:

- ``long``: the guide's scenario scaled to the embedded model: a short pydoc prompt, then
  ``--gen`` generated tokens (``ignore_eos``, greedy); peak KV bytes of the full cache vs conf-kv and
  conf-kv+tiers at f = 0.25, read from the pool, and their ratios.
- ``concurrency``: a pool that holds exactly 4 full-cache requests of ``--seq-len`` tokens (+ the null block)
  (``--seq-len - 64`` prompt + 64 generated); ``--requests`` such requests submitted at once per
  policy at f = 0.25 (conf-kv+tiers included): the most running in one step, and the preemptions
  (the full cache gets 4 requests: 5 cannot all be held, so 4 is its zero-preemption maximum by
  construction).
- ``overhead``: 8 sequences with ``--seq-len`` cached tokens decoding together; the median engine
  step time over the decode steps for full (its fastest attention path: no scoring), streaming,
  conf-kv and conf-kv+tiers at f = 0.25; ratios to streaming and to full, on the mean (amortised: the
  steps span whole decision intervals, so it includes scoring and compaction) and on the median
  (a plain decode step).

``conf-kv+tiers`` is conf-kv with the precision chain ``--tiers`` (default: the served
``confkv.tiers`` without ``full``, int4,k4v2,int2) and the served tier defaults. ``--variants`` runs a
subset (the full cache always runs: the ratios are to it). Results are merged into
``bench/results/quality/kv_quality.json`` under ``scenarios`` (the perplexity table is kept; a subset run
updates its variants only). All on CPU fp32, prefill chunks of 32, block 16, served ``kv_budget``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import load_results, results_dir
from testkit.kv_runs import CHUNK, SERVED, make_config, pydoc_tokens

F = 0.25
DEFAULT_TIERS = ",".join(t for t in SERVED.tiers if t != "full")  # conf-kv+tiers: the served chain
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


def tiers_of(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(t for t in (args.tiers or DEFAULT_TIERS).split(",") if t)


def variant_config(name: str, args: argparse.Namespace):
    """The retention config of a scenario variant: the full cache, a peer or conf-kv at f = F."""
    if name == "full":
        return make_config("full", None, args)
    if name == "conf-kv+tiers":
        return make_config("conf-kv", F, args, precisions=tiers_of(args))
    return make_config(name, F, args)


def selected(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """``--policies`` within ``names`` (all by default), ``full`` first."""
    wanted = set(args.policies.split(",")) if args.policies else set(names)
    unknown = wanted - set(names)
    if unknown:
        raise SystemExit(f"unknown scenario variant(s) {sorted(unknown)}; choose from {', '.join(names)}")
    return [n for n in names if n in wanted]


def reference_full(out: dict, prev: dict) -> dict:
    """The full cache's row: measured in this run or stored by an earlier piece of it."""
    full = out.get("full") or prev.get("full")
    if full is None:
        raise SystemExit("no full-cache row yet: include 'full' in --policies")
    return full


def scenario_long(loaded, tokens, args, size, prev: dict) -> dict:
    prompt = tokens[:64]
    out: dict = {}
    for name in selected(args, ("full", "conf-kv", "conf-kv+tiers")):
        eng = make_engine(loaded, variant_config(name, args))
        t0 = time.time()
        res = eng.generate([prompt], greedy(size["gen"]))[0]
        u = res.kv_usage
        out[name] = {"peak_kv_bytes": u.peak_kv_bytes, "generated": len(res.output_token_ids),
                     "tokens_discarded": u.tokens_discarded, "tokens_int4": u.tokens_int4,
                     "tokens_int2": u.tokens_int2, "seconds": round(time.time() - t0, 1)}
    full = reference_full(out, prev)
    for name, row in out.items():
        row["vs_full"] = row["peak_kv_bytes"] / full["peak_kv_bytes"]
        print(f"long: {size['gen']} generated tokens, {name} f={F}: peak KV "
              f"{row['peak_kv_bytes'] / 2**20:.1f} MiB, {row['vs_full']:.3f} of full")
    return out


def scenario_concurrency(loaded, tokens, args, size, prev: dict) -> dict:
    seq_len, plen = size["seq_len"], size["seq_len"] - GEN_TAIL
    probe = make_engine(loaded, make_config("full", None, args))
    # Exactly 4 full-cache requests: their blocks plus the null block every pool reserves (without
    # it the pool held 4 x 2,048 tokens only because the last sampled token is never cached).
    blocks = 4 * probe.cache.blocks_for_tokens(seq_len) + 1
    out: dict = {"pool_blocks": blocks}
    print(f"concurrency: pool {blocks} blocks = 4 x {seq_len} tokens full; f={F}")
    print(f"{'policy':<14}{'submitted':>10}{'max running':>12}{'preemptions':>12}{'vs full':>9}")
    for name in selected(args, ("full", "streaming", "h2o", "conf-kv", "conf-kv+tiers")):
        eng = make_engine(loaded, variant_config(name, args), blocks=blocks, batched=16 * CHUNK)
        n = 4 if name == "full" else size["requests"]
        for i in range(n):
            eng.add_request(f"c{i}", tokens[i * plen:(i + 1) * plen], greedy(GEN_TAIL))
        most, t0 = 0, time.time()
        while eng.has_unfinished():
            eng.step()
            most = max(most, len(eng.scheduler.running))
        out[name] = {"submitted": n, "max_running": most, "preemptions": eng.scheduler.num_preemptions,
                     "seconds": round(time.time() - t0, 1)}
        out[name]["vs_full"] = most / reference_full(out, prev)["max_running"]
        print(f"{name:<14}{n:>10}{most:>12}{eng.scheduler.num_preemptions:>12}{out[name]['vs_full']:>9.2f}")
    return out


def decode_step_times(loaded, tokens, args, size, name: str, blocks: int) -> list[float]:
    """Engine step times while all ``batch`` sequences decode together."""
    seq_len, batch = size["seq_len"], size["batch"]
    eng = make_engine(loaded, variant_config(name, args), blocks=blocks, batched=batch * CHUNK)
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
    return times


def scenario_overhead(loaded, tokens, args, size, prev: dict) -> dict:
    """Timings compare within one run only: full and streaming always run with the others."""
    out: dict = {}
    probe = make_engine(loaded, make_config("full", None, args))
    blocks = size["batch"] * probe.cache.blocks_for_tokens(size["seq_len"] + size["repeats"] + 2) + 8
    names = ("full", "streaming", "conf-kv", "conf-kv+tiers")
    for name in sorted(set(selected(args, names)) | {"full", "streaming"}, key=names.index):
        times = decode_step_times(loaded, tokens, args, size, name, blocks)
        out[name] = {"median_step_s": statistics.median(times), "mean_step_s": statistics.mean(times),
                     "steps": len(times)}
    rows = dict(out)  # the variants' rows; the ratios below are added to ``out`` beside them
    for stat in ("mean", "median"):
        key = f"{stat}_step_s"
        print(f"overhead: batch {size['batch']}, {size['seq_len']} cached tokens, f={F}; {stat} decode step: "
              + ", ".join(f"{n} {row[key] * 1e3:.1f} ms" for n, row in rows.items()))
        for name in [n for n in rows if n.startswith("conf-kv")]:
            tag = name.replace("-", "_").replace("+", "_")
            out[f"{tag}_vs_streaming_{stat}"] = out[name][key] / out["streaming"][key]
            out[f"{tag}_vs_full_{stat}"] = out[name][key] / out["full"][key]
            print(f"  {name} / streaming {out[f'{tag}_vs_streaming_{stat}']:.3f}, "
                  f"/ full {out[f'{tag}_vs_full_{stat}']:.3f}")
    return out


SCENARIOS = {"long": scenario_long, "concurrency": scenario_concurrency, "overhead": scenario_overhead}


def run_scenario(args: argparse.Namespace) -> int:
    import os

    from confkv_engine.model.loader import load_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    loaded = load_model("builtin:smollm2-135m", torch.float32, "cpu")
    loaded.model.eval()
    tokens = pydoc_tokens(loaded.tokenizer)
    if args.budget_basis != "length":
        raise SystemExit("the scenarios run the served kv_budget (--budget-basis length)")
    size = SIZES[args.scenario][1 if args.quick else 0]
    out = Path(args.out) if args.out else results_dir("quality") / "kv_quality.json"
    data = load_results(out)  # merge: the perplexity table stays
    key = f"{args.scenario}{'_quick' if args.quick else ''}"
    prev = data.setdefault("scenarios", {}).get(key, {})
    if prev.get("size") != size:  # a stored row of another size is no reference
        prev = {}
    result = SCENARIOS[args.scenario](loaded, tokens, args, size, prev)
    result.update({"size": size, "quick": args.quick, "f": F, "chunk": CHUNK, "tiers": tiers_of(args),
                   "torch": torch.__version__})
    data["scenarios"][key] = {**prev, **result}  # a piece (--policies) updates its own rows
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, default=str))
    return 0
