"""Disk store policy: which evicted blocks deserve the disk, and which chains are hot for warm-up.

Writing every evicted block wears the SSD for blocks that are never read again (one-shot prompt
tails). The rule admits a block once it has been used ``min_uses`` times, counting the uses the
cache manager reports plus how often the same key was offered before: a block that was evicted,
recomputed by a later request and evicted again has shown it is reused even if each stay in memory
saw one use. ``bench/cache/disk_store.py`` measures disk hits per block written for several ``min_uses``:
on its Zipf prefix workload, ``min_uses=2`` wrote 7x fewer blocks than admitting everything (392 vs
2768) and kept three quarters of the disk hits (408 vs 544); ``min_uses=3`` halved writes again
but lost another third of the hits. Hence the default of 2.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable

OFFER_MEMORY = 65536  # keys whose earlier offers are remembered (bounded, in memory only)


def admit_reused(uses: int, min_uses: int = 2) -> bool:
    """The admission rule: a block goes to disk once it has been used ``min_uses`` times (0/1: all)."""
    return uses >= min_uses


AdmissionRule = Callable[[int], bool]
DEFAULT_ADMISSION: AdmissionRule = functools.partial(admit_reused, min_uses=2)


class OfferMemory:
    """How many times each recently declined key was offered (LRU-bounded)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def bump(self, key: bytes) -> int:
        """Count one more offer of ``key``; returns the offers before this one."""
        before = self._counts.pop(key, 0)
        self._counts[key] = before + 1
        if len(self._counts) > self._size:
            self._counts.popitem(last=False)
        return before

    def forget(self, key: bytes) -> None:
        self._counts.pop(key, None)


def _chain(key: bytes, nodes: dict[bytes, tuple[bytes | None, int, int]]) -> list[bytes]:
    chain = [key]
    while (parent := nodes[chain[-1]][0]) is not None:
        chain.append(parent)
    return chain[::-1]


def select_hot_chains(nodes: dict[bytes, tuple[bytes | None, int, int]], n: int) -> list[list[bytes]]:
    """Up to ``n`` chains (root first) to prefill, from ``nodes[key] = (parent, depth, hits)``.

    A chain ending at a block is worth ``hits x depth`` (prompt blocks its hits would have saved);
    chains are taken best first, a chain that is a prefix of a chosen one adds nothing and is
    skipped, and a chain that extends a chosen one replaces it (prefilling it caches both). Every
    node's parent must be in ``nodes`` (only rooted chains are given). Blocks never hit are not hot.
    """
    order = sorted((k for k, (_p, _d, hits) in nodes.items() if hits > 0),
                   key=lambda k: (-nodes[k][2] * nodes[k][1], -nodes[k][1], k))
    chosen: list[list[bytes]] = []
    covered: set[bytes] = set()  # every block on a chosen chain
    for key in order:
        if key in covered:
            continue
        chain = _chain(key, nodes)
        extended = [i for i, c in enumerate(chosen) if c[-1] in set(chain)]
        if extended:
            chosen[extended[0]] = chain
        elif len(chosen) < n:
            chosen.append(chain)
        else:
            continue
        covered.update(chain)
    return chosen
