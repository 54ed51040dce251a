"""KV retention quality: perplexity against measured KV bytes, full / streaming / h2o / conf-kv /
conf-kv with precision tiers / uniform KIVI-style quantization.

Text: ``'\\n\\n'.join(topics[k] for k in sorted(topics))`` from ``pydoc_data.topics``, tokenized
without BOS. Test set: tokens [0, 6144) as three 2,048-token windows; perplexity = exp(mean NLL
over the second halves of the windows, pooled). Tuning (``--tune``) only reads [6144, 12288).
Each window is fed online in prefill chunks of 32 with the policy acting after every chunk.

    python bench/kv_quality.py --quick        # one 1,024-token window, f = 0.5 and 0.25
    python bench/kv_quality.py                # the full run (three windows, f = 0.5/0.25/0.125)

Results are checkpointed per configuration in ``bench/results/kv_quality.json`` (a rerun skips
configurations already measured with the same settings); a table is printed and a PNG plot of
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

    python bench/kv_quality.py --quick --policies full,conf-kv,conf-kv+tiers --compress 4,2 --tiers int4,int2

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
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.drivers (the offline runner)
for sub in ("api", "engine"):
    sys.path.insert(0, str(ROOT / sub))

from confkv_api.config import ConfKVSection  # noqa: E402
from confkv_engine.retention.manager import H2O_DECAY  # noqa: E402
from confkv_engine.retention.policies import RetentionConfig  # noqa: E402
from confkv_engine.retention.scorer import ScorerConfig  # noqa: E402
from confkv_engine.retention.tiers import TierConfig  # noqa: E402

RESULTS = ROOT / "bench" / "results"
# The serving defaults, so that the table describes what a served request does: retained sequences
# prefill (and the policy acts) one decision interval at a time, the minimal window is that interval.
SERVED = ConfKVSection()
CHUNK = SERVED.decision_interval
POLICIES = ("streaming", "h2o", "conf-kv", "conf-kv-discard")
ABLATIONS = ("combined", "sampling")  # conf-kv scoring modes besides the default 'attention'


def pydoc_tokens(tokenizer) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tokenizer.encode(text, add_bos=False)


def windows(tokens: list[int], quick: bool, tune: bool) -> list[list[int]]:
    base, size, count = (6144, 2048, 3) if tune else (0, 2048, 3)
    if quick:
        size, count = 1024, 1
    return [tokens[base + i * size: base + (i + 1) * size] for i in range(count)]


def second_half_nll(logprobs: torch.Tensor, size: int) -> torch.Tensor:
    """NLL of tokens [size/2, size): logprobs[i] scores token i + 1."""
    return -logprobs[size // 2 - 1: size - 1].double()


def make_config(policy: str, f: float | None, args: argparse.Namespace,
                mode: str | None = None, precisions: tuple[str, ...] = ()) -> RetentionConfig:
    decay = args.h2o_decay if policy == "h2o" else args.decay
    scorer_cfg = ScorerConfig(mode=mode or args.score_mode, sampling_weight=args.sampling_weight,
                              decay=decay, scale=args.scale,
                              pool=args.pool if policy.startswith("conf-kv") else 1)
    # The precision-tier settings only reach the rows with tiers, so sweeping them never re-measures
    # (or re-keys) the others.
    precision = dict(precision_window_fraction=args.tier_window_fraction, precision_loss=args.tier_loss,
                     last_tier_below=args.tier_last_below, freeze_order=args.tier_freeze_order,
                     precision_group=args.tier_group, precision_window=args.tier_window) if precisions else {}
    tiers = TierConfig(high=args.high, medium=args.medium, sinks=SERVED.sinks, window=args.window,
                       window_fraction=args.window_fraction, key_share=args.key_share,
                       granularity=args.granularity if policy.startswith("conf-kv") else "head",
                       precisions=precisions, key_only=not precisions, **precision)
    if f is not None and args.budget_basis == "peak":  # f x the window's full cache, at every length
        size = 1024 if args.quick else 2048
        return RetentionConfig(policy=policy, tiers=tiers, scorer=scorer_cfg, budget_tokens=round(f * size))
    return RetentionConfig(policy=policy, tiers=tiers, scorer=scorer_cfg, budget=f)


class OfflineRunner:
    """Drives each window through the paged cache with ``run_sequence`` (no scheduler)."""

    def __init__(self, loaded, kv_cache_dtype: str, interval: int = CHUNK) -> None:
        from confkv_engine.cache.kv_cache import CacheSpec, KVCache
        from confkv_engine.cache.layout import resolve_cache_dtype

        a = loaded.model.args
        spec = CacheSpec(a.num_layers, a.num_kv_heads, a.head_dim, 16,
                         resolve_cache_dtype(kv_cache_dtype, torch.float32), torch.device("cpu"),
                         compute_dtype=torch.float32)
        self.cache = KVCache.from_budget(spec, 2 * 2048 * spec.block_bytes // 16 + 8 * spec.block_bytes)
        self.loaded = loaded
        self.interval = interval

    def run(self, cfg: RetentionConfig, tokens: list[int], compress_bits: int | None = None) -> dict:
        if compress_bits is not None:
            raise SystemExit("--compress needs the engine runner")
        from confkv_engine.retention.manager import RetentionManager
        from tests.drivers.offline import run_sequence

        manager = RetentionManager(self.cache, self.loaded.model.args.num_heads, cfg, self.interval)
        out = run_sequence(self.loaded.model, self.cache, manager, cfg, tokens, self.interval)
        return {"logprobs": out.logprobs, "peak": out.peak_bytes,
                "mean": sum(out.held_bytes) / max(len(out.held_bytes), 1)}


class EngineRunner:
    """Feeds each window as a prompt (``max_tokens=0``, prompt logprobs) through ``LLMEngine``:
    scheduler, paged cache, retention after every 32-token prefill chunk, as in serving."""

    def __init__(self, loaded, kv_cache_dtype: str, interval: int = CHUNK) -> None:
        self.loaded = loaded
        self.kv_cache_dtype = kv_cache_dtype
        self.interval = interval
        self.count = 0

    def run(self, cfg: RetentionConfig, tokens: list[int], compress_bits: int | None = None) -> dict:
        from confkv_api.config import load_config
        from confkv_engine.core.engine import LLMEngine
        from confkv_engine.core.sampling_params import SamplingParams

        chunk = self.interval
        engine_section = {"prefillChunk": chunk, "maxNumBatchedTokens": chunk, "blockSize": 16}
        config = load_config({"engine": engine_section,
                              "confkv": {"maxCacheSize": str(256 * 2**20),  # 2,048 fp32 tokens: 90 MiB
                                         "kvCacheDtype": self.kv_cache_dtype,
                                         "decisionInterval": self.interval}})
        engine = LLMEngine(self.loaded, config, retention=cfg)
        self.count += 1
        rid = f"kvq-{self.count}"
        engine.add_request(rid, tokens, SamplingParams(max_tokens=0, prompt_logprobs=0, temperature=0.0))
        samples, final = [], None
        while final is None:
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    final = out
            if compress_bits is not None:  # everything outside the recent window, every step
                compress_all(engine, compress_bits)
            seq = next((s for s in engine.scheduler.running if s.request_id == rid), None)
            if seq is not None and compress_bits is not None:
                samples.append(engine.cache.seq_bytes(seq.kv))
            elif seq is not None:  # bytes held between steps (after the policy acted)
                samples.append(engine.retention.held_bytes(seq.kv, seq.policy_state))
        lps = [e.logprob for e in final.prompt_logprobs[1:]]
        return {"logprobs": torch.tensor(lps), "peak": final.kv_usage.peak_kv_bytes,
                "mean": sum(samples) / max(len(samples), 1), "usage": final.kv_usage}


def compress_all(engine, bits: int) -> None:
    """Every block outside the recent window at ``bits``. int2 is a benchmark-only peer (KIVI's
    lowest setting): the engine's API accepts 8 and 4, so 2 calls the compression pass directly."""
    if bits in (8, 4):
        engine.compress(bits, force=True)
        return
    from confkv_engine.core.compression import compress_blocks

    cfg = engine.compression
    with torch.inference_mode():
        compress_blocks(engine.cache, list(engine.scheduler.running), bits, cfg.group_size,
                        cfg.cold_after_seconds, True, limit=engine.cache.pool.num_blocks * 2)


