"""Budget shapes for conf-kv: per-layer budgets at equal total bytes, and the budget from uncertainty.

Same text, windows, chunks and perplexity as ``bench/quality/kv_quality.py`` (its helpers are reused: test
tokens [0, 6144), ``--tune`` tokens [6144, 12288), ``--quick`` one 1,024-token window; perplexity
over the second half of each window), conf-kv with the served defaults, offline (no scheduler).

- ``layers:<shape>`` (``testkit.drivers.per_layer``): one cache per layer, layer ``l`` budgeted at
  ``f_l`` with ``mean(f_l) = f`` (``testkit/budget_shapes.py``: uniform, pyramid:R, entropy:G). The
  entropy profile is always calibrated on the *tuning* windows with the full cache.
- ``schedule:<signal>:<strength>:<slack>`` (``retention.budget``): the engine's one cache, the
  per-decision target following the uncertainty of the last interval; ``schedule:fixed`` is the
  fixed budget on the same runner.

    python -m bench.quality.kv_budget_shapes --quick --tune              # selection on one tuning window
    python -m bench.quality.kv_budget_shapes --tune --configs layers:uniform,layers:pyramid:2
    python -m bench.quality.kv_budget_shapes --configs ...               # the test windows, once

Results are checkpointed per configuration in ``bench/results/quality/kv_budget_shapes[_quick][_tune].json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench.quality import kv_quality as kvq
from confkv_engine.retention.budget import BudgetSchedule
from confkv_engine.retention.policies import RetentionConfig
from testkit.budget_shapes import EntropyProbe, layer_fractions

DEFAULT_CONFIGS = ("schedule:fixed", "layers:uniform", "layers:pyramid:2", "layers:pyramid:0.5",
                   "layers:entropy:1", "schedule:entropy:0.5:1", "schedule:margin:0.5:1",
                   "schedule:entropy:-0.5:1")


def base_config(f: float | None) -> RetentionConfig:
    """conf-kv with the served defaults (what ``kv_quality.py`` measures), or the full cache."""
    args = kvq.parse_args([])
    return kvq.make_config("conf-kv" if f is not None else "full", f, args)


def calibrate_entropy(model, wins: list[list[int]]) -> list[float]:
    """Per-layer mean normalised attention entropy over the second halves of ``wins`` (full cache)."""
    probe = EntropyProbe(model.args.num_layers, skip=len(wins[0]) // 2)
    with torch.inference_mode():
        for w in wins:
            model(torch.tensor(w), torch.arange(len(w)), probe)
    return probe.entropies()


def run_window(model, cache, name: str, f: float | None, tokens: list[int], entropy: list[float]) -> dict:
    from confkv_engine.retention.manager import RetentionManager
    from testkit.drivers.offline import run_sequence
    from testkit.drivers.per_layer import run_sequence_per_layer

    kind, _, rest = name.partition(":")
    if kind == "layers":
        fracs = layer_fractions(rest, f, model.args.num_layers, entropy)
        cfgs = [base_config(x) if x < 1.0 else base_config(None) for x in fracs]
        out = run_sequence_per_layer(model, cfgs, tokens, kvq.CHUNK)
        return {"logprobs": out.logprobs, "peak": out.peak_bytes, "held": out.held_bytes, "fractions": fracs}
    cfg = base_config(f)
    if rest and rest != "fixed":
        signal, strength, slack = rest.split(":")
        cfg = replace(cfg, schedule=BudgetSchedule(signal, float(strength), float(slack)))
    manager = RetentionManager(cache, model.args.num_heads, cfg, kvq.CHUNK)
    out = run_sequence(model, cache, manager, cfg, tokens, kvq.CHUNK)
    return {"logprobs": out.logprobs, "peak": out.peak_bytes, "held": out.held_bytes}


def measure(model, cache, name: str, f: float | None, wins: list[list[int]], entropy: list[float]) -> dict:
    nll, peaks, means, extra = [], [], [], {}
    t0 = time.time()
    for w in wins:
        r = run_window(model, cache, name, f, w, entropy)
        nll.append(kvq.second_half_nll(r["logprobs"], len(w)))
        peaks.append(r["peak"])
        means.append(sum(r["held"]) / len(r["held"]))
        extra = {"fractions": [round(x, 4) for x in r["fractions"]]} if "fractions" in r else {}
    pooled = torch.cat(nll)
    return {"name": name, "f": f, "ppl": math.exp(float(pooled.mean())), "nll": float(pooled.mean()),
            "peak_kv_bytes": max(peaks), "mean_kv_bytes": sum(means) / len(means),
            "seconds": round(time.time() - t0, 1), **extra}


def print_table(rows: list[dict], full: dict) -> None:
    print(f"{'config':<30}{'f':>7}{'ppl':>9}{'+%':>8}{'mean/full':>10}{'peak/full':>10}{'s':>7}")
    for r in rows:
        inc = 100 * (r["ppl"] / full["ppl"] - 1)
        f = "-" if r["f"] is None else f"{r['f']:.3f}"
        mean, peak = r["mean_kv_bytes"] / full["mean_kv_bytes"], r["peak_kv_bytes"] / full["peak_kv_bytes"]
        print(f"{r['name']:<30}{f:>7}{r['ppl']:>9.3f}{inc:>8.2f}{mean:>10.3f}{peak:>10.3f}{r['seconds']:>7}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one 1,024-token window")
    ap.add_argument("--tune", action="store_true", help="the tuning tokens [6144, 12288)")
    ap.add_argument("--budgets", default="0.25,0.125", help="comma-separated mean fractions")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma-separated config names")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    suffix = ("_quick" if args.quick else "") + ("_tune" if args.tune else "")
    out = Path(args.out) if args.out else kvq.RESULTS / f"kv_budget_shapes{suffix}.json"
    data = json.loads(out.read_text()) if out.exists() else {"results": {}}

    from confkv_engine.model.loader import load_model

    loaded = load_model("builtin:smollm2-135m", torch.float32, "cpu")
    loaded.model.eval()
    tokens = kvq.pydoc_tokens(loaded.tokenizer)
    wins = kvq.windows(tokens, args.quick, args.tune)
    if "entropy" not in data:  # calibrated on the tuning windows whatever is measured
        data["entropy"] = calibrate_entropy(loaded.model, kvq.windows(tokens, args.quick, True))
    cache = kvq.OfflineRunner(loaded).cache
    budgets, configs = args.budgets.split(","), args.configs.split(",")
    plan = [("full", None)] + [(c, float(f)) for f in budgets for c in configs]
    rows = []
    for name, f in plan:
        key = f"{name}@{f}"
        if key not in data["results"]:
            res = measure(loaded.model, cache, name, f, wins, data["entropy"])
            res["config"] = json.loads(json.dumps(asdict(base_config(f)), default=str))
            data["results"][key] = res
            data["meta"] = {"windows": [len(w) for w in wins], "chunk": kvq.CHUNK, "quick": args.quick,
                            "tune": args.tune, "torch": torch.__version__}
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(data, indent=1))
            print(f"  {name} f={f}: ppl {res['ppl']:.3f} ({res['seconds']} s)", flush=True)
        rows.append(data["results"][key])
    print_table(rows, data["results"]["full@None"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
