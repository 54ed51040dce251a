"""LRU-K eviction order for unreferenced cached prefix blocks (O'Neil, O'Neil and Weikum, 1993).

Pure bookkeeping over hashable keys (block hashes): no tensors, no pool. The cache manager owns the
blocks and tells this object what happens to them, with a logical clock ``now`` it advances once per
prefix lookup:

- ``touch(key, now, parent)``: a reference (a lookup hit on the block, or the block being computed
  and registered; ``parent``: the key of the block before it in its chain). Recorded in the key's
  history.
- ``release(key)``: the block's reference count fell to zero; it becomes evictable, with a priority
  fixed from its history at that moment (like vLLM v1's BlockPool, which appends freed cached blocks
  to an eviction-ordered free queue, but ordered by LRU-K instead of LRU).
- ``acquire(key)``: a hit on an evictable block; it is in use again and cannot be evicted.
- ``victim()``: pops the evictable key to evict; the caller frees its block and then calls
  ``forget(key)``, which moves the history to the retained-history table (the paper's *retained
  information period*, bounded by a count here) so that a block that comes back remembers its
  past references instead of starting cold.

Priority (SGLang-style: one function of a key's history, smallest evicted first):

- Backward K-distance: the victim is the block whose K-th most recent reference is oldest. Blocks
  with fewer than K references have infinite distance and go first; among those, and between equal
  K-th times, the least recent last reference goes first (the paper's subsidiary LRU), then the
  earlier ``release`` (callers release a request's blocks last-to-first, as vLLM does, so the tail
  of a chain, useless without its head, is evicted before the head). K=1 with no correlated period
is therefore exactly LRU (vLLM's free queue: appended on release, evicted from the head).
- Correlated references (the paper's rule): a reference within ``correlated_period`` ticks of the
  key's last reference only moves its last-reference time. An uncorrelated one shifts the history
  forward by the length of the correlated burst that just ended (LAST - HIST(1)), so a burst counts
  as one reference at its start, and records ``now`` as HIST(1). A reference at the same tick as
  the previous one is always correlated (``now - last > correlated_period`` fails), so one lookup
  that touches a block twice counts once. The paper also makes a page inside its correlated period
  ineligible for replacement; here a block in use is simply not evictable (the reference count
  does that job), so no eligibility clock is needed at ``victim`` time.
- A reference to a key that is not resident (new, or evicted and remembered) is always a new
  reference: the remembered history shifts by one, as in the paper's miss path.
- Chain history (an addition to the paper, for a prefix tree): a block with no history at all (new,
  nothing retained) whose parent has history inherits the parent's older references, each moved
  back in proportion to how many children the parent has had: HIST(key, i) = now - c * (now -
  HIST(parent, i)) for i >= 2, c counting this child. HIST(key, 1) is ``now``, so K=1 stays exactly
  LRU. Why: a child can only ever be hit together with its whole prefix, so its reference rate is at
  most its parent's, split among the parent's children. Plain LRU-K gives every new block one
  reference, which under K >= 2 puts the newest turn of a live chat (its parent: the end of the
  previous turn, one child, hit a turn ago) in the same first-to-go class as the blocks of a one-off
  long prompt (no parent: nothing hit); the chat's next turn then recomputes it. With chain history
  the new turn starts with the conversation's own backward distance; a question appended to a hot
  system prompt (hundreds of children) gets a far older one and still goes soon after the scans.
  A parent's history only ever moves back for its children, so a new child never outranks its
  parent and a chain is evicted from its tail (vLLM frees a request's blocks last-to-first for the
  same reason). Measured with the simulator in ``testkit/traces.py`` on tuning seeds 7 and 8 of the
  scan-polluted trace at 1,024 blocks: LRU-2 +3.3 / +4.8 points of token hit rate over LRU without
  it, +6.1 / +7.3 with it, and on the chat-heavy trace -7.3 / -8.2 without, -1.2 / -0.8 with.
  Reported seeds 0 / 1 / 2 (not used for the choice; ``bench/cache/prefix_cache.py``, the real cache
  manager): +5.0 / +4.0 / +5.5 without, +7.1 / +7.1 / +7.9 with (the target is +8).
  Tried there and not kept (within 0.3 points of chain history alone, or worse): inheriting without
  the 1/c split (+4.5 on seed 7: questions on hot prompts are kept like the prompt), a Laplace
  estimate of the share of re-used children, a correlated period of 1-200 ticks (also with the
  clock in block accesses), references expiring after a retained information period of 300-1000
  ticks, and demoting blocks unused for 30-250 ticks (or 2-8 times their last interarrival) to the
  once-seen class. Dropping retained history costs 7-8 points (re-admitted hot prefixes start cold).
  What is left (measured on seed 7): the blocks of a finished chat look exactly like a live chat's
  until they age out, and the cache holds about 385 such dead chat blocks of 1,024 on average; a
  Belady oracle (evict the block used again last) holds 79 and is 14.7 points over LRU.

History depth is ``max_k`` (>= k) so ``set_k`` can raise K live and immediately use references
recorded before the change; ``set_k`` re-prioritises the evictable set in O(n log n). Everything
else is O(log n) amortised: a binary heap with lazy deletion (a stale entry is skipped when popped;
the heap is rebuilt when stale entries outnumber live ones).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field

DEFAULT_MAX_K = 8
DEFAULT_RETAINED_HISTORY = 4096

Priority = tuple[int, int, int, int]


@dataclass
class _History:
    """HIST(key, 1..max_k), most recent first, and LAST(key)."""

    refs: list[int] = field(default_factory=list)
    last: int = 0
    uses: int = 1  # own uncorrelated references (inherited ones excluded)
    children: int = 0  # new blocks that took this one as their chain parent


class LRUK:
    """LRU-K order over evictable keys, with retained history for evicted ones.

    ``k``: the K of LRU-K (1 = LRU). ``correlated_period``: ticks within which a repeated reference
    is correlated (0: only a repeat at the same tick). ``retained_history``: how many evicted keys'
    histories are remembered (oldest last reference dropped first; 0 = none). ``max_k``: history
    depth, the largest K ``set_k`` accepts. ``chain_history``: new blocks inherit their parent's
    older references (module doc); False is the paper's LRU-K exactly.
    """

    def __init__(self, k: int = 2, correlated_period: int = 0,
                 retained_history: int = DEFAULT_RETAINED_HISTORY, max_k: int = DEFAULT_MAX_K,
                 chain_history: bool = True) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        if correlated_period < 0:
            raise ValueError(f"correlated_period must be >= 0 ticks, got {correlated_period}")
        if retained_history < 0:
            raise ValueError(f"retained_history must be >= 0 entries, got {retained_history}")
        self.max_k = max_k
        self.k = self._checked_k(k)
        self.correlated_period = correlated_period
        self.retained_history = retained_history
        self.chain_history = chain_history
        self._hist: dict[Hashable, _History] = {}  # resident keys (cached blocks)
        self._retained: dict[Hashable, tuple[_History, int]] = {}  # evicted keys -> (history, stamp)
        self._retained_heap: list[tuple[int, int, Hashable]] = []  # (last, stamp, key), lazy
        self._evictable: dict[Hashable, int] = {}  # key -> stamp of its live heap entry
        self._heap: list[tuple[Priority, Hashable]] = []  # (priority incl. stamp, key), lazy
        self._stamp = itertools.count()

    # ----------------------------------------------------------------- configuration

    def _checked_k(self, k: int) -> int:
        if not 1 <= k <= self.max_k:
            raise ValueError(f"k must be between 1 and max_k={self.max_k}, got {k}")
        return k

    def set_k(self, k: int) -> None:
        """Change K live: every entry and all history stay; the evictable set is re-prioritised.

        The relative order of keys with equal priority (release order) is kept.
        """
        self.k = self._checked_k(k)
        live = sorted(self._evictable.items(), key=lambda item: item[1])
        self._heap = [(self._priority(key, stamp), key) for key, stamp in live]
        heapq.heapify(self._heap)

    # ----------------------------------------------------------------- references

    def touch(self, key: Hashable, now: int, parent: Hashable | None = None) -> None:
        """Record a reference to ``key`` at logical time ``now`` (non-decreasing across calls).

        ``parent``: the key of the block before ``key`` in its chain (None for a chain's first block);
        it matters only for a key with no history, which then inherits the parent's (module doc).
        """
        hist = self._hist.get(key)
        if hist is None:
            hist = self._readmit(key, now, parent)
        elif now < hist.last:
            raise ValueError(f"time went backwards for {key!r}: {now} < last reference {hist.last}")
        elif now - hist.last > self.correlated_period:
            burst = hist.last - hist.refs[0]
            hist.refs = [now] + [t + burst for t in hist.refs[: self.max_k - 1]]
            hist.last = now
            hist.uses += 1
        else:
            hist.last = now  # correlated: part of the burst that started at HIST(1)
        if key in self._evictable:
            self._push(key)

    def _readmit(self, key: Hashable, now: int, parent: Hashable | None) -> _History:
        entry = self._retained.pop(key, None)
        if entry is None:
            hist = _History(refs=[now, *self._inherited(parent, now)], last=now)
        else:
            hist = entry[0]
            hist.refs = [now] + hist.refs[: self.max_k - 1]
            hist.last = now
            hist.uses += 1
        self._hist[key] = hist
        return hist

    def _inherited(self, parent: Hashable | None, now: int) -> list[int]:
        """The older references a new child of ``parent`` takes: HIST(parent, 2..) moved back by the
        parent's number of children (the child's share of the parent's references)."""
        hist = self._hist.get(parent) if self.chain_history and parent is not None else None
        if hist is None:
            return []
        hist.children += 1
        return [now - hist.children * (now - t) for t in hist.refs[1:self.max_k]]

    def uses(self, key: Hashable) -> int:
        """How many uncorrelated references ``key`` has had itself (inherited ones do not count);
        0 if unknown. The disk store's admission rule counts these."""
        hist = self._hist.get(key)
        if hist is None:
            entry = self._retained.get(key)
            hist = entry[0] if entry is not None else None
        return hist.uses if hist is not None else 0

    def history(self, key: Hashable) -> tuple[int, ...]:
        """HIST(key, 1..) most recent first, resident or retained; () if unknown (tests, metrics)."""
        hist = self._hist.get(key)
        if hist is None:
            entry = self._retained.get(key)
            hist = entry[0] if entry is not None else None
        return tuple(hist.refs) if hist is not None else ()

    # ----------------------------------------------------------------- evictable set

    def release(self, key: Hashable) -> None:
        """``key``'s block is unreferenced: it may be evicted, in the order its history gives now."""
        if key not in self._hist:
            raise KeyError(f"release of {key!r}, which was never touched (or was forgotten)")
        if key in self._evictable:
            raise ValueError(f"{key!r} released twice")
        self._push(key)

    def acquire(self, key: Hashable) -> bool:
        """A hit on ``key``: it is no longer evictable. Returns whether it was evictable."""
        return self._evictable.pop(key, None) is not None

    def victim(self) -> Hashable | None:
        """Pop and return the evictable key to evict next (None if none is evictable).

        The key's history stays resident until ``forget``; call it once the block is freed.
        """
        while self._heap:
            (_, _, _, stamp), key = heapq.heappop(self._heap)
            if self._evictable.get(key) == stamp:
                del self._evictable[key]
                return key
        return None

    def forget(self, key: Hashable) -> None:
        """``key``'s block left the cache: keep its history in the bounded retained table."""
        self._evictable.pop(key, None)
        hist = self._hist.pop(key, None)
        if hist is None or self.retained_history == 0:
            return
        stamp = next(self._stamp)
        self._retained[key] = (hist, stamp)
        heapq.heappush(self._retained_heap, (hist.last, stamp, key))
        while len(self._retained) > self.retained_history:
            _, old_stamp, old_key = heapq.heappop(self._retained_heap)
            entry = self._retained.get(old_key)
            if entry is not None and entry[1] == old_stamp:
                del self._retained[old_key]
        if len(self._retained_heap) > 2 * len(self._retained) + 16:
            self._retained_heap = [(h.last, s, k) for k, (h, s) in self._retained.items()]
            heapq.heapify(self._retained_heap)

    def __len__(self) -> int:
        return len(self._evictable)

    def __contains__(self, key: object) -> bool:
        return key in self._evictable

    @property
    def num_retained(self) -> int:
        return len(self._retained)

    def evictable(self) -> list[Hashable]:
        """The evictable keys in eviction order, first victim first (tests and debugging)."""
        live = [(self._priority(key, stamp), key) for key, stamp in self._evictable.items()]
        return [key for _, key in sorted(live, key=lambda entry: entry[0])]

    # ----------------------------------------------------------------- internals

    def _priority(self, key: Hashable, stamp: int) -> Priority:
        """Smallest first: (has K references, HIST(K), LAST, release stamp)."""
        hist = self._hist[key]
        if len(hist.refs) < self.k:
            return (0, 0, hist.last, stamp)
        return (1, hist.refs[self.k - 1], hist.last, stamp)

    def _push(self, key: Hashable) -> None:
        stamp = next(self._stamp)
        self._evictable[key] = stamp
        heapq.heappush(self._heap, (self._priority(key, stamp), key))
        if len(self._heap) > 2 * len(self._evictable) + 16:
            self._heap = [(self._priority(k, s), k) for k, s in self._evictable.items()]
            heapq.heapify(self._heap)
