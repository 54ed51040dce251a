"""Paged attention kernels behind one interface (``batch.PagedBatch`` + ``batch.PagedKernel``).

- ``reference``: gathers each sequence's slots and computes the softmax explicitly (the tests' oracle).
- ``cpu``: reads the pool through views, piece by piece, with PyTorch's CPU flash kernel.
- ``triton_paged``: one Triton kernel for decode (split-K flash-decoding) and prefill chunks (varlen,
  causal within the chunk); chosen on CUDA only, so CPU serving never imports Triton.
"""

from __future__ import annotations

import torch

from confkv_engine.attention.kernels.batch import PagedBatch, PagedKernel

__all__ = ["PagedBatch", "PagedKernel", "kernel_for"]

# Pools whose blocks the kernels read as they are; int8 (per-row scales) and fp8 pools keep the
# gathering path, which applies the scales / widens the bytes.
FLOAT_POOLS = (torch.float32, torch.bfloat16, torch.float16)


def kernel_for(device: torch.device, pool_dtype: torch.dtype, block_size: int = 16,
               head_dim: int = 64) -> PagedKernel | None:
    """The kernel for a pool on ``device`` storing ``pool_dtype``, or None (use the gathering path)."""
    if pool_dtype not in FLOAT_POOLS:
        return None
    if device.type == "cuda":
        # Triton tiles need powers of two, and its dot products at least 16 rows and columns.
        if not all(x >= 16 and x & (x - 1) == 0 for x in (block_size, head_dim)):
            return None
        from confkv_engine.attention.kernels.triton_paged import paged_attention_triton

        return paged_attention_triton
    from confkv_engine.attention.kernels.cpu import paged_attention_cpu

    return paged_attention_cpu
