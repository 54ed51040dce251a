"""One command that shows what the engine does on a GPU: five sections, one table, one JSON.

    python bench/gpu.py            # on one GPU (H200: the real shapes below), <= 8 minutes
    python bench/gpu.py --quick    # the same shapes, fewer levels and tokens, <= 3 minutes
    python bench/gpu.py --tiny     # tiny shapes on whatever device (the test suite runs it on CPU)

a. parity with transformers on the device: tiny random Llama and Qwen2 at the device's auto dtype
   (bf16 on CUDA, fp32 on CPU); the engine's greedy tokens equal ``generate``'s, logits close;
b. tokens/s of ``LLMEngine`` vs transformers ``generate`` (sdpa, static cache) at 1 / 32 / 128
   concurrent requests of the same prompts, on a random Llama-3-8B-shaped model; the engine decodes
   through CUDA graphs (its default on CUDA), ``--enforce-eager`` runs it without them;
c. the deployment guide's scenario on a random Qwen2.5-32B-shaped model: the peak KV bytes one
   request holds while generating 4,000 tokens under ``full``, ``conf-kv`` at the guide's ratio
   (9.2 / 15.8 of the full cache) and at 0.25, and ``conf-kv`` with precision tiers, all four in one
   batch; and how many such requests the planned pool holds at once under each;
d. the agent's NVML reading beside torch's view (allocated, the KV pool, the weights) at idle and
   under load, and whether the default VRAM alert (85%) would fire at idle, raw and as the agent
   reads it (the pool's reclaimable bytes taken off).
e. tensor parallelism (``bench/tensor_parallel.py``): TP = 1 beside each ``--tp-degrees`` on
   ``--tp-model`` in one run (tokens/s, per-rank KV bytes, greedy equal); a machine with fewer than
   2 GPUs gets one row saying it was skipped and why.

Random weights of real shapes are built on the device (nothing is downloaded). Imports only the
engine's public entry points: ``LLMEngine``, ``SamplingParams``, the model class and ``build_model``,
the loader's device and dtype resolution, and the agent's NVML reader. Writes bench/results/gpu.json
(``--out`` elsewhere). Tokens/s are of this run only; docs/performance.md quotes a run's table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from confkv_agent.collect import NvmlReader
from confkv_api.config import AlertsSection, ConfKVConfig
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model.llama import DenseAttention, LlamaForCausalLM, ModelArgs
from confkv_engine.model.loader import resolve_device, resolve_dtype
from confkv_engine.model.weights import build_model

RESULTS = Path(__file__).resolve().parent / "results"
GiB = 1 << 30
GUIDE_RATIO = 9.2 / 15.8  # the deployment guide's conf-kv cache against the full one
_TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
             initializer_range=0.1)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(model_type="llama", rope_theta=10000.0, **_TINY),
    "tiny-qwen2": dict(model_type="qwen2", rope_theta=1e6, tie_word_embeddings=True, **_TINY),
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5),
    "qwen2.5-32b": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        rope_theta=1e6, max_position_embeddings=32768, rms_norm_eps=1e-6),
}
# (throughput model, levels, prompt and new tokens; scenario model, prompt, generated tokens)
PROFILES = {
    "full": dict(b_model="llama3-8b", levels=(1, 32, 128), b_prompt=128, b_new=128,
                 c_model="qwen2.5-32b", c_prompt=256, c_new=4000, pool="16Gi"),
    "quick": dict(b_model="llama3-8b", levels=(1, 32), b_prompt=128, b_new=64,
                  c_model="qwen2.5-32b", c_prompt=256, c_new=1000, pool="16Gi"),
    "tiny": dict(b_model="tiny-llama", levels=(1, 4), b_prompt=16, b_new=8,
                 c_model="tiny-qwen2", c_prompt=16, c_new=240, pool="64Mi"),
}


def hf_config(name: str) -> Any:
    import transformers

    shape = dict(SHAPES[name])
    kind = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[shape.pop("model_type")]
    return kind(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=0)


def random_hf_model(name: str, dtype: torch.dtype, device: str, seed: int) -> Any:
    """transformers' model of ``name``'s shape, randomly initialised on the device in ``dtype``."""
    import transformers

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(hf_config(name), attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def loaded(model: LlamaForCausalLM, max_len: int) -> SimpleNamespace:
    """What ``LLMEngine`` takes from a loaded model (no tokenizer: the bench works in token ids)."""
    return SimpleNamespace(model=model, max_model_len=max_len, eos_token_ids=())


def ours_from_hf(hf: Any, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    """The engine's model over the same tensors (``build_model`` keeps tensors already in place)."""
    args = ModelArgs.from_hf_config(hf.config.to_dict())
    state = ((k.removeprefix("model."), v) for k, v in hf.state_dict().items())
    return build_model(args, state, dtype, device)


