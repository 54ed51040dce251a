"""Optional ``torch.compile`` of the model's elementwise blocks (``model.compile``, ``--compile``).

What is compiled: the three elementwise functions every layer calls, RMSNorm (upcast, norm,
downcast, weight), RoPE (upcast, rotate both halves, concatenate, downcast) and the gated
activation (``silu(gate) * up``). Inductor fuses each into one C++ loop. The matmuls are not
compiled: they already are single oneDNN / weight-only kernel calls, and the quantized linears
hold their weights in per-layer closures that would make dynamo specialise on every layer (30
recompiles past its cache limit). Attention is not compiled either: the paged backend's per-step
plans are Python objects dynamo would guard on every step.

The functions take the weights as arguments, so one compiled graph serves every layer; shapes
are dynamic in the token count (one row, the decode case, is its own specialisation), so two
graphs per function cover every step. Compilation runs at start-up on dummy inputs and its time
is logged; inductor's on-disk caches live under ``<cacheDir>/inductor`` (engine.cacheDir, else
``~/.cache/confkv``), so a restart loads the compiled kernels instead of generating them.
``freezing`` is not used: it folds parameters into the graph as constants, which would turn the
one shared graph into one per layer.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from confkv_engine.model import llama

log = logging.getLogger(__name__)

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "confkv"


def compile_elementwise(model: llama.LlamaForCausalLM, dtype: torch.dtype,
                        cache_dir: Path | None = None) -> float:
    """Swap the model's elementwise functions for compiled ones and compile them now (rows 1 and
    2, in ``dtype`` activations, under inference mode as the engine runs). Returns the seconds it
    took. A user's own ``TORCHINDUCTOR_CACHE_DIR`` wins over ``cache_dir``."""
    os.environ.setdefault(CACHE_ENV, str((cache_dir or default_cache_dir()) / "inductor"))
    start = time.perf_counter()
    ops = llama.Elementwise(norm=torch.compile(llama.rms_norm), rope=torch.compile(llama.apply_rope),
                            act=torch.compile(llama.silu_mul))
    _warm_up(model, ops, dtype)
    model.ops.norm, model.ops.rope, model.ops.act = ops.norm, ops.rope, ops.act
    seconds = time.perf_counter() - start
    log.info("compiled the elementwise blocks in %.1f s (inductor cache %s)", seconds, os.environ[CACHE_ENV])
    return seconds


def _warm_up(model: llama.LlamaForCausalLM, ops: llama.Elementwise, dtype: torch.dtype) -> None:
    """One call at one row (decode's own specialisation) and one at two rows with the row dimension
    marked dynamic (the graph every longer step reuses)."""
    args = model.args
    dev = model.inv_freq.device
    weight = model.norm.weight
    heads = args.num_heads + args.num_kv_heads
    with torch.inference_mode():
        for rows in (1, 2):
            x = torch.zeros(rows, args.hidden_size, dtype=dtype, device=dev)
            # Views laid out as the fused projections produce them (strides are guarded on).
            qkv = torch.zeros(rows, heads + args.num_kv_heads, args.head_dim, dtype=dtype, device=dev)
            cos = torch.zeros(rows, args.head_dim // 2, device=dev)
            sin = torch.zeros(rows, args.head_dim // 2, device=dev)
            gate_up = torch.zeros(rows, 2 * args.intermediate_size, dtype=dtype, device=dev)
            if rows > 1:
                for t in (x, qkv, cos, sin, gate_up):
                    torch._dynamo.mark_dynamic(t, 0)
            ops.norm(x, weight, args.rms_norm_eps)  # type: ignore[misc]
            ops.rope(qkv[:, :heads], cos, sin)  # type: ignore[misc]
            ops.act(*gate_up.chunk(2, dim=-1))  # type: ignore[misc]