def config_key(name: str, f: float | None, cfg: RetentionConfig, quick: bool, tune: bool, runner: str,
               kv_cache_dtype: str, interval: int = CHUNK) -> str:
    fields = [name, f, asdict(cfg), quick, tune, runner, kv_cache_dtype]
    if interval != CHUNK:  # the served interval keeps the keys rows were stored under before the flag
        fields.append(interval)
    blob = json.dumps(fields, sort_keys=True, default=str)
    return f"{name}@{f}#{hashlib.sha1(blob.encode()).hexdigest()[:10]}"


def measure(runner, name: str, cfg: RetentionConfig, wins: list[list[int]]) -> dict:
    nll, peaks, means = [], [], []
    t0 = time.time()
    bits = int(name.split("kivi-int")[1]) if name.startswith("kivi-int") else None
    for w in wins:
        r = runner.run(cfg, w, bits)
        nll.append(second_half_nll(r["logprobs"], len(w)))
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


def load_results(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"results": {}}


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


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one 1,024-token window, two budgets")
    ap.add_argument("--tune", action="store_true", help="use the tuning tokens [6144, 12288)")
    ap.add_argument("--runner", choices=("engine", "offline"), default="engine")
    ap.add_argument("--budgets", help="comma-separated fractions (overrides the default set)")
    ap.add_argument("--policies", help="comma-separated config names to run (default: all)")
    ap.add_argument("--no-ablations", action="store_true", help="skip attention-/sampling-only scoring")
    ap.add_argument("--compress", help="comma-separated bits (8,4,2): full cache with compressed blocks")
    ap.add_argument("--kv-cache-dtype", default="bfloat16",
                    choices=("bfloat16", "float16", "float32", "fp8", "int8"),
                    help="KV pool storage dtype of every row (the model stays fp32); default bfloat16")
    ap.add_argument("--interval", type=int, default=CHUNK,
                    help="perplexity rows: decision interval and prefill chunk (confkv.decisionInterval; "
                         "served default 32)")
    ap.add_argument("--window", type=int, default=None, help="minimal window (default: the interval)")
    ap.add_argument("--window-fraction", type=float, default=TierConfig.window_fraction)
    ap.add_argument("--high", type=float, default=SERVED.confidence_thresholds.high)
    ap.add_argument("--medium", type=float, default=SERVED.confidence_thresholds.medium)
    ap.add_argument("--score-mode", default=ScorerConfig.mode)
    ap.add_argument("--h2o-decay", type=float, default=H2O_DECAY, help="H2O's own best decay (tuning set)")
    ap.add_argument("--key-share", type=float, default=None, help="KEY_ONLY share under the budget")
    ap.add_argument("--sampling-weight", type=float, default=ScorerConfig.sampling_weight)
    ap.add_argument("--decay", type=float, default=ScorerConfig.decay)
    ap.add_argument("--scale", type=float, default=ScorerConfig.scale)
    ap.add_argument("--pool", type=int, default=ScorerConfig.pool)
    ap.add_argument("--granularity", default=TierConfig.granularity, help="conf-kv: head | layer | token")
    ap.add_argument("--tiers", default=None, help="precision tiers of the conf-kv+tiers rows, e.g. int4,int2")
    ap.add_argument("--tier-loss", type=_floats, default=TierConfig.precision_loss,
                    help="relative loss of int8,int4,int2 tokens in the budget walk")
    ap.add_argument("--budget-basis", choices=("length", "peak"), default="length",
                    help="length: f x the full cache at the current length (the served kv_budget); peak: "
                         "f x the full cache of the whole window at every length (kv_budget_tokens), "
                         "the basis of the kivi peers' measured bytes")
    ap.add_argument("--tier-window-fraction", type=float, default=TierConfig.precision_window_fraction,
                    help="recent-window share of the budget for the conf-kv+tiers rows")
    ap.add_argument("--tier-last-below", type=float, default=TierConfig.last_tier_below,
                    help="conf-kv+tiers: confidence below which a token leaving the window goes to the "
                         "last precision tier (0: only the budget walk demotes below the first)")
    ap.add_argument("--tier-window", type=int, default=SERVED.window or TierConfig.precision_window,
                    help="conf-kv+tiers: the minimal always-FULL recent window (may be under the interval)")
    ap.add_argument("--tier-freeze-order", default=TierConfig.freeze_order,
                    help="conf-kv+tiers: staged tokens frozen into blocks by position or by confidence")
    ap.add_argument("--tier-group", type=int, default=TierConfig.precision_group,
                    help="conf-kv+tiers: the codec's value group (keys: min(group, block size))")
    ap.add_argument("--out", default=None,
                    help="JSON path (default bench/results/kv_quality[_quick|_tune].json)")
    ap.add_argument("--scenario", choices=("ppl", "long", "concurrency", "overhead"), default="ppl",
                    help="ppl: the perplexity table; long / concurrency / overhead: sub-benchmarks (a)-(c)")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line with the defaults that depend on other flags resolved (the window)."""
    args = build_parser().parse_args(argv)
    args.window = args.window or SERVED.window or args.interval
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.scenario != "ppl":
        from kv_scenarios import run_scenario

        return run_scenario(args)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    suffix = "_quick" if args.quick else ""
    suffix += "_tune" if args.tune else ""
    suffix += "_peak" if args.budget_basis == "peak" else ""
    out = Path(args.out) if args.out else RESULTS / f"kv_quality{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    from confkv_engine.model.loader import load_model

    loaded = load_model("builtin:smollm2-135m", torch.float32, "cpu")
    loaded.model.eval()
    wins = windows(pydoc_tokens(loaded.tokenizer), args.quick, args.tune)
    runner_type = EngineRunner if args.runner == "engine" else OfflineRunner
    runner = runner_type(loaded, args.kv_cache_dtype, args.interval)
    data = load_results(out)
    wanted = set(args.policies.split(",")) if args.policies else None
    rows = []
    for name, f, cfg in plan(args):
        if wanted and name not in wanted and name != "full" and not name.startswith("kivi-"):
            continue
        key = config_key(name, f, cfg, args.quick, args.tune, args.runner, args.kv_cache_dtype, args.interval)
        if key not in data["results"]:
            res = measure(runner, name, cfg, wins)
            res.update({"f": f, "config": json.loads(json.dumps(asdict(cfg), default=str))})
            data["results"][key] = res
            data["meta"] = {"windows": [len(w) for w in wins], "chunk": args.interval, "runner": args.runner,
                            "kv_cache_dtype": args.kv_cache_dtype, "budget_basis": args.budget_basis,
                            "quick": args.quick, "tune": args.tune, "torch": torch.__version__}
            out.write_text(json.dumps(data, indent=1))  # checkpoint after every configuration
            print(f"  {name} f={f}: ppl {res['ppl']:.3f} ({res['seconds']} s)", flush=True)
        rows.append(data["results"][key])
    full = next(r for r in rows if r["name"] == "full")
    print_table(rows, full)
    plot(rows, full, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
