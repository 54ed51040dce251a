"""The in-process retention runs that both the quality benchmark (``bench.quality.kv_quality``) and
the tests (the HTTP echo-logprobs check) use as their reference: the pydoc text and windows, a
``RetentionConfig`` from the benchmark's flags, and two runners that feed a window through the
engine (``EngineRunner``) or through the cache and model without the scheduler (``OfflineRunner``).
"""

from __future__ import annotations

import argparse

import torch

from confkv_api.config import ConfKVSection
from confkv_engine.retention.manager import H2O_DECAY
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.scorer import ScorerConfig
from confkv_engine.retention.tiers import TierConfig
from testkit.rotation import ROTATIONS, rotate_engine

# The serving defaults, so that the table describes what a served request does: retained sequences
# prefill (and the policy acts) one decision interval at a time, the minimal window is that interval.
SERVED = ConfKVSection()
CHUNK = SERVED.decision_interval



def pydoc_tokens(tokenizer) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tokenizer.encode(text, add_bos=False)


def windows(tokens: list[int], quick: bool, tune: bool) -> list[list[int]]:
    base, size, count = (6144, 2048, 3) if tune else (0, 2048, 3)
    if quick:
        size, count = 1024, 1
    return [tokens[base + i * size: base + (i + 1) * size] for i in range(count)]


def served_windows(tokens: list[int], text: str, tune: bool, count: int = 2) -> list[list[int]]:
    """The held-out check's protocol (``bench.quality.http_quality``) on this corpus: ``count``
    1,024-token windows of ``text`` ("prose", or "repeat": passages of each window's first 384 tokens
    re-inserted after every 64 fresh ones, ``testkit.held_out``), from the tuning tokens with ``tune``.
    Up to two windows the kinds draw on disjoint tokens; more prose windows reach into the stretch
    the repeating ones are built from (the tuning tokens end at 12,288: at most 5 repeating windows)."""
    from testkit import held_out

    base = 6144 if tune else 0
    if text == "prose":
        return held_out.prose_windows(tokens, count, 1024, base)
    return held_out.repeating_windows(tokens, count, 1024, base + 2048, 384, 64)


def make_config(policy: str, f: float | None, args: argparse.Namespace,
                mode: str | None = None, precisions: tuple[str, ...] = ()) -> RetentionConfig:
    decay = args.h2o_decay if policy == "h2o" else args.decay
    scorer_cfg = ScorerConfig(mode=mode or args.score_mode, sampling_weight=args.sampling_weight,
                              decay=decay, scale=args.scale, precision_scale=args.precision_scale,
                              precision_decay=args.precision_decay,
                              precision_sampling_weight=args.precision_sampling_weight,
                              sampling_kind=args.sampling_kind,
                              pool=args.pool if policy.startswith("conf-kv") else 1,
                              memory=args.memory if policy.startswith("conf-kv") else 0.0,
                              memory_distance=args.memory_distance, memory_decay=args.memory_decay,
                              memory_reach=args.memory_reach)
    # The precision-tier settings only reach the rows with tiers, so sweeping them never re-measures
    # (or re-keys) the others.
    precision = dict(precision_window_fraction=args.tier_window_fraction, precision_loss=args.tier_loss,
                     last_tier_below=args.tier_last_below, last_tier_share=args.tier_last_share,
                     freeze_order=args.tier_freeze_order,
                     precision_group=args.tier_group, precision_window=args.tier_window,
                     precision_floor=args.tier_floor,
                     precision_interval=args.tier_interval) if precisions else {}
    tiers = TierConfig(high=args.high, medium=args.medium, sinks=SERVED.sinks, window=args.window,
                       window_fraction=args.window_fraction, key_share=args.key_share,
                       granularity=args.granularity if policy.startswith("conf-kv") else "head",
                       precisions=precisions, key_only=not precisions, **precision)
    if f is not None and args.budget_basis == "peak":  # f x the window's full cache, at every length
        size = 1024 if args.quick else 2048
        return RetentionConfig(policy=policy, tiers=tiers, scorer=scorer_cfg, budget_tokens=round(f * size))
    basis = "final" if args.budget_basis == "final" else "length"
    return RetentionConfig(policy=policy, tiers=tiers, scorer=scorer_cfg, budget=f, budget_basis=basis)


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
        from testkit.drivers.offline import run_sequence

        manager = RetentionManager(self.cache, self.loaded.model.args.num_heads, cfg, self.interval)
        out = run_sequence(self.loaded.model, self.cache, manager, cfg, tokens, self.interval)
        return {"logprobs": out.logprobs, "peak": out.peak_bytes,
                "mean": sum(out.held_bytes) / max(len(out.held_bytes), 1)}


