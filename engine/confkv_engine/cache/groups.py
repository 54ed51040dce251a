"""Layer groups: sliding-window layers keep only their window in the pool.

A model whose layers mix global attention and one sliding window (Gemma 3: five local layers to
one global) would otherwise hold every layer's keys and values for the whole context, although a
local layer never reads a key older than its window. As vLLM's hybrid allocator does with KV cache
groups, the layers are split into **groups of equal layer count** that share the one pool:

- A pool block holds ``group_size`` layers (``CacheSpec.num_layers`` is the group size, not the
  model's layer count). The **global group** is every global layer, in order (pool layer ``j`` is
  the j-th global layer); it uses the sequence's main K and V tables, so the prefix index,
  retention, tiers, budgets and compression see exactly the global layers, as if the model had only
  those.
- The local layers fill ``ceil(local / group_size)`` **window groups** in order (the last one may be
  partly empty: its unused pool layers are padding, the price of equal block sizes). Each window
  group has its own K and V tables per sequence (``layout.WindowTable``), drawn from the same pool.
  Their slot ``s`` is token ``s`` of the sequence (no retention acts on them), and after every step
  the blocks that end before the next query's window go back to the pool (``WindowTables.trim``);
  their table entries become the null block and ``SeqKV.window_first`` says where the held run
  starts, which is where attention reads from.

A model with one kind of layer (Llama, Qwen, Mistral with the window on every layer) or with
several window sizes gets no groups: one table, all layers per block, exactly as before (Mistral's
window layers are then still attended within their window but keep their blocks).

Prefix caching is off for a grouped model: a hit would need each window group's last window of
blocks as well as the global group's chain, which the index does not keep (the engine logs this at
start). Retention (conf-kv, budgets, tiers) acts on the global group; the window groups keep their
window at full precision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from confkv_engine.cache.layout import SeqKV, WindowTable

GLOBAL = -1  # the group number of the global group (the main tables)


@dataclass(frozen=True)
class LayerGroups:
    """How the model's layers map onto pool layers: ``place(layer) -> (group, pool layer)``."""

    global_layers: tuple[int, ...]
    local_groups: tuple[tuple[int, ...], ...]
    window: int  # tokens a local layer's query sees, itself included

    @classmethod
    def plan(cls, layer_windows: tuple[int, ...], num_layers: int) -> LayerGroups | None:
        """Groups for per-layer windows (0 = global), or None when one table serves (see module doc)."""
        if not layer_windows:
            return None
        if len(layer_windows) != num_layers:
            raise ValueError(f"{len(layer_windows)} layer windows for {num_layers} layers")
        glob = tuple(i for i, w in enumerate(layer_windows) if not w)
        local = [i for i, w in enumerate(layer_windows) if w]
        if not glob or not local or len({layer_windows[i] for i in local}) != 1:
            return None
        size = len(glob)
        groups = tuple(tuple(local[i:i + size]) for i in range(0, len(local), size))
        return cls(glob, groups, layer_windows[local[0]])

    @property
    def group_size(self) -> int:
        """Layers per pool block."""
        return len(self.global_layers)

    @property
    def num_window_groups(self) -> int:
        return len(self.local_groups)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, pool layer) of a model layer; group ``GLOBAL`` for a global layer."""
        if layer in self.global_layers:
            return GLOBAL, self.global_layers.index(layer)
        for g, members in enumerate(self.local_groups):
            if layer in members:
                return g, members.index(layer)
        raise ValueError(f"layer {layer} is in no group")

    def ideal_bytes(self, num_tokens: int, layer_slot_bytes: int) -> int:
        """K and V bytes of ``num_tokens`` with every global layer's tokens and every local layer's last
        window, nothing more (``layer_slot_bytes``: one token's K, or V, in one layer)."""
        local = sum(len(g) for g in self.local_groups)
        tokens = len(self.global_layers) * num_tokens + local * min(num_tokens, self.window)
        return 2 * tokens * layer_slot_bytes

    def held_window_blocks(self, block_size: int) -> int:
        """Blocks a window table holds between two steps at most: the window, straddling blocks."""
        return -(-(self.window - 1) // block_size) + 1

    def first_needed(self, num_tokens: int, block_size: int) -> int:
        """Index of the first block the next query (token ``num_tokens``) still reads: it sees the
        tokens after ``num_tokens - window``."""
        return max(0, num_tokens - self.window + 1) // block_size


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
