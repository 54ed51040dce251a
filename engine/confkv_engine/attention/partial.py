"""Attention over disjoint parts of a context, combined exactly (the flash-decoding identity).

Softmax attention over keys ``K1 ∪ K2`` equals ``w1 * out1 + w2 * out2`` with
``w_i = exp(lse_i - logaddexp(lse1, lse2))``, where ``out_i`` and ``lse_i`` (log-sum-exp of the
scaled scores) come from attending each part alone. That lets the paged backend attend

- a prefill chunk's own keys with the causal kernel (no mask, the upper triangle skipped) and its
  sequence's cached keys without any mask, instead of one call over both with a ``[T, ctx]`` mask;
- a long run of a sequence's blocks that lie next to each other in the pool straight from the pool
  (a view, no copy), and only the rest of its blocks through a gather.

On CPU the part results come from PyTorch's flash-attention kernel, which returns the log-sum-exp
next to the output (``_scaled_dot_product_flash_attention_for_cpu``; it accumulates bf16 inputs in
fp32, so no upcast is needed). Other devices keep the single masked call (``available``).
"""

from __future__ import annotations

import torch
from torch import Tensor

_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def available(device: torch.device) -> bool:
    """Whether ``attend_lse`` has a fused kernel on ``device``."""
    return device.type == "cpu"


def attend_lse(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
               causal: bool = False) -> tuple[Tensor, Tensor]:
    """q [B, H, Tq, D], k/v [B, H, S, D] (any strides) -> (out [B, H, Tq, D], lse [B, H, Tq] fp32)."""
    out, lse = _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask)
    return out, lse


def combine(parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Exact attention over the union of the parts' keys: parts of (out [..., D], lse [...])."""
    if len(parts) == 1:
        return parts[0][0]
    lses = torch.stack([lse for _, lse in parts])
    weights = torch.softmax(lses, dim=0)  # exp(lse_i - logsumexp_j lse_j)
    out = sum(w[..., None] * o.float() for w, (o, _) in zip(weights, parts, strict=True))
    return out.to(parts[0][0].dtype)


def contiguous_runs(k_blocks: list[int], v_blocks: list[int], limit: int, min_blocks: int,
                    null_block: int) -> list[tuple[int, int, int, int]]:
    """Runs of table entries ``[first, first + n)`` within ``[0, limit)`` whose K blocks and V blocks
    are each consecutive pool ids (so both are one slice of the pool), at least ``min_blocks`` long:
    ``(first, n, k_start, v_start)``. Compressed (< 0) and null entries never join a run."""
    runs: list[tuple[int, int, int, int]] = []
    i = 0
    while i < limit:
        k0, v0 = k_blocks[i], v_blocks[i]
        if k0 < 0 or v0 < 0 or v0 == null_block:
            i += 1
            continue
        j = i + 1
        while j < limit and k_blocks[j] == k0 + (j - i) and v_blocks[j] == v0 + (j - i):
            j += 1
        if j - i >= min_blocks:
            runs.append((i, j - i, k0, v0))
        i = j
    return runs
