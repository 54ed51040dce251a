"""A rotated KV cache, for the quality benchmark: every head's q, k and v turned by one orthogonal
matrix before they reach the attention backend, the output turned back.

``q R . k R = q . k`` and ``sum_j p_j (v_j R) R^T = sum_j p_j v_j`` for an orthogonal ``R``, so with a
full cache the model's outputs are unchanged (up to rounding) while every cached key and value is
stored, quantized and dropped in the rotated basis. A randomised Hadamard matrix (QuaRot's) spreads
a few large channels over all of them, which is what narrows a per-token quantization group's range.
This is a measurement aid (``bench.quality.kv_quality --rotate``, ``bench.micro.codec_fit --rotate``),
not a serving feature: where it was measured and why it was not adopted is in
``docs/notes/retention-journal.md`` ("A rotated cache").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

ROTATIONS = ("none", "hadamard")


def hadamard(n: int, seed: int = 0) -> Tensor:
    """``diag(s) H_n / sqrt(n)`` [n, n] fp32 with random signs ``s`` (seeded): orthogonal; ``n`` a
    power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    return signs[:, None] * h / n ** 0.5


class RotatedBackend:
    """Wraps an attention backend: ``attend`` sees ``q R, k R, v R`` and returns ``out R^T``; every
    other attribute is the wrapped backend's (step metadata, recorded queries)."""

    def __init__(self, inner: Any, rotation: Tensor) -> None:
        self.inner = inner
        self.rotation = rotation

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
        r = self.rotation.to(q.dtype)  # [D, D]
        q, k, v = q @ r, k @ r, v @ r.to(v.dtype)
        out = self.inner.attend(layer, q, k, v) if window is None else self.inner.attend(
            layer, q, k, v, window=window)
        return out @ r.T.to(out.dtype)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def rotate_engine(engine: Any, rotation: str, head_dim: int) -> None:
    """Turn ``engine``'s cache (``rotation`` in ``ROTATIONS``); "none" leaves it as it is."""
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation must be one of {', '.join(ROTATIONS)}, got {rotation!r}")
    if rotation == "hadamard":
        engine.backend = RotatedBackend(engine.backend, hadamard(head_dim))
        engine.decode_runner = None  # the static decode path holds the unwrapped backend
