"""Where one engine step spends its time: a ``torch.profiler`` breakdown of the real ``LLMEngine``.

Scenarios on the embedded model (``builtin:smollm2-135m``; ``--model`` names another), each for the
weight modes given:

- ``decode@1``: one sequence (128-token prompt already prefilled) decoding one token per step;
- ``decode@32``: 32 such sequences decoded together;
- ``prefill@512``: one 512-token prompt prefilled in one chunk (the engine's default chunk).

``--context N`` replaces them with long-context decode: ``decode@B`` for each ``--batches`` B,
sequences whose N-token prompts were prefilled (in the engine's chunks) before the measured steps.

Categories come from ``record_function`` ranges this script wraps around the engine's own
functions (nothing in the engine is changed): matmuls (every linear layer but the LM head), the LM head
(``lm_head``, with the tied embedding's kernel),
attention (the backend's ``attend``: KV write, block gather, SDPA), step metadata (the backend's
``begin_step``), norms / RoPE / activation, the rest of the model forward (embedding, residual adds,
RoPE tables), sampling (``_sample`` less the LM head) and Python / scheduling (everything else in
``LLMEngine.step``). Each range's time is exclusive of the ranges nested in it. Profiling adds a
per-op cost, so the unprofiled wall time per step is measured separately and shown alongside.

    python -m bench.micro.profile_step                      # fp32 and bf16, table on stdout
    python -m bench.micro.profile_step --weights auto,int4  # quantized modes (see docs/performance.md)
    python -m bench.micro.profile_step --weights auto --context 2048 --batches 1,8,32
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from confkv_api.config import ConfKVConfig, with_overrides
from confkv_engine.core import engine as engine_module
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model import llama, rowops
from confkv_engine.model.loader import load_model

CATEGORIES = ("matmul", "lm head", "attention", "step metadata", "norm/rope/act", "model other", "sampling",
              "python/scheduling")
Scenarios = dict[str, tuple[int, int]]  # name -> (sequences, prompt tokens)
DEFAULT_MODEL = "builtin:smollm2-135m"
SCENARIOS: Scenarios = {"decode@1": (1, 128), "decode@32": (32, 128), "prefill@512": (1, 512)}


@contextlib.contextmanager
def patched(owner: Any, name: str, label: str) -> Iterator[None]:
    """Wrap ``owner.name`` in a profiler range named ``label`` for the duration of the block."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return original(*args, **kwargs)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def instance_patched(module: nn.Module, label: str) -> Iterator[None]:
    """Wrap one module's ``forward`` (not its class's) in a profiler range named ``label``."""
    original = module.forward

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return original(*args, **kwargs)

    module.forward = wrapper  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.forward


def linear_classes(model: nn.Module) -> set[type]:
    """Every linear-like module class in the model (nn.Linear and the quantized ones)."""
    return {type(m) for m in model.modules() if isinstance(m, nn.Linear) or hasattr(m, "kernel_for")}


@contextlib.contextmanager
def labelled(engine: LLMEngine) -> Iterator[None]:
    backend = engine.backend
    with contextlib.ExitStack() as stack:
        # The head first: its range then wraps the unpatched forward, so it is not also "matmul".
        stack.enter_context(instance_patched(engine.model.lm_head, "lm head"))
        for cls in linear_classes(engine.model):
            stack.enter_context(patched(cls, "forward", "matmul"))
        stack.enter_context(patched(backend, "attend", "attention"))
        stack.enter_context(patched(backend, "begin_step", "step metadata"))
        stack.enter_context(patched(llama.RMSNorm, "forward", "norm/rope/act"))
        stack.enter_context(patched(llama, "apply_rope", "norm/rope/act"))
        stack.enter_context(patched(llama, "rms_norm", "norm/rope/act"))  # q/k heads' norm (fused qkv)
        stack.enter_context(patched(llama.MLP, "forward", "norm/rope/act"))
        for name in ("rms_norm", "add_rms_norm", "qk_rope_", "gated_act"):  # the native row-wise blocks
            stack.enter_context(patched(rowops, name, "norm/rope/act"))
        stack.enter_context(patched(llama.LlamaForCausalLM, "forward", "model other"))
        stack.enter_context(patched(engine_module, "sample_step", "sampling"))
        yield


def exclusive_times(events: Any, labels: set[str]) -> dict[str, float]:
    """Per label, microseconds inside its ranges minus the labelled ranges nested in them."""
    totals = dict.fromkeys(labels, 0.0)

    def nested_labelled(ev: Any) -> float:
        total = 0.0
        for child in ev.cpu_children:
            total += child.cpu_time_total if child.name in labels else nested_labelled(child)
        return total

    for ev in events:
        if ev.name in labels:
            totals[ev.name] += ev.cpu_time_total - nested_labelled(ev)
    return totals


def build_engine(weights: str, cache_size: str | None = None, compiled: bool = False,
                 model: str = DEFAULT_MODEL) -> LLMEngine:
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    extra = {} if weights in ("fp32", "bf16") else {"weights": weights}
    loaded = load_model(model, dtype, "cpu", **extra)
    config = ConfKVConfig()
    if cache_size:
        config = with_overrides(config, "confkv", max_cache_size=cache_size)
    if compiled:
        config = with_overrides(config, "model", compile=True)
    return LLMEngine(loaded, config)


