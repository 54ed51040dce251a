"""The paged attention interface: what a kernel reads (``PagedBatch``, built once per step) and the
per-layer call every implementation answers (``PagedKernel``).

A step's queries are the rows of ``q`` [T, Hq, D]; sequence ``i`` owns rows
``[q_start[i], q_start[i] + q_len[i])`` (a decode row has ``q_len`` 1, a prefill chunk more) and
its K and V slots ``[0, seq_lens[i])`` lie in the blocks its tables name, the step's own keys
already written. Query row ``t`` of sequence ``i`` sits at slot ``seq_lens[i] - q_len[i] + t`` and
sees the slots up to it (causal within a chunk, every cached slot before it) and, with a
``window``, only the last ``window`` of those (a local layer's sliding window, counted in slots:
the positions of a cache retention never compacted).

- **Block tables** ``k_table`` / ``v_table`` [N, W] int32 are pool block ids of the layer's pool
  ``[NB, bs, Hkv, D]`` (K and V blocks share it); an entry ``>= NB`` names row ``entry - NB`` of a
  *side* tensor ``[NS, bs, Hkv, D]``: the step's compressed blocks, decoded once per layer (only
  those; the pool blocks are read where they lie). Entries past a sequence's length are never read,
  so the tables' padding costs no work.
- **KEY_ONLY**: slots ``[key_only[i, 0], key_only[i, 0] + key_only[i, 1])`` take their key from the
  K table and, instead of a value, the sequence's stand-in ``stand_in[i]`` [Hkv, D] (retention's merged
  mean), so the output is ``sum_FULL p v + (sum_KEY_ONLY p) v_mean`` with the exact normalisation.
- **GQA**: query head ``h`` reads KV head ``h // G``; K and V are never repeated.
- **Outputs**: the attention output [T, Hq, D] in q's dtype and the log-sum-exp of the scaled scores
  [T, Hq] fp32, from which a token's attention mass is ``exp(q.k * scale - lse)`` (retention's
  scoring) and partial results combine exactly (``partial.combine``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class PagedBatch:
    """One step's view of the cache for the kernels (all tensors on the pool's device)."""

    k_table: Tensor  # [N, W] int32
    v_table: Tensor  # [N, W] int32
    seq_lens: Tensor  # [N] int32
    q_start: Tensor  # [N] int32
    q_len: Tensor  # [N] int32
    key_only: Tensor  # [N, 2] int32: (first KEY_ONLY slot, count)
    max_q_len: int
    block_size: int
    window: int | None = None  # visible slots per query (None: all)
    # A kernel's per-step plans (the same in every layer), computed at the first layer.
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return int(self.k_table.shape[0])

    @property
    def width(self) -> int:
        return int(self.k_table.shape[1])

    def with_window(self, window: int | None) -> PagedBatch:
        """The batch for one layer's sliding window (None: this batch's); plans stay shared, keyed
        by window."""
        if window is None or window == self.window:
            return self
        if window < 1:
            raise ValueError(f"a sliding window holds at least one slot, got {window}")
        return replace(self, window=window)

    @classmethod
    def build(cls, k_tables: list[list[int]], v_tables: list[list[int]], seq_lens: list[int],
              q_lens: list[int], key_only: list[tuple[int, int]] | None, block_size: int,
              device: torch.device, window: int | None = None,
              send: Callable[[list, torch.dtype], Tensor] | None = None) -> PagedBatch:
        """From Python lists (one per sequence); tables are padded with block 0 (never read).
        ``send``: how a list reaches ``device`` (the engine's pinned staging; default
        ``torch.tensor``)."""
        if window is not None and window < 1:
            raise ValueError(f"a sliding window holds at least one slot, got {window}")
        width = max(1, max(len(t) for t in k_tables))
        pad = [t + [0] * (width - len(t)) for t in k_tables], [t + [0] * (width - len(t)) for t in v_tables]
        starts = [0]
        for n in q_lens[:-1]:
            starts.append(starts[-1] + n)

        def ints(x: list) -> Tensor:
            if send is not None:
                return send(x, torch.int32)
            return torch.tensor(x, dtype=torch.int32, device=device)

        return cls(ints(pad[0]), ints(pad[1]), ints(seq_lens), ints(starts), ints(q_lens),
                   ints(key_only or [(0, 0)] * len(seq_lens)).view(-1, 2), max(q_lens), block_size, window)


class PagedKernel(Protocol):
    """One implementation of paged attention over a layer's pool (see the module docstring)."""

    def __call__(self, q: Tensor, pool: Tensor, batch: PagedBatch, side: Tensor | None = None,
                 stand_in: Tensor | None = None, scale: float | None = None,
                 window: int | None = None) -> tuple[Tensor, Tensor]:
        """q [T, Hq, D], pool [NB, bs, Hkv, D], side [NS, bs, Hkv, D] or None, stand_in [N, Hkv, D]
        or None, ``window``: this layer's sliding window (None: the batch's) -> (out [T, Hq, D] in
        q's dtype, lse [T, Hq] fp32)."""
        ...
