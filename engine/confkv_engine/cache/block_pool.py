"""Fixed pool of KV blocks: free list, reference counts, exact block ids (vLLM v1 BlockPool style).

This is mechanism only: it knows nothing about tensors, sequences or layers. A block id is an index
into the cache tensors of ``kv_cache.KVCache``; whether a block holds keys or values is decided by
the table it is placed in (K blocks and V blocks come from this one pool, so freeing a token's V
returns memory usable for anything).

Order is deterministic so tests (and the eviction work that builds on it) can assert exact ids:
``allocate`` pops from the head of the free queue; a block whose reference count drops to zero is
appended to the tail, in the order given to ``free``. Initially the queue is ``0, 1, ..., n-1``;
``grow`` appends the new ids ``n, n+1, ...`` to its tail (existing ids and counts never change).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


def is_compressed(block: int) -> bool:
    """A table entry's kind: True for a compressed-block handle (``arena``), False for a pool block
    id (the null block included). Handles are negative; this is the only place that says so."""
    return block < 0


class NoFreeBlocks(RuntimeError):
    """Raised by ``allocate`` when the pool cannot satisfy a request (nothing is allocated then)."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._gen = [0] * num_blocks  # allocations of each id so far (``generation``)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use (0..1)."""
        return self.num_used / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue, each with reference count 1."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self._ref[b] = 1
            self._gen[b] += 1
        return ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Share blocks (prefix cache): each id must be allocated."""
        for b in block_ids:
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} is free; cannot share it")
            self._ref[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id; blocks reaching zero go to the tail of the free queue."""
        for b in block_ids:
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)

    def grow(self, num_blocks: int) -> None:
        """Extend the pool to ``num_blocks`` ids; the new ones join the tail of the free queue."""
        if num_blocks < self.num_blocks:
            raise ValueError(f"a block pool cannot grow from {self.num_blocks} to {num_blocks} blocks")
        self._free.extend(range(self.num_blocks, num_blocks))
        self._ref.extend([0] * (num_blocks - self.num_blocks))
        self._gen.extend([0] * (num_blocks - self.num_blocks))
        self.num_blocks = num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def generation(self, block_id: int) -> int:
        """How many times the id was allocated: work done on a block outside the lock (compression's
        encode) checks it is still the same allocation before it swaps anything in."""
        return self._gen[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue, head first (for tests and debugging)."""
        return list(self._free)
