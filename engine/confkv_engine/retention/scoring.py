"""Attention signal at decision points: fold the queries a sequence recorded into its accumulators.

See ``attention.retention`` for why recomputing ``softmax(q K^T)`` for the recorded queries against the
cached keys at a decision point equals scoring at every step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

from confkv_engine.cache.kv_cache import KVCache, SeqKV
from confkv_engine.retention import native_mass, scorer
from confkv_engine.retention.runtime import RetentionState


def score_pending(cache: KVCache, seq: SeqKV, state: RetentionState) -> None:
    """Fold the queries recorded since the last decision into ``state``'s accumulators (see the
    module docstring for why this equals scoring every step). Call before the policy decides."""
    score_batch(cache, [(seq, state)])


def score_batch(cache: KVCache, items: list[tuple[SeqKV, RetentionState]]) -> None:
    """``score_pending`` for every sequence of a decision step at once. On a CPU with the native
    library, each chunk of scores is folded where it is computed (``native_mass``: one pass per score
    row); otherwise each sequence's probabilities, every layer's, are queued into pinned host buffers
    without waiting, then the host waits once for the whole step (not once per sequence) and folds them."""
    native = native_mass.applies(cache.kv.device)
    queued = []
    for seq, state in items:
        if native and state.layers_agree:
            _fold_native(cache, seq, state)
        elif (q := _queue(cache, seq, state)) is not None:
            queued.append(q)
    if not queued:
        return
    host_copies_done(cache.kv.device)
    for state, host, q_pos in queued:
        state.on_attention_layers(host, q_pos)


# Layers scored together are read (decoded) in one call and their scores share one buffer: per-layer
# calls cost more than a layer's arithmetic on a CPU, while all layers at once overflow the caches
# (a fresh 40 MB of scores measured slower than 30 one-layer passes). About 3 layers of SmolLM2 at 2k.
CHUNK_BYTES = 8 << 20


def _score_chunks(cache: KVCache, seq: SeqKV, state: RetentionState, queries: list[Tensor]
                  ) -> Iterator[tuple[range, Tensor]]:
    """The recorded queries' scaled scores [l * Hkv, G * T, n] against the cached keys, a few layers
    at a time (``CHUNK_BYTES``; one buffer, reused: consume each chunk before the next)."""
    spec = cache.spec
    hkv, d, g, n, t = spec.num_kv_heads, spec.head_dim, state.group, state.num_slots, queries[0].shape[0]
    plan = cache.gather_plan(seq.k_blocks[: -(-n // spec.block_size)])  # compressed keys decode on read
    step = max(1, CHUNK_BYTES // (4 * hkv * n * (g * t + d)))
    scores = torch.empty((min(step, len(queries)) * hkv, g * t, n), device=cache.kv.device)
    for first in range(0, len(queries), step):
        layers = range(first, min(first + step, len(queries)))
        keys = cache.read_keys_transposed(seq.k_blocks, layers, n, plan)  # [l, Hkv, D, n]
        q = torch.stack(queries[layers.start:layers.stop])  # [l, T, Hq, D]
        yield layers, scaled_scores(q, keys, scores[: len(layers) * hkv])


def _fold_native(cache: KVCache, seq: SeqKV, state: RetentionState) -> None:
    """Score one sequence's recorded queries and fold them, each chunk of layers reduced to per-key
    sums by ``native_mass`` as soon as its scores exist (CPU)."""
    recorded = state.take_queries()
    if recorded is None:
        return
    queries, q_pos = recorded
    q_pos = q_pos.long()
    weights = scorer.query_weights(q_pos, state.cfg.decay)
    n, parts = state.num_slots, []
    for layers, scores in _score_chunks(cache, seq, state, queries):
        key_pos = state.pos[layers.start:layers.stop].reshape(-1, n)
        parts.append(native_mass.attention_mass(scores, state.group, key_pos, q_pos, weights,
                                                state.peak_filter))
    shape = state.pos.shape

    def whole(field: str) -> Tensor | None:
        got = [getattr(p, field) for p in parts]
        return None if got[0] is None else torch.cat(got).view(shape)

    fields = ("mass", "seen", "peak_sum", "peak_count")
    state.on_attention_mass(scorer.AttentionMass(*(whole(f) for f in fields)), q_pos)


def _queue(cache: KVCache, seq: SeqKV, state: RetentionState) -> tuple[RetentionState, Tensor, Tensor] | None:
    """Queue one sequence's attention probabilities [L, Hkv, T, n] into a host buffer (pinned on
    CUDA, copies not waited for); None when it recorded no queries."""
    recorded = state.take_queries()
    if recorded is None:
        return None
    queries, q_pos = recorded  # per layer [T, Hq, D]; [T]
    hkv, n, t, dev = cache.spec.num_kv_heads, state.num_slots, q_pos.numel(), cache.kv.device
    first_hidden = _first_hidden(state.pos, q_pos)  # on the host, as the state: no device read
    pos, q_dev = state.pos[..., first_hidden:].to(dev), q_pos.to(dev)
    hidden = pos[:, :, None, :] > q_dev[None, None, :, None]  # [L, Hkv, T, n - first_hidden]
    host = torch.empty((len(queries), hkv, t, n), pin_memory=dev.type == "cuda")
    for layers, scores in _score_chunks(cache, seq, state, queries):
        probs = softmax_probs(scores, hkv, t, hidden[layers.start:layers.stop], first_hidden)
        host[layers.start:layers.stop].copy_(probs, non_blocking=True)
    return state, host, q_pos


def _first_hidden(pos: Tensor, q_pos: Tensor) -> int:
    """The first slot some recorded query must not see (one at a later position than the first query;
    slots hold ascending positions past the frozen blocks, so only the last few qualify); n if none."""
    late = (pos > q_pos[0]).flatten(0, 1).any(0).nonzero()
    return int(late[0]) if late.numel() else pos.shape[-1]


def scaled_scores(q: Tensor, keys: Tensor, out: Tensor) -> Tensor:
    """q K^T / sqrt(D) per KV head, rows by query head then query: q [l, T, Hq, D], keys [l, Hkv, D, n]
    (K^T), out [l * Hkv, G * T, n] fp32 scratch (row g * T + i: query i through query head g)."""
    nl, t, hq, d = q.shape
    hkv, n = keys.shape[1], keys.shape[3]
    g = hq // hkv
    qg = (q.float() / math.sqrt(d)).view(nl, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(nl * hkv, g * t, d)
    return torch.bmm(qg, keys.float().reshape(nl * hkv, d, n), out=out)


def softmax_probs(scores: Tensor, hkv: int, t: int, hidden: Tensor, first_hidden: int) -> Tensor:
    """Softmax of ``scaled_scores`` [l * Hkv, G * T, n] in place over the keys each query sees, summed
    over each KV head's query heads -> [l, Hkv, T, n]. hidden [l, Hkv, T, n - first_hidden] bool: the
    keys from slot ``first_hidden`` on that each query must not see."""
    n = scores.shape[-1]
    nl, g = scores.shape[0] // hkv, scores.shape[1] // t
    scores.view(nl, hkv, g, t, n)[..., first_hidden:].masked_fill_(hidden[:, :, None], float("-inf"))
    scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # the softmax in place: no second [l*Hkv, G*T, n]
    scores.div_(scores.sum(-1, keepdim=True))
    return scores.view(nl, hkv, g, t, n).sum(2)


def attention_probs(q: Tensor, keys: Tensor, hidden: Tensor, first_hidden: int, out: Tensor) -> Tensor:
    """softmax(q K^T / sqrt(D)) summed over each KV head's query heads, hidden keys left out.

    q [l, T, Hq, D], keys [l, Hkv, D, n] (K^T), hidden [l, Hkv, T, n - first_hidden] bool (the keys from
    slot ``first_hidden`` on that each query must not see), out [l * Hkv, G * T, n] fp32 scratch
    -> [l, Hkv, T, n] fp32."""
    return softmax_probs(scaled_scores(q, keys, out), keys.shape[1], q.shape[1], hidden, first_hidden)


def host_copies_done(device: torch.device) -> None:
    """Wait for the queued device-to-host copies (a no-op on CPU, where copies are synchronous): the
    decision's one synchronisation with the host."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