def prompts(n: int, length: int, vocab: int, run: int) -> list[list[int]]:
    # Different tokens every run: a repeated prompt would be served from the prefix cache.
    gen = torch.Generator().manual_seed(length * 1000 + n + 100_003 * (run + 2))
    return [torch.randint(100, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def setup(engine: LLMEngine, scenario: str, run: int, scenarios: Scenarios) -> None:
    """Queue the scenario's requests; for decode, step until every prompt is prefilled."""
    n, length = scenarios[scenario]
    greedy = SamplingParams(max_tokens=4096 - length, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts(n, length, engine.vocab_size, run)):
        engine.add_request(f"{scenario}-{run}-{i}", prompt, greedy)
    if scenario.startswith("decode"):
        while any(s.num_computed < s.prompt_len for s in engine._seqs.values()):
            engine.step()
        engine.step()


def teardown(engine: LLMEngine) -> None:
    for rid in list(engine._seqs):
        engine.abort_request(rid)
    engine.step()


def timed_steps(engine: LLMEngine, scenario: str, steps: int, scenarios: Scenarios) -> float:
    """Median unprofiled wall ms of one step."""
    times = []
    for run in range(steps if scenario.startswith("prefill") else 1):
        setup(engine, scenario, run, scenarios)
        for _ in range(1 if scenario.startswith("prefill") else steps):
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1e3)
        teardown(engine)
    return sorted(times)[len(times) // 2]


def profiled_step(engine: LLMEngine, scenario: str, steps: int, scenarios: Scenarios) -> dict[str, float]:
    """Mean ms per step per category (plus ``step`` total) under the profiler."""
    setup(engine, scenario, 99, scenarios)
    ms = profiled(engine, 1 if scenario.startswith("prefill") else steps)
    teardown(engine)
    return ms


def profiled(engine: LLMEngine, repeat: int) -> dict[str, float]:
    with labelled(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeat):
            with record_function("python/scheduling"):
                engine.step()
    ms = {k: v / 1e3 / repeat for k, v in exclusive_times(prof.events(), set(CATEGORIES)).items()}
    ms["step"] = sum(ms.values())
    return ms


def long_decode(engine: LLMEngine, scenario: str, steps: int, scenarios: Scenarios) -> dict[str, Any]:
    """Long-context decode: the prompts are prefilled once (that is the slow part), then a warm-up
    step, the timed steps and the profiled steps run on the same sequences."""
    setup(engine, scenario, 0, scenarios)
    engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    ms = profiled(engine, steps)
    teardown(engine)
    return {"wall_ms": sorted(times)[len(times) // 2], "profiled_ms": ms}


def measure(weights: str, steps: int, scenarios: Scenarios, cache_size: str | None,
            long: bool = False, compiled: bool = False, model: str = DEFAULT_MODEL) -> dict[str, Any]:
    start = time.perf_counter()
    engine = build_engine(weights, cache_size, compiled, model)
    load_s = time.perf_counter() - start
    out: dict[str, Any] = {"load_s": round(load_s, 2)}
    if getattr(engine, "compile_seconds", None) is not None:  # (an engine before model.compile has none)
        out["compile_s"] = round(engine.compile_seconds, 2)
    for scenario in scenarios:
        if long:
            out[scenario] = long_decode(engine, scenario, steps, scenarios)
            continue
        setup(engine, scenario, -1, scenarios)  # warm-up
        engine.step()
        teardown(engine)
        out[scenario] = {"wall_ms": timed_steps(engine, scenario, steps, scenarios),
                         "profiled_ms": profiled_step(engine, scenario, steps, scenarios)}
    return out


def table(results: dict[str, Any], scenarios: Scenarios) -> str:
    cols = [(w, s) for w in results for s in scenarios]
    head = "| ms per step | " + " | ".join(f"{w} {s}" for w, s in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    for cat in (*CATEGORIES, "step"):
        cells = []
        for w, s in cols:
            prof = results[w][s]["profiled_ms"]
            share = 100 * prof[cat] / prof["step"] if cat != "step" else 100
            cells.append(f"{prof[cat]:.2f} ({share:.0f}%)")
        name = "**profiled step**" if cat == "step" else cat
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| **wall, unprofiled** | " + " | ".join(f"{results[w][s]['wall_ms']:.2f}" for w, s in cols)
                 + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="a builtin name, GGUF file or HF directory")
    p.add_argument("--weights", default="fp32,bf16", help="comma-separated --weights modes")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--steps", type=int, default=10, help="decode steps (prefill runs) measured")
    p.add_argument("--out", type=Path, help="also write the numbers as JSON")
    p.add_argument("--context", type=int, help="long-context decode: prompt tokens per sequence")
    p.add_argument("--batches", default="1,8,32", help="with --context: sequences decoded together")
    p.add_argument("--compile", action="store_true", help="model.compile (elementwise blocks compiled)")
    p.add_argument("--cache-size", help="maxCacheSize (default: 3Gi with --context, else the engine's)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    scenarios = SCENARIOS
    cache_size = args.cache_size
    if args.context:
        scenarios = {f"decode@{b}": (int(b), args.context) for b in args.batches.split(",")}
        cache_size = cache_size or "3Gi"  # 32 x 2,048 tokens need 1.5 GB in bf16
    results = {w: measure(w, args.steps, scenarios, cache_size, bool(args.context), args.compile, args.model)
               for w in args.weights.split(",")}
    print(f"model={args.model} threads={args.threads} cpu={torch.backends.cpu.get_cpu_capability()} "
          f"context={args.context} "
          f"compile={args.compile} " + " ".join(f"{w}: load {r['load_s']} s, compile {r.get('compile_s')} s"
                                                for w, r in results.items()))
    print(table(results, scenarios))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": args.model, "threads": args.threads, "context": args.context,
                                        "compile": args.compile, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
