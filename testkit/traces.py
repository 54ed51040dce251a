"""Prefix-cache traces and a block-level simulator to compare eviction policies quickly.

``python -m bench.cache.prefix_sim`` prints the token hit rate of LRU, LRU-2 and LRU-3 on three seeded
traces at three cache sizes (and an unbounded cache, the trace's ceiling), and writes
``bench/results/cache/prefix_cache_sim.json``; the cache-manager replay (``prefix_replay``) and the
tests use the same traces.

Traces (a trace is a list of requests, a request a list of token ids; all seeded, so deterministic):

- **Hot prefixes**: system prompts / few-shot headers of a few hundred tokens, drawn with Zipf
  popularity. Single-shot requests are one of them plus a short unique question.
- **Multi-turn chats**: a session starts from a hot prefix; every turn re-sends the conversation so
  far (earlier user turns and assistant replies) plus a new user message. Replies are not in the
  previous prompt, so (as in a server that does not cache generated blocks) they miss once.
- **Scans** (``scan-polluted``, and ``api+scans`` with fewer chats): now and then a burst of
  one-off long prompts (documents to summarise, RAG contexts) that share nothing with anything.

Simulator (``simulate``): serial requests, full blocks only. Block i of a request has the chained
key hash((key of block i-1, its tokens)), as vLLM and SGLang hash prefixes, so a block is reusable
only with its whole prefix. A request's hit is its longest prefix of cached blocks; like vLLM, the
last prompt token is always recomputed, so a fully cached prompt hits ``len - 1`` tokens. Missing
blocks are inserted, evicting with the policy when the cache is full; when a request's blocks
alone fill the cache, the rest of it is not cached. At the end of the request its blocks are
released last-to-first. The clock ticks once per request (one prefix lookup).

Reading the table: "LRU-2 paper" is the paper's LRU-K, where every new block has one reference:
it keeps blocks seen once (scans, but also the newest turn of every chat) only while no block seen
twice is evictable, so a one-off burst cannot flush the hot set, but a chat's newest turn is usually
evicted before the session's next turn and recomputed once. LRU-2 / LRU-3 add chain history (a new
block inherits its parent's older references, split among the parent's children; see
``confkv_engine.cache.eviction``), so the next turn of a chat that was just hit starts with the
conversation's history while a scan, which hit nothing, still starts cold. Which effect wins
depends on the mix of chats and scans, which is why several mixes are reported.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from confkv_engine.cache.eviction import LRUK

VOCAB = 49152  # SmolLM2's vocabulary size; ids are random, only equality matters


class EvictionPolicy(Protocol):
    def touch(self, key: Hashable, now: int, parent: Hashable | None = None) -> None: ...
    def release(self, key: Hashable) -> None: ...
    def acquire(self, key: Hashable) -> bool: ...
    def victim(self) -> Hashable | None: ...
    def forget(self, key: Hashable) -> None: ...


@dataclass(frozen=True)
class TraceConfig:
    requests: int = 3000
    prefixes: int = 32  # distinct hot system prompts / few-shot headers
    prefix_tokens: tuple[int, int] = (150, 600)
    zipf_s: float = 1.0  # popularity of prefix rank r is proportional to 1 / r**s
    chat_share: float = 0.6  # of non-scan requests, the share that are chat turns
    active_chats: int = 12  # sessions open at once; a turn picks one at random
    chat_turns: tuple[int, int] = (2, 8)
    user_tokens: tuple[int, int] = (15, 120)
    reply_tokens: tuple[int, int] = (40, 300)
    question_tokens: tuple[int, int] = (10, 150)
    scan_burst_prob: float = 0.0  # per request, the chance that a burst of scans starts here
    scan_burst_len: tuple[int, int] = (1, 10)
    scan_tokens: tuple[int, int] = (1000, 4000)


TRACES: dict[str, TraceConfig] = {
    "chat+prefixes": TraceConfig(),
    "scan-polluted": TraceConfig(chat_share=0.45, scan_burst_prob=0.02, scan_burst_len=(1, 10)),
    "api+scans": TraceConfig(chat_share=0.25, scan_burst_prob=0.02, scan_burst_len=(1, 10)),
}


def _tokens(rng: random.Random, span: tuple[int, int]) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(rng.randint(*span))]


def make_trace(cfg: TraceConfig, seed: int = 0) -> list[list[int]]:
    """A deterministic trace of ``cfg.requests`` prompts (scan bursts count towards the total)."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, cfg.prefix_tokens) for _ in range(cfg.prefixes)]
    weights = [1.0 / (rank + 1) ** cfg.zipf_s for rank in range(cfg.prefixes)]
    chats: list[tuple[list[int], int]] = []  # (conversation so far, turns left)
    trace: list[list[int]] = []
    while len(trace) < cfg.requests:
        if rng.random() < cfg.scan_burst_prob:
            for _ in range(rng.randint(*cfg.scan_burst_len)):
                trace.append(_tokens(rng, cfg.scan_tokens))
            continue
        prefix = rng.choices(prefixes, weights)[0]
        if rng.random() >= cfg.chat_share:
            trace.append(prefix + _tokens(rng, cfg.question_tokens))
            continue
        if len(chats) < cfg.active_chats:
            chats.append((list(prefix), rng.randint(*cfg.chat_turns)))
        i = rng.randrange(len(chats))
        conversation, turns_left = chats[i]
        conversation += _tokens(rng, cfg.user_tokens)
        trace.append(list(conversation))
        conversation += _tokens(rng, cfg.reply_tokens)
        if turns_left <= 1:
            chats.pop(i)
        else:
            chats[i] = (conversation, turns_left - 1)
    return trace[: cfg.requests]


