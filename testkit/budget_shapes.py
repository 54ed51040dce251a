"""Per-layer budget shapes at a fixed mean, and the per-layer attention entropy that one of them uses.

A shape gives layer ``l`` the fraction ``f_l`` of its full cache, with ``mean(f_l) = f`` exactly, so
at every length where no floor binds the sequence holds the same total bytes as the uniform budget
``f`` (every layer's full cache has the same size):

- ``uniform``: ``f_l = f``.
- ``pyramid:R`` (PyramidKV): linear in depth, first layer / last layer = ``R`` (R > 1 decreases with
  depth as PyramidKV does; R < 1 is the inverted control).
- ``entropy:G``: proportional to ``H_l ** G``, ``H_l`` the layer's mean normalised attention entropy
  (calibrated on the tuning tokens with the full cache): a layer whose attention is spread out
  needs more tokens than one that looks at a few.

Every shape is then fitted into ``[lo, hi]`` (``lo = f / 4``, ``hi = 1``) keeping the mean: one
scale factor found by bisection on the clipped values (a layer pinned at a bound gives its share
to the others).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def fit_mean(raw: list[float], f: float, lo: float, hi: float) -> list[float]:
    """``clip(s * raw, lo, hi)`` with the scale ``s`` that makes the mean ``f`` (needs lo <= f <= hi)."""
    if not lo <= f <= hi or min(raw) <= 0:
        raise ValueError(f"need lo <= f <= hi and positive weights, got lo={lo} f={f} hi={hi}")

    def mean_at(s: float) -> float:
        return sum(min(hi, max(lo, s * r)) for r in raw) / len(raw)

    a, b = 0.0, hi / min(raw)
    for _ in range(200):
        mid = (a + b) / 2
        a, b = (mid, b) if mean_at(mid) < f else (a, mid)
    s = (a + b) / 2
    return [min(hi, max(lo, s * r)) for r in raw]


def layer_fractions(shape: str, f: float, num_layers: int, entropy: list[float] | None = None) -> list[float]:
    """Per-layer fractions for ``shape`` (see the module docstring) with mean ``f``."""
    name, _, arg = shape.partition(":")
    if name == "uniform":
        raw = [1.0] * num_layers
    elif name == "pyramid":
        ratio = float(arg or 2.0)
        raw = [ratio + (1.0 - ratio) * layer / (num_layers - 1) for layer in range(num_layers)]
    elif name == "entropy":
        if entropy is None or len(entropy) != num_layers:
            raise ValueError("the entropy shape needs one calibrated entropy per layer")
        power = float(arg or 1.0)
        raw = [h ** power for h in entropy]
    else:
        raise ValueError(f"unknown budget shape {shape!r} (uniform | pyramid:R | entropy:G)")
    return fit_mean(raw, f, f / 4, 1.0)


class EntropyProbe:
    """Dense causal attention that records, per layer, the mean normalised entropy of the attention
    of the queries in ``[skip, T)`` (each query's entropy over its ``i + 1`` visible keys divided by
    ``log(i + 1)``, averaged over query heads). One forward over the whole window."""

    def __init__(self, num_layers: int, skip: int) -> None:
        self.skip = skip
        self.sums = [0.0] * num_layers
        self.counts = [0] * num_layers

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        t, nq, d = q.shape
        group = nq // k.shape[1]
        kf, vf = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        scores = torch.einsum("thd,shd->hts", q.float(), kf) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1)[None], float("-inf"))
        probs = scores.softmax(-1)  # [Hq, T, T]
        ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)  # [Hq, T]
        visible = torch.arange(1, t + 1, dtype=torch.float32)
        norm = ent[:, self.skip:] / visible[self.skip:].log()
        self.sums[layer] += float(norm.sum())
        self.counts[layer] += norm.numel()
        return torch.einsum("hts,shd->thd", probs, vf).to(q.dtype)

    def entropies(self) -> list[float]:
        return [s / max(c, 1) for s, c in zip(self.sums, self.counts, strict=True)]
