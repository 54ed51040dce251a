"""Drive one sequence through the paged cache with retention, chunk by chunk (no scheduler).

Used by tests (and as a cross-check of the engine path): it is the engine's per-sequence step
without batching: reserve slots, ``begin_step`` with the retention state, forward, ``end_step``,
logits for every row, sampling signal, ``after_step``. Returns the fp32 log-probabilities of every
next token and per-step byte samples for the budget invariant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from confkv_engine.attention.retention import RetentionAttention
from confkv_engine.cache.kv_cache import KVCache, SeqKV
from confkv_engine.model.llama import LlamaForCausalLM
from confkv_engine.retention.manager import RetentionManager
from confkv_engine.retention.policies import RetentionConfig


@dataclass
class OfflineRun:
    logprobs: Tensor  # [N-1] log p(token[i+1] | tokens[:i+1])
    held_bytes: list[int] = field(default_factory=list)  # after each step's retention
    peak_before: list[int] = field(default_factory=list)  # before retention (what the step needed)
    lengths: list[int] = field(default_factory=list)
    free_blocks: list[int] = field(default_factory=list)
    peak_bytes: int = 0


@torch.inference_mode()
def run_sequence(model: LlamaForCausalLM, cache: KVCache, manager: RetentionManager, cfg: RetentionConfig,
                 tokens: list[int], chunk: int) -> OfflineRun:
    backend = RetentionAttention(cache, model.args.num_heads)
    seq, state = SeqKV(), manager.new_state(cfg)
    dev = cache.kv.device
    logps: list[Tensor] = []
    run = OfflineRun(logprobs=torch.empty(0))
    start = 0
    chunk = min(chunk, state.interval) if state is not None else chunk  # as the scheduler cuts them
    try:
        while start < len(tokens):
            n = min(chunk, len(tokens) - start)
            end = start + n
            cache.reserve(seq, n)
            positions = torch.arange(start, end, device=dev)
            backend.begin_step([seq], [n], positions, [state])
            hidden = model(torch.tensor(tokens[start:end], device=dev), positions, backend)
            backend.end_step()
            logits = model.compute_logits(hidden)
            succ = tokens[start + 1:end + 1]
            lp = torch.log_softmax(logits[: len(succ)], -1)
            logps.append(lp.gather(-1, torch.tensor(succ, device=dev)[:, None]).squeeze(-1).cpu())
            if manager.wants_logits(state):
                manager.observe_logits(state, logits, start + 1, succ)
            run.peak_before.append(manager.held_bytes(seq, state))
            manager.after_step(seq, state, end)
            run.held_bytes.append(manager.held_bytes(seq, state))
            run.lengths.append(end)
            run.free_blocks.append(cache.pool.num_free)
            start = end
        run.peak_bytes = max(run.peak_before) if run.peak_before else 0
    finally:
        cache.free(seq)
    run.logprobs = torch.cat(logps) if logps else torch.empty(0)
    return run
