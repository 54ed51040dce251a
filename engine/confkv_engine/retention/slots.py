"""Capacity-backed storage of a sequence's retention state: per-slot columns and the query ring.

A decode step appends one slot to every unit of every retained sequence; growing the state by
concatenation would copy all of it every step (quadratic in the sequence's length). Here the state
lives in buffers with spare capacity, written in place, and grows geometrically (doubling), so N
appends reallocate O(log N) times and a step with room copies nothing old. Capacity never shrinks:
after a compaction the buffers keep their size (at most twice the most slots the sequence ever
held), so the next appends reuse it.

Why doubling and not one allocation sized from the request's maximum length (prompt + max_tokens):
a budgeted sequence holds far fewer slots than its length (compaction drops the discarded ones), and
the maximum can be tens of thousands of tokens times every (layer, KV head) unit; sizing from what
the sequence actually held keeps the host memory proportional to the budget.

The query ring holds the post-RoPE queries a sequence recorded since its last decision (at most one
decision interval, unless a decision is skipped): one [L, capacity, Hq, D] buffer on the queries'
device, allocated at the first query and filled by device copies (no host synchronisation), grown
like the slots and never beyond the interval unless a step needs more.
"""

from __future__ import annotations

import torch
from torch import Tensor

# The remembered attention peak is a max-hold of a positive ratio read through a saturating map, so
# fp16 holds it well, and the retention metadata it adds to every kept token is counted in the
# budget (``runtime.accounting``): 2 bytes per unit, not 4.
PEAK_DTYPE = torch.float16
PEAK_BYTES = 2


def _grown(capacity: int, need: int, limit: int | None = None) -> int:
    """The next capacity holding ``need``: doubling, clamped at ``limit`` while that suffices."""
    doubled = 2 * capacity
    if limit is not None and capacity < limit:
        doubled = min(doubled, limit)
    return max(need, doubled, 1)


class SlotColumns:
    """Per (layer, KV head) unit and slot: position (int64), tier (int8), attention accumulators
    ``acc``/``norm`` (fp32) and the remembered peak ``peak`` (fp16, ``scorer.update_peak``), as
    [L, Hkv, capacity] host buffers whose first ``size`` columns are the state. The views
    ``pos``/``tiers``/``acc``/``norm``/``peak`` cover exactly those columns (not contiguous once
    capacity exceeds size: ``reshape`` copies, in-place writes reach the buffers)."""

    def __init__(self, num_layers: int, num_kv_heads: int, base: int, capacity: int) -> None:
        self.units = (num_layers, num_kv_heads)
        self.size = 0
        self.reallocations = 0
        self._alloc(max(capacity, base))
        self.size = base
        self._pos[..., :base] = torch.arange(base, dtype=torch.long)

    def _alloc(self, capacity: int) -> None:
        """(Re)allocate every column buffer at ``capacity``, keeping the first ``size`` columns."""
        shape = (*self.units, capacity)
        bufs = (torch.empty(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.int8),
                torch.zeros(shape), torch.zeros(shape), torch.zeros(shape, dtype=PEAK_DTYPE))
        if self.size:
            for new, old in zip(bufs, self._buffers(), strict=True):
                new[..., :self.size] = old[..., :self.size]
        self._pos, self._tiers, self._acc, self._norm, self._peak = bufs
        self.reallocations += 1

    def _buffers(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return self._pos, self._tiers, self._acc, self._norm, self._peak

    @property
    def capacity(self) -> int:
        return self._pos.shape[-1]

    @property
    def pos(self) -> Tensor:
        return self._pos[..., :self.size]

    @property
    def tiers(self) -> Tensor:
        return self._tiers[..., :self.size]

    @property
    def acc(self) -> Tensor:
        return self._acc[..., :self.size]

    @property
    def norm(self) -> Tensor:
        return self._norm[..., :self.size]

    @property
    def peak(self) -> Tensor:
        return self._peak[..., :self.size]

    def append(self, positions: Tensor) -> None:
        """New FULL slots at absolute ``positions`` [T], the same in every unit."""
        t, n = positions.numel(), self.size
        if n + t > self.capacity:
            self._alloc(_grown(self.capacity, n + t))
        self._pos[..., n:n + t] = positions.long()
        self._tiers[..., n:n + t] = 0
        self._acc[..., n:n + t] = 0.0
        self._norm[..., n:n + t] = 0.0
        self._peak[..., n:n + t] = 0.0
        self.size = n + t

    def keep(self, order: Tensor, tiers: Tensor | None = None) -> None:
        """Keep the columns ``order`` [L, Hkv, m] (gather indices, per unit, m <= size), in that
        order; the tiers are gathered from ``tiers`` [L, Hkv, size] (the new ones) when given."""
        cols = (self.pos, self.tiers if tiers is None else tiers, self.acc, self.norm, self.peak)
        kept = [c.gather(-1, order) for c in cols]  # copies first: the sources alias the buffers
        m = order.shape[-1]
        for buf, x in zip(self._buffers(), kept, strict=True):
            buf[..., :m] = x
        self.size = m


class QueryRing:
    """Queries [T, Hq, D] per layer and step, with their positions, until the next decision."""

    def __init__(self, num_layers: int, interval: int) -> None:
        self.num_layers = num_layers
        self.interval = interval  # what the ring normally holds at most (one decision interval)
        self.reallocations = 0
        self._q: Tensor | None = None  # [L, capacity, Hq, D] on the queries' device
        self._fill = [0] * num_layers
        self._pos = torch.empty(0, dtype=torch.long)
        self._npos = 0

    @property
    def capacity(self) -> int:
        return 0 if self._q is None else self._q.shape[1]

    def add_positions(self, positions: Tensor) -> None:
        t = positions.numel()
        if self._npos + t > self._pos.numel():
            grown = torch.empty(_grown(self._pos.numel(), self._npos + t, self.interval), dtype=torch.long)
            grown[:self._npos] = self._pos[:self._npos]
            self._pos = grown
        self._pos[self._npos:self._npos + t] = positions.long()
        self._npos += t

    def add(self, layer: int, q: Tensor) -> None:
        t, f = q.shape[0], self._fill[layer]
        ring = self._q if self._q is not None and f + t <= self._q.shape[1] else self._grow(q, f + t)
        ring[layer, f:f + t].copy_(q.detach())  # a device copy: nothing waits on the host
        self._fill[layer] = f + t

    def _grow(self, q: Tensor, need: int) -> Tensor:
        cap = _grown(self.capacity, need, self.interval)
        grown = torch.empty((self.num_layers, cap, *q.shape[1:]), dtype=q.dtype, device=q.device)
        if self._q is not None:
            keep = max(self._fill)
            grown[:, :keep] = self._q[:, :keep]
        self._q = grown
        self.reallocations += 1
        return grown

    def take(self) -> tuple[list[Tensor], Tensor] | None:
        """The recorded queries (per layer [T, Hq, D], views of the ring, valid until the next
        ``add``: readers consume them in stream order before the next step writes) and positions
        [T]; empties the ring."""
        t = self._npos
        if t == 0:
            return None
        if any(f != t for f in self._fill) or self._q is None:
            raise RuntimeError("query ring out of step with the appended positions")
        out = [self._q[layer, :t] for layer in range(self.num_layers)]
        pos = self._pos[:t].clone()
        self._fill = [0] * self.num_layers
        self._npos = 0
        return out, pos
