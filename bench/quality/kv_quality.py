"""KV retention quality: perplexity against measured KV bytes, full / streaming / h2o / conf-kv /
conf-kv with precision tiers / uniform KIVI-style quantization.

Text: ``'\\n\\n'.join(topics[k] for k in sorted(topics))`` from ``pydoc_data.topics``, tokenized
without BOS. Test set: tokens [0, 6144) as three 2,048-token windows; perplexity = exp(mean NLL
over the second halves of the windows, pooled). Tuning (``--tune``) only reads [6144, 12288).
Each window is fed online in prefill chunks of 32 with the policy acting after every chunk.

    python -m bench.quality.kv_quality --quick        # one 1,024-token window, f = 0.5 and 0.25
    python -m bench.quality.kv_quality                # the full run (three windows, f = 0.5/0.25/0.125)

Results are checkpointed per configuration in ``bench/results/quality/kv_quality.json`` (a rerun
skips configurations already measured with the same settings); a table is printed and a PNG plot of
perplexity increase against measured bytes is written next to the JSON.

``--runner engine`` (default) feeds the windows through ``LLMEngine`` (``max_tokens=0``, prompt
logprobs, prefill chunk 32); ``--runner offline`` uses ``retention.offline.run_sequence`` on the
same cache and backend without the scheduler (a cross-check; numbers must agree).

``--compress 8,4,2`` adds the uniform peers ``kivi-int8`` / ``kivi-int4`` / ``kivi-int2``: the full cache
with every block outside the recent window (all but the last 2 blocks, KIVI-style) quantized after
every step (``LLMEngine.compress``, forced, default groupSize; int2 through the same pass directly);
their byte columns are the sequence's real bytes, compressed blocks at their encoded size, so they
read as peers at their own measured bytes (they have no budget: ``f`` is ``-``).

``--tiers int4,int2`` adds ``conf-kv+tiers`` at every budget: conf-kv choosing each token's precision
(FULL / int4 / int2 / DISCARD, ``retention.precision``) through the same codec; ``--tier-*`` set its
``TierConfig`` fields (window, losses, freeze order, value group) and reach only those rows.
``--interval`` runs the perplexity rows at another decision interval (``confkv.decisionInterval``).
``--served-text prose|repeat`` runs the held-out check's protocol (two 1,024-token windows, every
token scored; ``repeat`` re-inserts passages from far back) on this corpus, for tuning with ``--tune``.

    python -m bench.quality.kv_quality --quick --policies full,conf-kv,conf-kv+tiers \
        --compress 4,2 --tiers int4,int2

The model computes in fp32; the cache is stored in ``--kv-cache-dtype`` (default bfloat16, as a
served bf16 model stores it), so every row's bytes, the ``full`` reference included, are bf16 pool
bytes: a low-precision tier is measured against bf16, never against an fp32 cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.common import load_results, results_dir
from confkv_engine.retention.policies import RetentionConfig
from testkit.kv_runs import (
    CHUNK,
    EngineRunner,
    OfflineRunner,
    make_config,
    parse_args,
    pydoc_tokens,
    served_windows,
    windows,
)

RESULTS = results_dir("quality")
POLICIES = ("streaming", "h2o", "conf-kv", "conf-kv-discard")
ABLATIONS = ("combined", "sampling")  # conf-kv scoring modes besides the default 'attention'
def second_half_nll(logprobs: torch.Tensor, size: int) -> torch.Tensor:
    """NLL of tokens [size/2, size): logprobs[i] scores token i + 1."""
    return -logprobs[size // 2 - 1: size - 1].double()


def config_key(name: str, f: float | None, cfg: RetentionConfig, quick: bool, tune: bool, runner: str,
               kv_cache_dtype: str, interval: int = CHUNK, rotation: str = "none", count: int = 2) -> str:
    fields = [name, f, asdict(cfg), quick, tune, runner, kv_cache_dtype]
    if interval != CHUNK:  # the served interval keeps the keys rows were stored under before the flag
        fields.append(interval)
    if rotation != "none":  # likewise: unrotated rows keep their keys
        fields.append(rotation)
    if count != 2:  # served windows per run
        fields.append(f"windows={count}")
    blob = json.dumps(fields, sort_keys=True, default=str)
    return f"{name}@{f}#{hashlib.sha1(blob.encode()).hexdigest()[:10]}"


def measure(runner, name: str, cfg: RetentionConfig, wins: list[list[int]], every: bool = False) -> dict:
    """``every``: perplexity over every scored token (the held-out check's protocol), not the second
    halves."""
    nll, peaks, means = [], [], []
    t0 = time.time()
    bits = int(name.split("kivi-int")[1]) if name.startswith("kivi-int") else None
    for w in wins:
        r = runner.run(cfg, w, bits)
        nll.append(-r["logprobs"].double() if every else second_half_nll(r["logprobs"], len(w)))
        peaks.append(r["peak"])
        means.append(r["mean"])
    pooled = torch.cat(nll)
    return {"name": name, "ppl": math.exp(float(pooled.mean())), "nll": float(pooled.mean()),
            "peak_kv_bytes": max(peaks), "mean_kv_bytes": sum(means) / len(means),
            "seconds": round(time.time() - t0, 1)}


def plan(args: argparse.Namespace) -> list[tuple[str, float | None, RetentionConfig]]:
    budgets = [0.5, 0.25] if args.quick else [0.5, 0.25, 0.125]
    if args.budgets:
        budgets = [float(b) for b in args.budgets.split(",")]
    items: list[tuple[str, float | None, RetentionConfig]] = [("full", None, make_config("full", None, args))]
    for bits in (args.compress.split(",") if args.compress else []):
        items.append((f"kivi-int{int(bits)}", None, make_config("full", None, args)))
    precisions = tuple(t for t in args.tiers.split(",") if t) if args.tiers else ()
    for f in budgets:
        for p in POLICIES:
            items.append((p, f, make_config(p, f, args)))
        if precisions:
            items.append(("conf-kv+tiers", f, make_config("conf-kv", f, args, precisions=precisions)))
        if not args.no_ablations:
            for mode in ABLATIONS:
                items.append((f"conf-kv[{mode}]", f, make_config("conf-kv", f, args, mode)))
    return items


def print_table(rows: list[dict], full: dict) -> None:
    print(f"{'config':<24}{'f':>7}{'ppl':>9}{'+%':>8}{'peak KiB':>10}{'mean KiB':>10}{'peak/full':>10}")
    for r in rows:
        inc = 100 * (r["ppl"] / full["ppl"] - 1)
        frac = r["peak_kv_bytes"] / full["peak_kv_bytes"]
        f = "-" if r["f"] is None else f"{r['f']:.3f}"
        print(f"{r['name']:<24}{f:>7}{r['ppl']:>9.3f}{inc:>8.2f}{r['peak_kv_bytes'] / 1024:>10.0f}"
              f"{r['mean_kv_bytes'] / 1024:>10.0f}{frac:>10.3f}")


def plot(rows: list[dict], full: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the plot is optional (the bench extra installs matplotlib)
        print(f"matplotlib is not installed: no plot written to {path}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in sorted({r["name"] for r in rows if r["f"] is not None}):
        pts = sorted((r["mean_kv_bytes"] / full["mean_kv_bytes"], 100 * (r["ppl"] / full["ppl"] - 1))
                     for r in rows if r["name"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("measured mean KV bytes / full cache")
    ax.set_ylabel("perplexity increase over full cache (%)")
    ax.set_title("KV retention on SmolLM2-135M (pydoc topics)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.scenario != "ppl":
        from bench.quality.kv_scenarios import run_scenario

        return run_scenario(args)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    suffix = "_quick" if args.quick else ""
    suffix += "_tune" if args.tune else ""
    suffix += f"_{args.budget_basis}" if args.budget_basis != "length" else ""
    suffix += f"_served_{args.served_text}" if args.served_text else ""
    out = Path(args.out) if args.out else RESULTS / f"kv_quality{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    from confkv_engine.model.loader import load_model

    loaded = load_model("builtin:smollm2-135m", torch.float32, "cpu")
    loaded.model.eval()
    tokens = pydoc_tokens(loaded.tokenizer)
    if args.served_text:
        wins = served_windows(tokens, args.served_text, args.tune, args.served_windows)
    else:
        wins = windows(tokens, args.quick, args.tune)
    if args.runner == "engine":
        runner = EngineRunner(loaded, args.kv_cache_dtype, args.interval, args.rotate)
    elif args.rotate != "none":
        raise SystemExit("--rotate needs the engine runner")
    elif args.budget_basis == "final":  # the offline driver does not know a request's final length
        raise SystemExit("--budget-basis final needs the engine runner")
    else:
        runner = OfflineRunner(loaded, args.kv_cache_dtype, args.interval)
    data = load_results(out)
    wanted = set(args.policies.split(",")) if args.policies else None
    rows = []
    for name, f, cfg in plan(args):
        if wanted and name not in wanted and name != "full" and not name.startswith("kivi-"):
            continue
        key = config_key(name, f, cfg, args.quick, args.tune, args.runner, args.kv_cache_dtype, args.interval,
                         args.rotate, args.served_windows if args.served_text else 2)
        if key not in data["results"]:
            res = measure(runner, name, cfg, wins, every=bool(args.served_text))
            res.update({"f": f, "config": json.loads(json.dumps(asdict(cfg), default=str))})
            data["results"][key] = res
            data["meta"] = {"windows": [len(w) for w in wins], "chunk": args.interval, "runner": args.runner,
                            "kv_cache_dtype": args.kv_cache_dtype, "budget_basis": args.budget_basis,
                            "quick": args.quick, "tune": args.tune, "rotate": args.rotate,
                            "torch": torch.__version__}
            out.write_text(json.dumps(data, indent=1))  # checkpoint after every configuration
            print(f"  {name} f={f}: ppl {res['ppl']:.3f} ({res['seconds']} s)", flush=True)
        rows.append(data["results"][key])
    full = next(r for r in rows if r["name"] == "full")
    print_table(rows, full)
    plot(rows, full, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
