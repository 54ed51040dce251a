"""Start-up memory planning: measure what serving needs besides the KV pool, then size the pool.

``plan_startup_memory`` runs before the pool is allocated. On CUDA it runs one profiling step, the
largest the config allows (``maxNumBatchedTokens`` dummy prompt tokens in chunks of ``prefillChunk``,
logits for ``maxBatchSize`` rows, or for a slice of the sampling signal's, ``core.step_signal``, if
that is more), through the real model and paged attention over a temporary cache just large enough
for it, and reads ``torch.cuda.max_memory_allocated`` (less the weights and that
cache) plus what the caching allocator reserved beyond it: the activation peak. The decode gather is
not part of that step (it grows with context, not batch tokens), so it gets its own bound, enforced
by the attention backend. ``cache.planner`` turns the figures into the pool's bytes, and the figures
are logged at start.

On CPU there is no allocator peak to read: the step is not run, the activation peak counts as 0 and
the pool stays within the host cap (half the available RAM), which leaves the rest to activations.
``run_profile_step`` itself is device-agnostic, so a CPU test runs it.
"""

from __future__ import annotations

import logging

import torch

from confkv_api.config import EngineSection
from confkv_engine.attention.paged import PagedAttention, gather_slot_bytes
from confkv_engine.cache.kv_cache import CacheSpec, KVCache, SeqKV
from confkv_engine.cache.memory import device_figures
from confkv_engine.cache.planner import MemoryPlan, decode_gather_bound, plan_memory
from confkv_engine.core.step_signal import slice_rows
from confkv_engine.model.llama import LlamaForCausalLM

log = logging.getLogger("confkv.memory")


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (shared tensors counted once)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def profile_lengths(engine: EngineSection) -> list[int]:
    """The largest step's sequences: ``maxNumBatchedTokens`` tokens in prefill chunks (at most
    ``maxBatchSize`` sequences)."""
    chunk, total = engine.prefill_chunk, engine.max_num_batched_tokens
    lengths = [chunk] * min(engine.max_batch_size, total // chunk)
    rest = total - sum(lengths)
    if rest and len(lengths) < engine.max_batch_size:
        lengths.append(rest)
    return lengths or [total]


def run_profile_step(model: LlamaForCausalLM, spec: CacheSpec, lengths: list[int], sample_rows: int) -> int:
    """One forward pass of dummy prompts of ``lengths`` tokens through paged attention over a
    temporary cache, then logits for ``sample_rows`` rows; returns the temporary cache's bytes."""
    tables = 1 + (spec.layer_groups.num_window_groups if spec.layer_groups else 0)  # window groups' too
    # K and V tables (a prompt's whole chunk is in each window table during its step), plus the null block
    blocks = sum(2 * tables * -(-n // spec.block_size) for n in lengths) + 1
    cache = KVCache(spec, blocks)
    seqs = [SeqKV() for _ in lengths]
    for s, n in zip(seqs, lengths, strict=True):
        cache.reserve(s, n)
    backend = PagedAttention(cache, model.args.num_heads)
    device = spec.device
    ids = torch.zeros(sum(lengths), dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    with torch.inference_mode():
        backend.begin_step(seqs, lengths, positions)
        hidden = model(ids, positions, backend)
        backend.end_step()
        model.compute_logits(hidden[: min(sample_rows, hidden.shape[0])])
    return blocks * spec.block_bytes


def measure_activation_peak(model: LlamaForCausalLM, spec: CacheSpec, engine: EngineSection) -> int:
    """The profiling step's peak on CUDA (bytes above the weights, the temporary cache excluded),
    with the caching allocator's reserve beyond the peak; 0 elsewhere."""
    if spec.device.type != "cuda":
        return 0
    torch.cuda.synchronize(spec.device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(spec.device)
    base = torch.cuda.memory_allocated(spec.device)
    # Logits for the sampled rows, or for a slice of the retention's sampling signal if that is more.
    rows = max(engine.max_batch_size, slice_rows(model.args.vocab_size))
    cache_bytes = run_profile_step(model, spec, profile_lengths(engine), rows)
    torch.cuda.synchronize(spec.device)
    peak = activation_peak(base, torch.cuda.max_memory_allocated(spec.device),
                           torch.cuda.max_memory_reserved(spec.device), cache_bytes)
    torch.cuda.empty_cache()
    return peak


def activation_peak(base: int, peak_allocated: int, peak_reserved: int, temporary: int) -> int:
    """The step's own peak: allocated at the peak less what was there before (the weights) and the
    temporary cache, plus what the caching allocator reserved beyond its peak allocation (memory
    the pool cannot have either)."""
    return max(0, peak_allocated - base - temporary) + max(0, peak_reserved - peak_allocated)


def plan_startup_memory(model: LlamaForCausalLM, spec: CacheSpec, engine: EngineSection, max_model_len: int,
                        max_cache_size: tuple[str, float] | None) -> MemoryPlan:
    """Profile (CUDA), read the device's figures, plan the pool; logs the figures. Raises
    ``cache.planner.NoMemoryLeft`` when no pool fits."""
    activation = measure_activation_peak(model, spec, engine)
    gather = decode_gather_bound(gather_slot_bytes(spec), max_model_len, engine.max_batch_size)
    figures = device_figures(str(spec.device), weights_bytes(model))
    plan = plan_memory(max_cache_size, figures, activation, gather, min_pool_bytes=3 * spec.block_bytes)
    for line in plan.lines():
        log.info("%s", line)
    if plan.capped_by:
        log.warning("maxCacheSize capped: %s", plan.capped_by)
    return plan