class EngineRunner:
    """Feeds each window as a prompt (``max_tokens=0``, prompt logprobs) through ``LLMEngine``:
    scheduler, paged cache, retention after every 32-token prefill chunk, as in serving."""

    def __init__(self, loaded, kv_cache_dtype: str, interval: int = CHUNK, rotation: str = "none") -> None:
        self.loaded = loaded
        self.kv_cache_dtype = kv_cache_dtype
        self.interval = interval
        self.rotation = rotation
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
        rotate_engine(engine, self.rotation, self.loaded.model.args.head_dim)
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


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def _optional_float(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def _optional_int(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="KV retention quality: perplexity against measured KV bytes")
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
    ap.add_argument("--decay", type=float, default=ScorerConfig.decay, help="conf-kv without precision tiers")
    ap.add_argument("--precision-decay", type=float, default=ScorerConfig.precision_decay,
                    help="conf-kv with precision tiers (the conf-kv+tiers rows)")
    ap.add_argument("--scale", type=float, default=ScorerConfig.scale, help="conf-kv without precision tiers")
    ap.add_argument("--precision-scale", type=float, default=ScorerConfig.precision_scale,
                    help="conf-kv with precision tiers (the conf-kv+tiers rows)")
    ap.add_argument("--precision-sampling-weight", type=float, default=ScorerConfig.precision_sampling_weight,
                    help="conf-kv with precision tiers: the sampling signal's weight in the confidence")
    ap.add_argument("--sampling-kind", default=ScorerConfig.sampling_kind,
                    choices=("surprise", "entropy", "margin"),
                    help="conf-kv: what the sampling confidence reads")
    ap.add_argument("--pool", type=int, default=ScorerConfig.pool)
    ap.add_argument("--memory", type=float, default=ScorerConfig.memory,
                    help="conf-kv: weight of each token's remembered attention peak (0: off)")
    ap.add_argument("--memory-decay", type=float, default=ScorerConfig.memory_decay,
                    help="conf-kv: the remembered peak fades by this per query position (1: never)")
    ap.add_argument("--memory-reach", type=_optional_int, default=ScorerConfig.memory_reach,
                    help="conf-kv: queries further than this do not raise a token's peak (none: no limit)")
    ap.add_argument("--memory-distance", type=int, default=ScorerConfig.memory_distance,
                    help="conf-kv: queries nearer than this do not raise a token's remembered peak")
    ap.add_argument("--granularity", default=TierConfig.granularity, help="conf-kv: head | layer | token")
    ap.add_argument("--tiers", default=None, help="precision tiers of the conf-kv+tiers rows, e.g. int4,int2")
    ap.add_argument("--tier-loss", type=_floats, default=TierConfig.precision_loss,
                    help="relative loss of int8,int4,int2 tokens in the budget walk")
    ap.add_argument("--budget-basis", choices=("length", "final", "peak"), default="length",
                    help="length: f x the full cache at the current length (the served kv_budget with "
                         "budgetBasis length, the tuning tables' basis); final: f x the full cache at the "
                         "request's final length (the served default, budgetBasis final; a window is one "
                         "prompt-only request); peak: f x the full cache of a 2,048-token window at every "
                         "length (kv_budget_tokens), the basis of the kivi peers' measured bytes")
    ap.add_argument("--tier-window-fraction", type=float, default=TierConfig.precision_window_fraction,
                    help="recent-window share of the budget for the conf-kv+tiers rows")
    ap.add_argument("--tier-last-below", type=float, default=TierConfig.last_tier_below,
                    help="conf-kv+tiers: confidence below which a token leaving the window goes to the "
                         "last precision tier (0: only the budget walk demotes below the first)")
    ap.add_argument("--tier-last-share", type=_optional_float, default=TierConfig.last_tier_share,
                    help="conf-kv+tiers: the most of the kept tokens the last precision tier may hold "
                         "(none: no cap)")
    ap.add_argument("--tier-window", type=int, default=SERVED.window or TierConfig.precision_window,
                    help="conf-kv+tiers: the minimal always-FULL recent window (may be under the interval)")
    ap.add_argument("--tier-floor", type=_optional_int, default=TierConfig.precision_floor,
                    help="conf-kv+tiers: recent tokens whose FULL bytes the budget's floor holds "
                         "(none: the window)")
    ap.add_argument("--tier-interval", type=_optional_int, default=TierConfig.precision_interval,
                    help="conf-kv+tiers: the chain's own decision interval (none: the engine's, --interval)")
    ap.add_argument("--tier-freeze-order", default=TierConfig.freeze_order,
                    help="conf-kv+tiers: staged tokens frozen into blocks by position or by confidence")
    ap.add_argument("--tier-group", type=int, default=TierConfig.precision_group,
                    help="conf-kv+tiers: the codec's value group (keys: min(group, block size))")
    ap.add_argument("--served-text", choices=("prose", "repeat"), default=None,
                    help="the held-out check's protocol on this corpus: two 1,024-token windows of prose or "
                         "of repeating passages, every token scored (default: second halves of the windows)")
    ap.add_argument("--served-windows", type=int, default=2,
                    help="with --served-text: 1,024-token windows per run (default 2, the held-out check's)")
    ap.add_argument("--rotate", choices=ROTATIONS, default="none",
                    help="engine rows: turn every head's q/k/v by a randomised Hadamard matrix before the "
                         "cache (testkit.rotation; a measurement aid, not served)")
    ap.add_argument("--out", default=None,
                    help="JSON path (default bench/results/quality/kv_quality[_quick|_tune].json)")
    ap.add_argument("--scenario", choices=("ppl", "long", "concurrency", "overhead"), default="ppl",
                    help="ppl: the perplexity table; long / concurrency / overhead: sub-benchmarks (a)-(c)")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line with the defaults that depend on other flags resolved (the window)."""
    args = build_parser().parse_args(argv)
    args.window = args.window or SERVED.window or args.interval
    return args
