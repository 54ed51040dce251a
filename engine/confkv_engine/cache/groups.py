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
  the blocks that end before the next query's window go back to the pool (``WindowTables.trim``,
  ``window_tables``); their table entries become the null block and ``SeqKV.window_first`` says
  where the held run starts, which is where attention reads from.

A model with one kind of layer (Llama, Qwen, Mistral with the window on every layer) or with
several window sizes gets no groups: one table, all layers per block, exactly as before (Mistral's
window layers are then still attended within their window but keep their blocks).

Prefix caching is off for a grouped model: a hit would need each window group's last window of
blocks as well as the global group's chain, which the index does not keep (the engine logs this at
start). Retention (conf-kv, budgets, tiers) acts on the global group; the window groups keep their
window at full precision.
"""

from __future__ import annotations

from dataclasses import dataclass

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
