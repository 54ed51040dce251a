"""What appending to the retention state costs in a conf-kv decode step (the engine, gathering path).

The engine prefills ``B`` sequences of ``S`` tokens from real text (as ``bench.micro.decode_step``)
under conf-kv at f = 0.25, then times decode steps: the step's median, the time spent in
``RetentionState.on_append`` per step (every retained sequence appends one slot), and, under the
profiler, the ``aten::cat`` calls and time per step. To compare two trees, run it from each with the
same arguments in one locked run (its peer is the other tree's run). SmolLM2-135M, fp32, CPU.

    python -m bench.micro.retention_append --batch 8 --seq-len 2048 --steps 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.quality.kv_scenarios import greedy, make_engine, variant_config
from testkit.kv_runs import CHUNK, parse_args, pydoc_tokens

OUT = Path(__file__).resolve().parents[1] / "results" / "micro" / "retention_append.json"


def _engine(loaded, variant: str, batch: int, seq_len: int, steps: int):
    from confkv_engine.attention.retention import RetentionAttention
    from confkv_engine.core.engine import LLMEngine

    args, tokens = parse_args([]), pydoc_tokens(loaded.tokenizer)
    probe = make_engine(loaded, variant_config("full", args))
    blocks = batch * probe.cache.blocks_for_tokens(seq_len + 2 * steps + 4) + 8
    base = make_engine(loaded, variant_config(variant, args), blocks=blocks, batched=batch * CHUNK)
    backend = RetentionAttention(base.parts.cache, loaded.model.args.num_heads, in_place=False)
    eng = LLMEngine(loaded, parts=dataclasses.replace(base.parts, backend=backend))
    for i in range(batch):
        start = (i * seq_len) % max(1, len(tokens) - seq_len)
        eng.add_request(f"p{i}", tokens[start:start + seq_len], greedy(2 * steps + 4))
    while not all(s.num_computed >= s.prompt_len for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(2):
        eng.step()
    return eng


def measure(loaded, variant: str, batch: int, seq_len: int, steps: int) -> dict:
    from confkv_engine.retention.runtime import RetentionState

    spent = [0.0]
    original = RetentionState.on_append

    def timed(self, positions):
        t0 = time.perf_counter()
        original(self, positions)
        spent[0] += time.perf_counter() - t0

    RetentionState.on_append = timed  # type: ignore[method-assign]
    try:
        eng = _engine(loaded, variant, batch, seq_len, steps)
        times, appends = [], []
        for _ in range(steps):
            spent[0], t0 = 0.0, time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
            appends.append(spent[0])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                eng.step()
    finally:
        RetentionState.on_append = original  # type: ignore[method-assign]
    cat = next((e for e in prof.key_averages() if e.key == "aten::cat"), None)
    return {"variant": variant, "shape": f"{batch}x{seq_len}",
            "step_ms": round(statistics.median(times) * 1e3, 1),
            "on_append_ms_per_step": round(statistics.median(appends) * 1e3, 2),
            "cat_calls_per_step": round(cat.count / steps, 1) if cat else 0.0,
            "cat_ms_per_step": round(cat.cpu_time_total / 1e3 / steps, 2) if cat else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--variant", default="conf-kv")
    a = p.parse_args(argv)
    from confkv_engine.model.loader import load_model

    torch.set_num_threads(a.threads)
    loaded = load_model("builtin:smollm2-135m", torch.float32, "cpu")
    loaded.model.eval()
    row = measure(loaded, a.variant, a.batch, a.seq_len, a.steps)
    print(" ".join(f"{k}={v}" for k, v in row.items()))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"threads": a.threads, "steps": a.steps, "row": row}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
