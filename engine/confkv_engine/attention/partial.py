"""Attention over disjoint parts of a context, combined exactly (the flash-decoding identity).

Softmax attention over keys ``K1 ∪ K2`` equals ``w1 * out1 + w2 * out2`` with
``w_i = exp(lse_i - logaddexp(lse1, lse2))``, where ``out_i`` and ``lse_i`` (log-sum-exp of the
scaled scores) come from attending each part alone. That lets the paged backend attend a prefill
chunk's own keys with the causal kernel (no mask, the upper triangle skipped) and its sequence's
cached keys without any mask, instead of one call over both with a ``[T, ctx]`` mask.

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
               causal: bool = False, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """q [B, H, Tq, D], k/v [B, H, S, D] (any strides) -> (out [B, H, Tq, D], lse [B, H, Tq] fp32).
    ``scale`` multiplies the scores (default 1 / sqrt(D))."""
    out, lse = _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse


def combine(parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Exact attention over the union of the parts' keys: parts of (out [..., D], lse [...])."""
    if len(parts) == 1:
        return parts[0][0]
    lses = torch.stack([lse for _, lse in parts])
    weights = torch.softmax(lses, dim=0)  # exp(lse_i - logsumexp_j lse_j)
    out = sum(w[..., None] * o.float() for w, (o, _) in zip(weights, parts, strict=True))
    return out.to(parts[0][0].dtype)
