"""``QuantLinear``: a drop-in for ``nn.Linear`` that serves quantized weights, and the module swap.

The quantization maths lives in ``quant`` (pure functions) and the kernels and their row-count
table in ``kernels``; this module only wires them: a ``QuantLinear`` keeps the prepared
representations its plan uses (e.g. packed int4 for decode steps plus the layer's dense bf16
weight for prefill chunks; the dense kernel always runs on the source's own values, so a long
prefill chunk is as exact as the dense model) and picks one per call from the number of rows.
Weights that were never quantized (F32 / F16 tensors of a GGUF) stay ``nn.Linear``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from confkv_engine.model import kernels
from confkv_engine.model.quant import Int4Weight, Int8Weight

QuantWeight = Int4Weight | Int8Weight


@dataclass(frozen=True)
class Planned:
    max_rows: list[int]
    names: list[str]


class QuantLinear(nn.Module):
    """y = x W^T (+ b) for x ``[rows, in_features]`` with W held quantized; kernel chosen per call."""

    def __init__(self, in_features: int, out_features: int, kind: str,
                 fns: Mapping[str, kernels.KernelFn], plan: list[tuple[int, str]]) -> None:
        super().__init__()
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        self._fns = dict(fns)
        self._plan = Planned([r for r, _ in plan], [n for _, n in plan])

    def kernel_for(self, rows: int) -> str:
        i = min(bisect.bisect_left(self._plan.max_rows, rows), len(self._plan.names) - 1)
        return self._plan.names[i]

    def forward(self, x: Tensor) -> Tensor:
        rows = x.shape[0] if x.dim() == 2 else x.numel() // self.in_features
        y = self._fns[self.kernel_for(rows)](x.reshape(rows, self.in_features))
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        plan = ", ".join(f"<={r}:{n}" for r, n in zip(self._plan.max_rows, self._plan.names, strict=True))
        return f"in={self.in_features}, out={self.out_features}, kind={self.kind}, plan=[{plan}]"


def _kind(weight: QuantWeight) -> str:
    return "int4" if isinstance(weight, Int4Weight) else "int8"


def build_quant_linear(weight: QuantWeight, bias: Tensor | None, dtype: torch.dtype,
                       table: kernels.KernelTable, dense: Tensor | None = None) -> QuantLinear:
    """Prepare only the kernels the table's plan for this shape uses. ``dense``: the source's own
    values for the dense kernel (the layer's expanded weight), else the quantized values expanded."""
    kind = _kind(weight)
    n, k = weight.q.shape
    plan = table.plan(kind, n, k)
    makers: dict[str, Callable[[], kernels.KernelFn]] = {
        "dense": lambda: kernels.dense_kernel(weight.dequantize() if dense is None else dense, bias, dtype),
        "int4": lambda: kernels.int4_kernel(weight, bias, dtype),  # type: ignore[arg-type]
        "int8": lambda: kernels.int8_kernel(weight, bias, dtype),  # type: ignore[arg-type]
    }
    fns = {name: makers[name]() for name in {name for _, name in plan}}
    return QuantLinear(k, n, kind, fns, plan)


def swap_linears(model: nn.Module, weights: Mapping[str, QuantWeight], dtype: torch.dtype,
                 table: kernels.KernelTable) -> int:
    """Replace every ``nn.Linear`` named in ``weights`` (by module path, e.g. ``layers.0.mlp.up_proj``)
    with a ``QuantLinear``; returns how many were replaced."""
    replaced = 0
    for path, weight in weights.items():
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, attr)
        if not isinstance(old, nn.Linear):
            raise TypeError(f"{path} is a {type(old).__name__}, not a Linear")
        if tuple(weight.q.shape) != tuple(old.weight.shape):
            raise ValueError(f"{path}: quantized weight {tuple(weight.q.shape)} != {tuple(old.weight.shape)}")
        setattr(parent, attr, build_quant_linear(weight, old.bias, dtype, table, dense=old.weight))
        replaced += 1
    return replaced


def linear_shapes(weights: Mapping[str, QuantWeight]) -> list[tuple[str, int, int]]:
    """Distinct (kind, out, in) shapes, the keys of a kernel table."""
    return sorted({(_kind(w), *w.q.shape) for w in weights.values()})
