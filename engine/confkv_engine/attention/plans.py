"""The paged attention backend's per-step plans (``attention.paged``): what ``begin_step`` builds once
per step from the batch alone, and each layer's ``attend`` reads: a prefill chunk's tables and masks
(``PrefillPlan``), a group of decode rows' (``DecodePlan``), and a visibility pattern kept as an
additive mask per query dtype (``Mask``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from confkv_engine.attention import codes
from confkv_engine.attention.kernels import native_decode
from confkv_engine.cache.arena import GatherPlan
from confkv_engine.cache.kv_cache import SeqKV

_NEG_INF = float("-inf")


class Mask:
    """A visibility pattern turned into an additive mask once per query dtype."""

    def __init__(self, visible: Tensor) -> None:
        self.visible = visible
        self._by_dtype: dict[torch.dtype, Tensor] = {}

    def additive(self, dtype: torch.dtype) -> Tensor:
        mask = self._by_dtype.get(dtype)
        if mask is None:
            zero = torch.zeros((), dtype=dtype, device=self.visible.device)
            mask = torch.where(self.visible, zero, torch.full_like(zero, _NEG_INF))
            self._by_dtype[dtype] = mask
        return mask


@dataclass
class PrefillPlan:
    """One prefill chunk's attention inputs, built once per step."""

    index: int  # the sequence's position in the step
    rows: slice
    table: GatherPlan  # K blocks then V blocks read from the cache (split: the cached slots' only)
    ctx: int  # slots visible to the last query of the chunk
    cached: int  # slots cached before this chunk
    mask: Mask | None = None  # [1, 1, G*T, ctx], only without the split kernel
    windowed: dict[int, tuple[GatherPlan, Mask]] | None = None  # per window: context table, mask
    # The cached part's compressed entries attended from their codes (``attention.codes``): ``table``
    # then holds its pool entries alone, compacted, ``codes.lengths[0]`` slots of them.
    codes: codes.CodesSplit | None = None


@dataclass
class DecodePlan:
    """A group of consecutive decode rows' blocks, K rows then V rows, padded to one width."""

    rows: slice  # the group's rows among the step's decode rows
    table: GatherPlan | None  # 2 * B * blocks entries (None: ``native`` reads the pool part)
    width: int  # gathered slots per row
    mask: Mask | None  # [B, 1, 1, width] (None with ``native``)
    lengths: Tensor  # [B] visible slots per row
    windowed: dict[int, Mask] | None = None  # per sliding window, built on first use in a step
    # Compressed entries attended from their codes (``attention.codes``): the table then holds the
    # pool entries alone, compacted; ``whole`` is the group's plan with every entry gathered and
    # decoded (sliding-window layers), built on first use.
    codes: codes.CodesSplit | None = None
    seqs: list[SeqKV] | None = None
    whole: DecodePlan | None = None
    native: native_decode.DecodeTables | None = None  # the compacted pool part, read in place

    def slot(self, row: int, slot: int, block_size: int) -> int:
        """Where a slot of row ``row``'s sequence lies in this plan's gathered table."""
        return slot if self.codes is None else codes.compacted(self.codes, row, slot, block_size)