def block_keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``tokens``."""
    keys: list[int] = []
    prev = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = hash((prev, tuple(tokens[start:start + block_size])))
        keys.append(prev)
    return keys


@dataclass(frozen=True)
class SimResult:
    hit_tokens: int
    prompt_tokens: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _PrefixCache:
    """The cached keys, a capacity in blocks and the eviction policy."""

    def __init__(self, capacity: int, policy: EvictionPolicy) -> None:
        self.capacity = capacity
        self.policy = policy
        self.cached: set[Hashable] = set()
        self.evictions = 0

    def insert(self, key: Hashable) -> bool:
        """Make room for ``key`` (evicting one block if full); False if every block is pinned."""
        if len(self.cached) >= self.capacity:
            victim = self.policy.victim()
            if victim is None:
                return False
            self.cached.discard(victim)
            self.policy.forget(victim)
            self.evictions += 1
        self.cached.add(key)
        return True

    def serve(self, keys: list[int], now: int) -> int:
        """One request: pin its cached prefix, insert the rest, release all; returns hit blocks."""
        hits = 0
        while hits < len(keys) and keys[hits] in self.cached:
            hits += 1
        pinned: list[int] = []
        for key in keys:
            if key in self.cached:
                self.policy.acquire(key)
            elif not self.insert(key):
                break  # the request alone fills the cache: the rest of its chain is not cached
            self.policy.touch(key, now, pinned[-1] if pinned else None)
            pinned.append(key)
        for key in reversed(pinned):
            self.policy.release(key)
        return hits


def simulate(trace: Sequence[Sequence[int]], capacity_blocks: int,
             policy_factory: Callable[[], EvictionPolicy], block_size: int = 16) -> SimResult:
    """Replay ``trace`` through a prefix cache of ``capacity_blocks`` blocks (see module doc)."""
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    cache = _PrefixCache(capacity_blocks, policy_factory())
    hit_tokens = prompt_tokens = 0
    for now, tokens in enumerate(trace):
        hits = cache.serve(block_keys(tokens, block_size), now)
        prompt_tokens += len(tokens)
        hit_tokens += min(hits * block_size, max(len(tokens) - 1, 0))
    return SimResult(hit_tokens, prompt_tokens, cache.evictions)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "LRU": lambda: LRUK(k=1),
    "LRU-2 paper": lambda: LRUK(k=2, chain_history=False),
    "LRU-2": lambda: LRUK(k=2),
    "LRU-3": lambda: LRUK(k=3),
}
CACHE_BLOCKS = (512, 1024, 2048)
