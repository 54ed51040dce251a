"""Decode step time of every policy, gathering attention against the in-place paged kernels, in one run.

For each batch shape (``--shapes``, default 8 x 2,048 and 32 x 2,048 cached tokens) and each variant
(``full``, ``streaming``, ``h2o``, ``conf-kv``, ``conf-kv+tiers``; the retained ones at f = 0.25 as
``bench.quality.kv_scenarios``), the engine prefills the batch from real text (pydoc) and then times
``--steps`` decode steps (median), once with the gathering path (``in_place=False``, the reference)
and once with the paged kernel (``attention.kernels``; on CPU the view-based path). Ratios are to
``full`` with the same attention path. SmolLM2-135M, fp32 cache, CPU. A variant name ending in
``:codes`` runs that variant with its decode rows attending their compressed blocks from the codes
(``from_codes=True``, ``attention.codes``, the engine's default); the other variants decode them
into the gathered table (``from_codes=False``), its peer, e.g.
``--variants full,conf-kv+tiers,conf-kv+tiers:codes``.

    python -m bench.micro.decode_step --threads 2 --shapes 8x2048,32x2048 --steps 8
    python -m bench.micro.decode_step --shapes 8x2048 --paths gather   # the served (gathering) path only
    python -m bench.micro.decode_step --shapes 8x2048 --paths gather --steps 40 --interleave \
        --variants full,conf-kv+tiers:codes   # steps in turn: paired ratios on a shared machine

``--interleave`` prefills every variant's engine first, then takes one decode step of each in turn:
on a shared machine a slow stretch then falls on every variant alike, and ``paired_vs_full`` (the
median over rounds of a variant's step over ``full``'s in the same round) is steadier than a ratio of
medians taken minutes apart. ``mean_ms`` includes the decision steps a median leaves out;
``prefill_ms`` is each engine's prefill of the batch (one variant after another, not in turn).

``--retention-args`` passes ``bench.quality.kv_quality`` flags to every variant (e.g. another chain:
``--retention-args "--tiers int4,int2 --tier-window 8"``). ``--out NAME`` writes
``bench/results/micro/NAME`` instead of ``decode_step.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import time
from pathlib import Path

import torch

from bench.quality.kv_scenarios import greedy, make_engine, variant_config
from testkit.kv_runs import CHUNK, parse_args, pydoc_tokens

VARIANTS = ("full", "streaming", "h2o", "conf-kv", "conf-kv+tiers", "conf-kv+tiers:codes")
CODES = ":codes"
WARMUP = 2
OUT = Path(__file__).resolve().parents[1] / "results" / "micro" / "decode_step.json"


def prefilled(loaded, variant: str, batch: int, seq_len: int, steps: int, in_place: bool,
              retention_args: str = ""):
    """An engine of ``variant`` with ``batch`` prompts of ``seq_len`` tokens prefilled and ``WARMUP``
    decode steps taken, room for ``steps`` more; and the prefill's wall time (ms)."""
    from confkv_engine.attention.retention import RetentionAttention
    from confkv_engine.core.engine import LLMEngine

    args = parse_args(shlex.split(retention_args))
    tokens = pydoc_tokens(loaded.tokenizer)
    probe = make_engine(loaded, variant_config("full", args))
    blocks = batch * probe.cache.blocks_for_tokens(seq_len + steps + WARMUP + 2) + 8
    policy = variant.removesuffix(CODES)
    base = make_engine(loaded, variant_config(policy, args), blocks=blocks, batched=batch * CHUNK)
    parts = base.parts
    backend = RetentionAttention(parts.cache, loaded.model.args.num_heads, in_place=in_place,
                                 from_codes=variant.endswith(CODES))
    eng = LLMEngine(loaded, parts=dataclasses.replace(parts, backend=backend))
    for i in range(batch):
        start = (i * seq_len) % max(1, len(tokens) - seq_len)
        eng.add_request(f"p{i}", tokens[start:start + seq_len], greedy(steps + WARMUP + 2))
    t0 = time.perf_counter()
    while not all(s.num_computed >= s.prompt_len for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(WARMUP):
        eng.step()
    return eng, prefill_ms


def timed_step(eng) -> float:
    t0 = time.perf_counter()
    eng.step()
    return (time.perf_counter() - t0) * 1e3


def step_ms(loaded, variant: str, batch: int, seq_len: int, steps: int, in_place: bool,
            retention_args: str = "") -> float:
    eng, _ = prefilled(loaded, variant, batch, seq_len, steps, in_place, retention_args)
    return round(statistics.median(timed_step(eng) for _ in range(steps)), 1)


def interleaved(loaded, variants: list[str], batch: int, seq_len: int, steps: int, in_place: bool,
                retention_args: str = "") -> list[dict]:
    """Every variant's engine prefilled, then their decode steps taken in turn (one step of each per
    round), so a slow stretch of a shared machine falls on all of them: per variant the median step,
    the mean with decision steps included, and the median over rounds of its step over ``full``'s;
    and the wall time of its prefill (taken one variant after another, not in turn)."""
    engines, prefill = zip(*(prefilled(loaded, v, batch, seq_len, steps, in_place, retention_args)
                             for v in variants), strict=True)
    times: list[list[float]] = [[] for _ in variants]
    for _ in range(steps):
        for eng, t in zip(engines, times, strict=True):
            t.append(timed_step(eng))
    full = times[variants.index("full")]
    return [{"variant": v, "median_ms": round(statistics.median(t), 1),
             "mean_ms": round(statistics.mean(t), 1),
             "paired_vs_full": round(statistics.median(a / b for a, b in zip(t, full, strict=True)), 3),
             "prefill_ms": round(p)}
            for v, t, p in zip(variants, times, prefill, strict=True)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", default="8x2048,32x2048", help="batch x cached tokens, comma separated")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--paths", default="gather,in_place", help="attention paths timed (gather, in_place)")
    p.add_argument("--retention-args", default="",
                   help="kv_quality flags for every variant, e.g. '--tiers int4,int2 --tier-window 8'")
    p.add_argument("--out", default=OUT.name, help="result file name under bench/results/micro/")
    p.add_argument("--interleave", action="store_true",
                   help="one path (the first of --paths), the variants' steps taken in turn; needs full")
    a = p.parse_args(argv)
    from confkv_engine.model.loader import load_model

    torch.set_num_threads(a.threads)
    loaded = load_model("builtin:smollm2-135m", torch.float32, "cpu")
    loaded.model.eval()
    if a.interleave:
        return interleave_main(a, loaded)
    rows = []
    for shape in a.shapes.split(","):
        batch, seq_len = (int(x) for x in shape.split("x"))
        for variant in a.variants.split(","):
            row = {"shape": shape, "variant": variant}
            for path in a.paths.split(","):
                row[f"{path}_ms"] = step_ms(loaded, variant, batch, seq_len, a.steps, path == "in_place",
                                            a.retention_args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    for row in rows:
        full = next(r for r in rows if r["shape"] == row["shape"] and r["variant"] == "full")
        for path in a.paths.split(","):
            row[f"{path}_vs_full"] = round(row[f"{path}_ms"] / full[f"{path}_ms"], 2)
    paths = a.paths.split(",")
    print(f"{'shape':>8} {'variant':>14}" + "".join(f" {p + ' ms':>12} {'x full':>7}" for p in paths))
    for r in rows:
        print(f"{r['shape']:>8} {r['variant']:>14}"
              + "".join(f" {r[p + '_ms']:>12} {r[p + '_vs_full']:>7}" for p in paths))
    out = OUT.parent / Path(a.out).name  # a name, never a path: results stay under bench/results/micro
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"threads": a.threads, "steps": a.steps, "paths": a.paths, "retention_args": a.retention_args,
              "rows": rows}
    out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def interleave_main(a: argparse.Namespace, loaded) -> int:
    path = a.paths.split(",")[0]
    rows = []
    for shape in a.shapes.split(","):
        batch, seq_len = (int(x) for x in shape.split("x"))
        for row in interleaved(loaded, a.variants.split(","), batch, seq_len, a.steps, path == "in_place",
                               a.retention_args):
            rows.append({"shape": shape, "path": path, **row})
            print(json.dumps(rows[-1]), flush=True)
    out = OUT.parent / Path(a.out).name
    out.write_text(json.dumps({"threads": a.threads, "steps": a.steps, "interleaved": True,
                               "retention_args": a.retention_args, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
