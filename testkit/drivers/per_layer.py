"""Drive one sequence with a budget of its own per layer: one paged cache per layer (no scheduler).

The served cache gives every (layer, KV head) the same number of slots, so a layer cannot hold
fewer tokens than another without per-layer block tables. This driver measures what such tables
would buy without building them: each layer gets its own one-layer ``KVCache``, ``RetentionAttention``
and ``RetentionManager`` (its own ``RetentionConfig``, so its own budget fraction), and the model's
``attend(layer, ...)`` is dispatched to that layer's backend. Every layer therefore runs exactly the
engine's retention code (scoring at decision points, tiers, compaction, KEY_ONLY stand-in); the
bytes of the sequence are the sum of the layers' pool bytes. With the same fraction everywhere it
differs from the one-cache engine only in that the shared per-tier counts are rounded per layer and
each layer carries its own copy of the 4-byte sampling confidence per slot.

Per step, as ``offline.run_sequence``: reserve, ``begin_step``, forward, ``end_step``, logits,
sampling signal, ``after_step`` (per layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from confkv_engine.attention.retention import RetentionAttention
from confkv_engine.cache.kv_cache import CacheSpec, KVCache, SeqKV
from confkv_engine.model.llama import LlamaForCausalLM
from confkv_engine.retention.manager import RetentionManager
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.runtime import RetentionState


@dataclass
class PerLayerRun:
    logprobs: Tensor  # [N-1] log p(token[i+1] | tokens[:i+1])
    held_bytes: list[int] = field(default_factory=list)  # all layers, after each step's retention
    peak_bytes: int = 0  # largest sum over layers before retention (what a step needed)
    layer_slots: list[int] = field(default_factory=list)  # slots per layer at the end


class _LayerDispatch:
    """The model's backend: layer ``l`` attends through the ``l``-th one-layer backend."""

    def __init__(self, backends: list[RetentionAttention]) -> None:
        self.backends = backends

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.backends[layer].attend(0, q, k, v)


@dataclass
class _Layer:
    cache: KVCache
    manager: RetentionManager
    backend: RetentionAttention
    cfg: RetentionConfig
    seq: SeqKV
    state: RetentionState | None


def _layers(model: LlamaForCausalLM, cfgs: list[RetentionConfig], max_tokens: int, chunk: int,
            block_size: int, device: torch.device) -> list[_Layer]:
    a = model.args
    if len(cfgs) != a.num_layers:
        raise ValueError(f"need one config per layer ({a.num_layers}), got {len(cfgs)}")
    blocks = 2 * (-(-(max_tokens + chunk) // block_size)) + 4
    out = []
    for cfg in cfgs:
        cache = KVCache(CacheSpec(1, a.num_kv_heads, a.head_dim, block_size, torch.float32, device), blocks)
        manager = RetentionManager(cache, a.num_heads, cfg, chunk)
        out.append(_Layer(cache, manager, RetentionAttention(cache, a.num_heads), cfg, SeqKV(),
                          manager.new_state(cfg)))
    return out


@torch.inference_mode()
def run_sequence_per_layer(model: LlamaForCausalLM, cfgs: list[RetentionConfig], tokens: list[int],
                           chunk: int, block_size: int = 16) -> PerLayerRun:
    """``cfgs[l]`` is layer ``l``'s retention (``policy='full'`` keeps that layer whole)."""
    dev = next(model.parameters()).device
    layers = _layers(model, cfgs, len(tokens), chunk, block_size, dev)
    dispatch = _LayerDispatch([x.backend for x in layers])
    logps: list[Tensor] = []
    run = PerLayerRun(logprobs=torch.empty(0))
    peak, start = 0, 0
    try:
        while start < len(tokens):
            end = min(start + chunk, len(tokens))
            positions = torch.arange(start, end, device=dev)
            for x in layers:
                x.cache.reserve(x.seq, end - start)
                x.backend.begin_step([x.seq], [end - start], positions, [x.state])
            hidden = model(torch.tensor(tokens[start:end], device=dev), positions, dispatch)
            for x in layers:
                x.backend.end_step()
            logits = model.compute_logits(hidden)
            succ = tokens[start + 1:end + 1]
            lp = torch.log_softmax(logits[: len(succ)], -1)
            logps.append(lp.gather(-1, torch.tensor(succ, device=dev)[:, None]).squeeze(-1).cpu())
            peak = max(peak, sum(x.manager.held_bytes(x.seq, x.state) for x in layers))
            for x in layers:
                if x.manager.wants_logits(x.state):
                    x.manager.observe_logits(x.state, logits, start + 1, succ)
                x.manager.after_step(x.seq, x.state, end)
            run.held_bytes.append(sum(x.manager.held_bytes(x.seq, x.state) for x in layers))
            start = end
        run.layer_slots = [x.seq.num_slots for x in layers]
    finally:
        for x in layers:
            x.cache.free(x.seq)
    run.peak_bytes = peak
    run.logprobs = torch.cat(logps) if logps else torch.empty(0)
    return run