def random_ours(name: str, dtype: torch.dtype, device: str, seed: int) -> LlamaForCausalLM:
    """The engine's model of ``name``'s shape with random weights made on the device, one at a time."""
    args = ModelArgs.from_hf_config(hf_config(name).to_dict())
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in LlamaForCausalLM(args).named_parameters()}
    gen = torch.Generator(device).manual_seed(seed)

    def tensors():  # norms at 1, the rest N(0, 0.02): activations stay finite through 64 layers
        for n, shape in shapes.items():
            if n.endswith("norm.weight"):
                yield n, torch.ones(shape, dtype=dtype, device=device)
            else:
                yield n, torch.randn(shape, generator=gen, dtype=dtype, device=device).mul_(0.02)
    return build_model(args, tensors(), dtype, device)


def engine_for(model: LlamaForCausalLM, max_len: int, batch: int, pool: str | None,
               cuda_graphs: bool = True) -> LLMEngine:
    """``cuda_graphs``: decode through CUDA graphs on CUDA (the engine's default); False: eager."""
    config = ConfKVConfig.model_validate({
        "engine": {"maxBatchSize": batch, "maxNumBatchedTokens": 4096, "prefillChunk": 512,
                   "cudaGraphs": cuda_graphs},
        "confkv": {"maxCacheSize": pool}})
    return LLMEngine(loaded(model, max_len), config)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- a. parity ---------------------------------------------------------------------------------
def parity(device: str, dtype: torch.dtype) -> list[dict[str, Any]]:
    rows = []
    for name in ("tiny-llama", "tiny-qwen2"):
        hf = random_hf_model(name, dtype, device, seed=0)
        ours = ours_from_hf(hf, dtype, device)
        prompt, new = prompts(1, 24, 320, seed=1)[0], 16
        ids = torch.tensor([prompt], device=device)
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False)[0, len(prompt):].tolist()
        mine = engine_for(ours, 256, 4, "16Mi").generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))[0].output_token_ids
        full = torch.tensor(prompt + theirs, device=device)
        with torch.inference_mode():
            ref = hf(full[None]).logits[0].float()
            got = ours.compute_logits(ours(full, torch.arange(len(full), device=device), DenseAttention()))
        diff = (got - ref).abs().max().item() / ref.abs().max().item()
        rows.append({"model": name, "dtype": str(dtype).removeprefix("torch."),
                     "greedy_equal": mine == theirs, "max_logit_diff_rel": diff, "tokens": new})
    return rows


