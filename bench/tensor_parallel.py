"""Tensor-parallel section for the GPU benchmark: decode throughput and per-rank KV bytes at
degree 1 (the peer, same run) and at each degree the machine's GPUs allow.

``tp_section(source, degrees)`` returns rows for ``bench/gpu.py``'s table and JSON; on a machine
with fewer than two GPUs it returns one row saying the section was skipped and why. Degree 1 runs a
plain ``LLMEngine``; degree N spawns N - 1 ranks (``parallel.launch.Leader``) with NCCL, rank 0 in
this process. Greedy outputs of every degree are compared with degree 1's and reported.

    python -m bench.tensor_parallel --model /models/Qwen2.5-7B-Instruct --degrees 2 4
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from confkv_api.config import ConfKVConfig
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.parallel.group import destroy_group
from confkv_engine.parallel.launch import Leader


def _config(source: str, degree: int, pool: str) -> ConfKVConfig:
    return ConfKVConfig.model_validate({
        "model": {"source": source, "dtype": "bfloat16", "weights": "bf16"},
        "engine": {"device": "cuda", "tensorParallel": degree},
        "confkv": {"maxCacheSize": pool, "prefixCache": {"enabled": False}}})


def _measure(engine: LLMEngine, batch: int, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    prompts = [[(i * 131 + j * 7 + 3) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"tokens_per_s": round(batch * max_tokens / seconds, 1), "seconds": round(seconds, 3),
            "kv_bytes_used_rank0": engine.cache.used_bytes, "kv_block_bytes": engine.cache.spec.block_bytes,
            "outputs": [o.output_token_ids for o in outs]}


def tp_section(source: str, degrees: list[int], batch: int = 8, prompt_len: int = 512,
               max_tokens: int = 128, pool: str = "8Gi") -> list[dict[str, Any]]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        return [{"section": "tensor_parallel", "skipped": f"needs at least 2 GPUs; this machine has {gpus}"}]
    cfg = _config(source, 1, pool)
    from confkv_engine.model.loader import load_model

    loaded = load_model(source, torch.bfloat16, "cuda", weights="bf16")
    base = _measure(LLMEngine(loaded, cfg), batch, prompt_len, max_tokens)
    del loaded
    torch.cuda.empty_cache()
    rows = [{"section": "tensor_parallel", "degree": 1, **{k: v for k, v in base.items() if k != "outputs"}}]
    for degree in [d for d in degrees if 1 < d <= gpus]:
        leader = Leader(_config(source, degree, pool))
        _, engine = leader.start()
        got = _measure(engine, batch, prompt_len, max_tokens)
        engine.close()
        destroy_group()
        rows.append({"section": "tensor_parallel", "degree": degree,
                     "greedy_equal_to_degree_1": got.pop("outputs") == base["outputs"], **got})
    skipped = [d for d in degrees if d > gpus]
    if skipped:
        reason = f"degrees {skipped} need more GPUs than {gpus}"
        rows.append({"section": "tensor_parallel", "skipped": reason})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--degrees", type=int, nargs="+", default=[2])
    args = parser.parse_args(argv)
    print(json.dumps(tp_section(args.model, args.degrees), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
