"""Serving a prefix-cache trace serially through the real cache manager (``KVCache``): exact hit,
registration and eviction counts. The cache benchmark (``bench.cache.prefix_cache``) reports them
and the tests check them against hand-counted traces and the eviction simulator (``traces``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from confkv_engine.cache.kv_cache import CacheSpec, KVCache, SeqKV

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Replay:
    hit_tokens: int
    prompt_tokens: int
    registered: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def replay(trace: list[list[int]], cache_blocks: int, k: int, block_size: int = BLOCK_SIZE,
           chain_history: bool = True) -> Replay:
    """Serve ``trace`` serially through a real ``KVCache`` holding ``cache_blocks`` K/V block pairs."""
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, block_size=block_size,
                     dtype=torch.float32, device=torch.device("cpu"))
    # chain history on: the engine's default; off: the paper's LRU-K
    cache = KVCache(spec, 2 * cache_blocks + 1, prefix_salt=b"bench", eviction_k=k,
                    chain_history=chain_history)
    registered = 0
    for tokens in trace:
        seq = SeqKV()
        hits = cache.match(tokens, (len(tokens) - 1) // block_size)
        start = cache.attach(seq, hits, len(tokens))
        cache.reserve(seq, len(tokens) - start)
        cache.commit(seq, len(tokens) - start)
        registered += cache.register(seq, tokens)
        cache.free(seq)
    if cache.num_free != cache.num_blocks:
        raise RuntimeError("blocks leaked: the pool is not all free or evictable after the trace")
    return Replay(cache.hits.hit, cache.hits.queried, registered, registered - len(cache.prefix))
