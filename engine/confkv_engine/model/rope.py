"""RoPE frequencies: the base ones and the scaled variants checkpoints declare (``rope_type``).

``rope_frequencies(head_dim, theta, scaling, max_positions)`` returns ``(inv_freq, attention_factor)``:
the per-pair inverse frequencies and the factor cos/sin are multiplied by (1 except for yarn and
longrope), as transformers' ``ROPE_INIT_FUNCTIONS`` define them. Keys are cached after RoPE and never
re-rotated, so every scaling here is static: one set of frequencies for the whole served context.
Where transformers varies them with the running length, the choice is the one vLLM makes:

- ``dynamic`` (NTK-aware): the base stretched for the full ``factor x max_position_embeddings``
  context, the frequencies transformers reaches at that length (below it transformers starts from
  the unscaled base and changes it as the sequence grows, which a cache of rotated keys cannot follow);
- ``longrope``: the long factors when the served context (``max_position_embeddings``) exceeds
  ``original_max_position_embeddings``, else the short ones (transformers picks per call by length).

Anything else is a ``RopeScalingError`` naming the supported types.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


class RopeScalingError(ValueError):
    """A ``rope_scaling`` the model cannot serve (the loaders turn it into ``ModelLoadError``)."""


def rope_kind(scaling: dict[str, Any] | None) -> str:
    scaling = scaling or {}
    return str(scaling.get("rope_type", scaling.get("type")) or "default")


def check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    kind = rope_kind(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise RopeScalingError(
            f"unsupported rope scaling type {kind!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def base_inv_freq(head_dim: int, theta: float) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))


def llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    """Llama-3 frequency-dependent RoPE scaling (rope_type 'llama3')."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_frequencies(head_dim: int, theta: float, scaling: dict[str, Any],
                     max_positions: int) -> tuple[Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between."""
    original = scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling.get("factor") or max_positions / original
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolate = (1 - ramp).double()
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    inv = (1.0 / pos_freqs).double()
    return inv / factor * (1 - extrapolate) + inv * extrapolate, float(attention)


def longrope_frequencies(head_dim: int, theta: float, scaling: dict[str, Any],
                         max_positions: int) -> tuple[Tensor, float]:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = scaling["long_factor"] if max_positions > original else scaling["short_factor"]
    ext_t = torch.tensor(ext, dtype=torch.float64)
    if ext_t.shape != (head_dim // 2,):
        raise RopeScalingError(f"longrope factors have {ext_t.numel()} entries, expected {head_dim // 2}")
    return base_inv_freq(head_dim, theta) / ext_t, float(attention)


def dynamic_theta(head_dim: int, theta: float, factor: float) -> float:
    """NTK-aware base for a context ``factor`` times the trained one."""
    return theta * (factor * factor - (factor - 1)) ** (head_dim / (head_dim - 2))


def rope_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                     max_positions: int) -> tuple[Tensor, float]:
    """(fp32 inv_freq [head_dim / 2], attention factor) for one RoPE configuration."""
    check_rope_scaling(scaling)
    scaling = scaling or {}
    kind = rope_kind(scaling)
    attention = 1.0
    if kind == "yarn":
        inv, attention = yarn_frequencies(head_dim, theta, scaling, max_positions)
    elif kind == "longrope":
        inv, attention = longrope_frequencies(head_dim, theta, scaling, max_positions)
    elif kind == "dynamic":
        inv = base_inv_freq(head_dim, dynamic_theta(head_dim, theta, float(scaling["factor"])))
    else:
        inv = base_inv_freq(head_dim, theta)
        if kind == "llama3":
            inv = llama3_inv_freq(inv, scaling)
        elif kind == "linear":
            inv = inv / scaling["factor"]
    return inv.float(), attention
