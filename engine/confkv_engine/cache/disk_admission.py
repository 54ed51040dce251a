"""Which evicted blocks deserve the disk tier: a pure rule over a block's uses, and offer memory.

Writing every evicted block wears the SSD for blocks that are never read again (one-shot prompt
tails). The rule admits a block once it has been used ``min_uses`` times, counting the uses the
cache manager reports plus how often the same key was offered before: a block that was evicted,
recomputed by a later request and evicted again has shown it is reused even if each stay in memory
saw one use. ``bench/disk_tier.py`` measures disk hits per byte written for several ``min_uses``.
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
