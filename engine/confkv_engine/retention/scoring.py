"""Attention signal at decision points: fold the queries a sequence recorded into its accumulators.

See ``attention.retention`` for why recomputing ``softmax(q K^T)`` for the recorded queries against the
cached keys at a decision point equals scoring at every step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from confkv_engine.cache.kv_cache import KVCache, SeqKV
from confkv_engine.retention.runtime import RetentionState


def score_pending(cache: KVCache, seq: SeqKV, state: RetentionState) -> None:
    """Fold the queries recorded since the last decision into ``state``'s accumulators (see the
    module docstring for why this equals scoring every step). Call before the policy decides."""
    score_batch(cache, [(seq, state)])


def score_batch(cache: KVCache, items: list[tuple[SeqKV, RetentionState]]) -> None:
    """``score_pending`` for every sequence of a decision step at once: each one's probabilities,
    every layer's, are queued into pinned host buffers without waiting, then the host waits once for
    the whole step (not once per sequence) and folds them."""
    queued = [q for q in (_queue(cache, seq, state) for seq, state in items) if q is not None]
    if not queued:
        return
    host_copies_done(cache.kv.device)
    for state, host, q_pos in queued:
        for layer in range(host.shape[0]):
            state.on_attention(layer, host[layer], q_pos)


def _queue(cache: KVCache, seq: SeqKV, state: RetentionState) -> tuple[RetentionState, Tensor, Tensor] | None:
    """Queue one sequence's attention probabilities [L, Hkv, T, n] into a host buffer (pinned on
    CUDA, copies not waited for); None when it recorded no queries."""
    recorded = state.take_queries()
    if recorded is None:
        return None
    queries, q_pos = recorded  # per layer [T, Hq, D]; [T]
    spec, dev = cache.spec, cache.kv.device
    hkv, d, g, n, t = spec.num_kv_heads, spec.head_dim, state.group, state.num_slots, q_pos.numel()
    plan = cache.gather_plan(seq.k_blocks[: -(-n // spec.block_size)])  # compressed keys decode on read
    hidden = state.pos.to(dev)[:, :, None, :] > q_pos.to(dev)[None, None, :, None]  # [L, Hkv, T, n]
    host = torch.empty((len(queries), hkv, t, n), pin_memory=dev.type == "cuda")
    for layer, q in enumerate(queries):
        keys = cache.read_table(seq.k_blocks, layer, n, plan).transpose(0, 1).float()  # [Hkv, n, D]
        qg = q.float().view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * t, d)
        scores = torch.bmm(qg, keys.transpose(1, 2)).view(hkv, g, t, n) / math.sqrt(d)
        probs = scores.masked_fill(hidden[layer][:, None], float("-inf")).softmax(-1).sum(1)  # [Hkv, T, n]
        host[layer].copy_(probs, non_blocking=True)
    return state, host, q_pos


def host_copies_done(device: torch.device) -> None:
    """Wait for the queued device-to-host copies (a no-op on CPU, where copies are synchronous): the
    decision's one synchronisation with the host."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