# ---- b. throughput -----------------------------------------------------------------------------
def throughput(device: str, dtype: torch.dtype, p: dict[str, Any]) -> list[dict[str, Any]]:
    hf = random_hf_model(p["b_model"], dtype, device, seed=0)
    ours = ours_from_hf(hf, dtype, device)
    vocab, new = hf.config.vocab_size, p["b_new"]
    graphs = p.get("cuda_graphs", True)
    engine = engine_for(ours, p["b_prompt"] + new + 16, max(p["levels"]), p["pool"], graphs)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    rows = []
    for level in p["levels"]:
        batch = prompts(level, p["b_prompt"], vocab, seed=level)
        engine.generate(batch[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm
        sync(device)
        start = time.perf_counter()
        engine.generate(batch, params)
        sync(device)
        ours_s = time.perf_counter() - start
        ids = torch.tensor(batch, device=device)
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, cache_implementation="static")
        hf.generate(ids[:, :8], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm
        sync(device)
        start = time.perf_counter()
        hf.generate(ids, **kwargs)
        sync(device)
        hf_s = time.perf_counter() - start
        rows.append({"model": p["b_model"], "concurrent": level, "new_tokens": new,
                     "confkv_tok_s": level * new / ours_s, "transformers_tok_s": level * new / hf_s,
                     "ratio": hf_s / ours_s, "cuda_graphs": graphs and device.startswith("cuda")})
    del engine, ours, hf
    return rows


# ---- c and d. the guide's scenario, memory readings ----------------------------------------------
SCENARIO = [("full", dict(kv_policy="full")),
            (f"conf-kv {GUIDE_RATIO:.3f}", dict(kv_policy="conf-kv", kv_budget=GUIDE_RATIO)),
            ("conf-kv 0.25", dict(kv_policy="conf-kv", kv_budget=0.25)),
            (f"conf-kv+tiers {GUIDE_RATIO:.3f}", dict(kv_policy="conf-kv", kv_budget=GUIDE_RATIO,
                                                      kv_tiers=("full", "int4", "int2")))]


def memory_view(engine: LLMEngine, device: str, nvml: NvmlReader) -> dict[str, Any]:
    stats, plan = engine.stats(), engine.memory_plan
    view: dict[str, Any] = {
        "pool_bytes": stats.kv_bytes_total, "pool_reclaimable_bytes": stats.kv_bytes_reclaimable,
        "weights_bytes": plan.figures.weights_bytes, "total_bytes": plan.figures.total_bytes}
    if device.startswith("cuda"):
        view["torch_allocated_bytes"] = torch.cuda.memory_allocated()
        view["torch_reserved_bytes"] = torch.cuda.memory_reserved()
    gpus = nvml.read()
    view["nvml"] = "; ".join(f"gpu{g.index} {g.used_bytes}/{g.total_bytes}" for g in gpus) or nvml.reason
    if gpus:
        used, total = max(g.used_bytes for g in gpus), gpus[0].total_bytes
        threshold = AlertsSection().vram.threshold
        view.update(nvml_used_bytes=used, nvml_fraction=used / total,
                    agent_fraction=(used - stats.kv_bytes_reclaimable) / total,
                    alert_fires_raw=used / total > threshold,
                    alert_fires_agent=(used - stats.kv_bytes_reclaimable) / total > threshold)
    return view


def scenario(device: str, dtype: torch.dtype, p: dict[str, Any]) -> tuple[list[dict[str, Any]], dict]:
    model = random_ours(p["c_model"], dtype, device, seed=0)
    max_len = p["c_prompt"] + p["c_new"] + 16
    engine = engine_for(model, max_len, 64, None if device.startswith("cuda") else p["pool"])
    nvml = NvmlReader()
    memory: dict[str, Any] = {"plan": engine.memory_plan.lines(), "idle": memory_view(engine, device, nvml)}
    batch = prompts(len(SCENARIO), p["c_prompt"], model.args.vocab_size, seed=7)
    for i, ((_, extra), ids) in enumerate(zip(SCENARIO, batch, strict=True)):
        engine.add_request(f"s{i}", ids, SamplingParams(temperature=0.0, max_tokens=p["c_new"],
                                                        ignore_eos=True, **extra))
    final, steps = {}, 0
    while len(final) < len(SCENARIO):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        if steps == p["c_new"] // 2:
            memory["load"] = memory_view(engine, device, nvml)
    pool, rows = engine.memory_plan.pool_bytes, []
    for i, (label, _) in enumerate(SCENARIO):
        usage = final[f"s{i}"].kv_usage
        rows.append({"policy": label, "generated": len(final[f"s{i}"].output_token_ids),
                     "peak_kv_bytes": usage.peak_kv_bytes,
                     "concurrent_held": pool // max(1, usage.peak_kv_bytes)})
    del engine, model
    return rows, memory


def run(p: dict[str, Any], device: str, sections: str, tp_model: str = "builtin:smollm2-135m",
        tp_degrees: tuple[int, ...] = (3,)) -> dict[str, Any]:
    dtype = resolve_dtype("auto", device)
    out: dict[str, Any] = {"device": device, "dtype": str(dtype).removeprefix("torch."),
                           "torch": torch.__version__, "python": platform.python_version(), "profile": p}
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    for key, fn in (("a", lambda: parity(device, dtype)), ("b", lambda: throughput(device, dtype, p))):
        if key in sections:
            start = time.perf_counter()
            out[key] = fn()
            out[f"{key}_seconds"] = time.perf_counter() - start
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    if "c" in sections or "d" in sections:
        start = time.perf_counter()
        out["c"], out["d"] = scenario(device, dtype, p)
        out["c_seconds"] = time.perf_counter() - start
    if "e" in sections:
        out["e"] = tensor_parallel(tp_model, tp_degrees)
    return out


def tensor_parallel(source: str, degrees: list[int]) -> list[dict[str, Any]]:
    """Section e: TP = 1 beside each degree in one run (``bench/tensor_parallel.py``); on a machine
    with fewer than 2 GPUs it returns one row saying it was skipped and why."""
    try:
        from bench.tensor_parallel import tp_section
    except ImportError:  # run as a script (python bench/gpu.py): the sibling module
        from tensor_parallel import tp_section  # type: ignore[no-redef]
    return tp_section(source, degrees)


def table(result: dict[str, Any]) -> str:
    lines = [f"device {result['device']} ({result.get('gpu', platform.processor() or 'cpu')}), "
             f"dtype {result['dtype']}, torch {result['torch']}"]
    for row in result.get("a", []):
        lines.append(f"a  {row['model']:<12} greedy equal {row['greedy_equal']!s:<5} "
                     f"max logit diff {row['max_logit_diff_rel']:.2e} (of max |logit|)")
    for row in result.get("b", []):
        lines.append(f"b  {row['model']:<12} {row['concurrent']:>4} concurrent: "
                     f"confkv {row['confkv_tok_s']:9.1f} tok/s, "
                     f"transformers {row['transformers_tok_s']:9.1f} tok/s ({row['ratio']:.2f}x)"
                     f"{', CUDA graphs' if row.get('cuda_graphs') else ''}")
    for row in result.get("c", []):
        lines.append(f"c  {row['policy']:<22} {row['generated']} tokens: "
                     f"peak KV {_size(row['peak_kv_bytes'])}, "
                     f"{row['concurrent_held']} such requests fit the pool")
    for row in result.get("e", []):
        lines.append(f"e  tensor parallel: {json.dumps(row, default=str)}")
    d = result.get("d", {})
    lines += [f"d  {line}" for line in d.get("plan", [])]
    for when in ("idle", "load"):
        if when in d:
            lines.append(f"d  {when}: {json.dumps(d[when], default=str)}")
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / GiB:.3f} GiB" if n >= GiB else f"{n / (1 << 20):.3f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the real shapes, fewer levels and tokens")
    size.add_argument("--tiny", action="store_true", help="tiny shapes (what the test suite runs on CPU)")
    parser.add_argument("--device", default="auto", help="auto (default), cuda or cpu")
    parser.add_argument("--sections", default="abcde",
                        help="which sections to run (default abcde; e = tensor parallel, >= 2 GPUs)")
    parser.add_argument("--tp-model", default="builtin:smollm2-135m",
                        help="section e's model (a checkpoint: its heads must divide by each degree)")
    parser.add_argument("--tp-degrees", default="3", help="section e's degrees, comma-separated (default 3)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="section b without CUDA graphs (the engine's --enforce-eager), for a peer run")
    parser.add_argument("--out", type=Path, help="JSON path (default bench/results/gpu[-quick|-tiny].json)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    name = "tiny" if args.tiny else "quick" if args.quick else "full"
    degrees = tuple(int(d) for d in args.tp_degrees.split(","))
    profile = {**PROFILES[name], "cuda_graphs": not args.enforce_eager}
    result = run(profile, device, args.sections, args.tp_model, degrees)
    out = args.out or RESULTS / f"gpu{'' if name == 'full' else '-' + name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(table(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
