"""KEY_ONLY's stand-in for the freed values, and attention over FULL/KEY_ONLY slots.

A KEY_ONLY token keeps its key, so the softmax normalisation over all kept keys stays exact; its
value is replaced by ``v_mean``, the running weighted mean (fp32) of every value demoted so far in
the same (sequence, layer, KV head)::

    out = sum_{i in FULL} p_i v_i + (sum_{j in KEY_ONLY} p_j) v_mean

A value's weight in the mean is the attention signal it had when demoted (plus a small floor, so
tokens nobody attended to still count): values that drew attention dominate the stand-in.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

WEIGHT_FLOOR = 1e-6


def merge_values(mean: Tensor, weight: Tensor, values: Tensor, w: Tensor, select: Tensor) -> None:
    """Fold the values where ``select`` [U, n] into the running mean, in place.

    mean [U, D] fp32, weight [U] fp32, values [U, n, D], w [U, n] (attention signal).
    """
    wf = torch.where(select, w.float() + WEIGHT_FLOOR, torch.zeros_like(w, dtype=torch.float32))
    added = wf.sum(-1)  # [U]
    total = weight + added
    contrib = torch.einsum("un,und->ud", wf, values.float())
    upd = total > 0
    mean.copy_(torch.where(upd[:, None], (mean * weight[:, None] + contrib) / total.clamp_min(1e-30)[:, None],
                           mean))
    weight.copy_(total)


def tiered_attention(
    q: Tensor, k: Tensor, v: Tensor, key_only: Tensor, v_mean: Tensor, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Attention over kept slots with KEY_ONLY values replaced by the merged mean.

    q [U, G, T, D] (query heads grouped by KV head), k/v [U, S, D], key_only [U, S] bool,
    v_mean [U, D], mask additive [T, S] or [U, 1, T, S] (or None). Returns (out [U, G, T, D] in q's
    dtype, probs [U, G, T, S] fp32): the probabilities are what the attention signal needs.
    """
    scores = torch.einsum("ugtd,usd->ugts", q.float(), k.float()) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask.float()
    probs = scores.softmax(-1)
    v_eff = torch.where(key_only[..., None], v_mean[:, None, :].float(), v.float())
    out = torch.einsum("ugts,usd->ugtd", probs, v_eff)
    return out.to(q.dtype), probs
