"""Bookkeeping of the window groups' block tables per sequence (``groups`` says what a group is).

Apart from ``groups`` so the layer mapping (``LayerGroups``), which the cache layout refers to,
does not import the layout back.
"""

from __future__ import annotations

from collections.abc import Callable

from confkv_engine.cache.groups import LayerGroups
from confkv_engine.cache.layout import SeqKV, WindowTable


class WindowTables:
    """Bookkeeping of the window groups' tables (no tensors). Blocks come and go only through the
    cache's ``take``/``free`` (``KVCache.take_blocks`` / ``free_blocks``)."""

    def __init__(self, groups: LayerGroups, block_size: int, null_block: int,
                 take: Callable[[int], list[int]], free: Callable[[list[int]], None]) -> None:
        self.groups, self.block_size, self.null_block = groups, block_size, null_block
        self._take, self._free = take, free

    def needed(self, seq: SeqKV, num_new: int) -> int:
        """Blocks appending ``num_new`` tokens takes in the window groups (K and V tables)."""
        length = len(seq.windows[0].k_blocks) if seq.windows else 0
        per_table = -(-(seq.window_slots + num_new) // self.block_size)
        return 2 * self.groups.num_window_groups * max(0, per_table - length)

    def reserve(self, seq: SeqKV, num_new: int) -> None:
        """Allocate window blocks for ``num_new`` more tokens (all groups, or none: NoFreeBlocks)."""
        need = self.needed(seq, num_new)
        if not need:
            return
        if not seq.windows:
            seq.windows = [WindowTable() for _ in range(self.groups.num_window_groups)]
        blocks = self._take(need)
        per = need // (2 * len(seq.windows))
        for g, table in enumerate(seq.windows):
            mine = blocks[2 * g * per:2 * (g + 1) * per]
            table.k_blocks.extend(mine[:per])
            table.v_blocks.extend(mine[per:])

    def trim(self, seq: SeqKV) -> list[int]:
        """Give back the blocks no later query reads (after a step); returns them, in the order freed
        (per group: K blocks then V blocks)."""
        first = min(self.groups.first_needed(seq.window_slots, self.block_size),
                    len(seq.windows[0].k_blocks) if seq.windows else 0)
        if first <= seq.window_first:
            return []
        freed: list[int] = []
        for table in seq.windows:
            for blocks in (table.k_blocks, table.v_blocks):
                freed.extend(blocks[seq.window_first:first])
                blocks[seq.window_first:first] = [self.null_block] * (first - seq.window_first)
        seq.window_first = first
        self._free(freed)
        return freed

    def release(self, seq: SeqKV) -> None:
        """Drop every window block of the sequence and reset its window state."""
        held = [b for t in seq.windows for blocks in (t.k_blocks, t.v_blocks)
                for b in blocks[seq.window_first:]]
        self._free(held)
        seq.windows, seq.window_slots, seq.window_first = [], 0, 0

    def held(self, seq: SeqKV) -> int:
        """Window blocks the sequence holds now."""
        return sum(len(t.k_blocks) + len(t.v_blocks) - 2 * seq.window_first for t in seq.windows)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Window blocks a sequence of ``num_tokens`` holds between steps, at most."""
        per_table = min(-(-num_tokens // self.block_size), self.groups.held_window_blocks(self.block_size))
        return 2 * self.groups.num_window_groups * per_table
