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
from confkv_engine.model.quant import Int4Weight, Int8GroupWeight, Int8Weight

QuantWeight = Int4Weight | Int8Weight | Int8GroupWeight


@dataclass(frozen=True)
class Planned:
    max_rows: list[int]
    names: list[str]


class QuantLinear(nn.Module):
    """y = x W^T (+ b) for x ``[rows, in_features]`` with W held quantized; kernel chosen per call."""

    def __init__(self, in_features: int, out_features: int, kind: str,
                 fns: Mapping[str, kernels.KernelFn], plan: list[tuple[int, str]],
                 argmax: Mapping[str, kernels.ArgmaxFn] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        self._fns = dict(fns)
        self._argmax = dict(argmax or {})  # kernels that fuse a greedy argmax (the native ones)
        self._plan = Planned([r for r, _ in plan], [n for _, n in plan])

    def kernel_for(self, rows: int) -> str:
        i = min(bisect.bisect_left(self._plan.max_rows, rows), len(self._plan.names) - 1)
        return self._plan.names[i]

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:  # the engine's flattened rows (no reshape, no view: per-call cost at decode)
            return self._fns[self.kernel_for(x.shape[0])](x)
        rows = x.numel() // self.in_features
        y = self._fns[self.kernel_for(rows)](x.reshape(rows, self.in_features))
        return y.view(*x.shape[:-1], self.out_features)

    def argmax(self, x: Tensor) -> Tensor | None:
        """x ``[rows, in_features]`` -> the index of each row's largest output ``[rows]`` (int64),
        without the outputs, where this row count's kernel fuses it; None where it does not."""
        fn = self._argmax.get(self.kernel_for(x.shape[0]))
        return None if fn is None else fn(x)

    def extra_repr(self) -> str:
        plan = ", ".join(f"<={r}:{n}" for r, n in zip(self._plan.max_rows, self._plan.names, strict=True))
        return f"in={self.in_features}, out={self.out_features}, kind={self.kind}, plan=[{plan}]"


def _kind(weight: QuantWeight) -> str:
    if isinstance(weight, Int8GroupWeight):  # groups of 16 (Q6_K) have their own plan
        return "int8g16" if weight.group == 16 else "int8g"
    return "int4" if isinstance(weight, Int4Weight) else "int8"


def build_quant_linear(weight: QuantWeight, bias: Tensor | None, dtype: torch.dtype,
                       table: kernels.KernelTable, dense: Tensor | None = None) -> QuantLinear:
    """Prepare only the kernels the table's plan for this shape uses. ``dense``: the source's own
    values for the dense kernel (the layer's expanded weight), else the quantized values expanded."""
    kind = _kind(weight)
    n, k = weight.q.shape
    plan = table.plan(kind, n, k)
    argmax: dict[str, kernels.ArgmaxFn] = {}

    def native(name: str) -> kernels.KernelFn:
        fn, fused = kernels.native_kernels(name, weight, bias, dtype)
        if fused is not None:
            argmax[name] = fused
        return fn

    makers: dict[str, Callable[[], kernels.KernelFn]] = {
        "dense": lambda: kernels.dense_kernel(weight.dequantize() if dense is None else dense, bias, dtype),
        "int4": lambda: kernels.int4_kernel(weight, bias, dtype),  # type: ignore[arg-type]
        "q4n": lambda: native("q4n"),
        "int8": lambda: kernels.int8_kernel(weight, bias, dtype),  # type: ignore[arg-type]
        "q8n": lambda: native("q8n"),
    }
    fns = {name: makers[name]() for name in {name for _, name in plan}}
    return QuantLinear(k, n, kind, fns, plan, argmax)


# Linears that read the same input, served as one matmul (fewer kernel calls per layer): fused
# name -> the members whose output rows it stacks, in order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _stack(parts: list[QuantWeight]) -> QuantWeight | None:
    if all(isinstance(p, Int4Weight) for p in parts) and len({p.group for p in parts}) == 1:  # type: ignore[union-attr]
        return Int4Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]), parts[0].group)  # type: ignore[union-attr]
    if all(isinstance(p, Int8Weight) for p in parts):
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    if all(isinstance(p, Int8GroupWeight) for p in parts) and len({p.group for p in parts}) == 1:  # type: ignore[union-attr]
        return Int8GroupWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                               parts[0].group)  # type: ignore[union-attr]
    return None


def fuse_weights(weights: Mapping[str, QuantWeight]) -> dict[str, QuantWeight]:
    """Replace each complete group of ``FUSED`` members of one format by their stacked weight,
    keyed ``<parent>.<fused name>``; members in mixed formats stay separate."""
    out = dict(weights)
    parents = {path.rpartition(".")[0] for path in weights}
    for parent in sorted(parents):
        for fused, members in FUSED.items():
            paths = [f"{parent}.{m}" for m in members]
            if not all(p in out for p in paths):
                continue
            stacked = _stack([out[p] for p in paths])
            if stacked is not None:
                for p in paths:
                    del out[p]
                out[f"{parent}.{fused}"] = stacked
    return out


def _dense_and_bias(parent: nn.Module, attr: str) -> tuple[Tensor, Tensor | None]:
    """The source's dense weight (and bias) of ``parent.attr``, stacked for a fused name."""
    linears = [getattr(parent, m) for m in FUSED.get(attr, (attr,))]
    for lin in linears:
        if not isinstance(lin, nn.Linear):
            raise TypeError(f"{type(parent).__name__}.{attr}: {type(lin).__name__} is not a Linear")
    dense = torch.cat([lin.weight for lin in linears]) if len(linears) > 1 else linears[0].weight
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return dense, None
    if any(b is None for b in biases):
        raise ValueError(f"{type(parent).__name__}.{attr}: only some of the fused linears have a bias")
    return dense, torch.cat(biases)  # type: ignore[arg-type]


def swap_linears(model: nn.Module, weights: Mapping[str, QuantWeight], dtype: torch.dtype,
                 table: kernels.KernelTable) -> int:
    """Replace every ``nn.Linear`` named in ``weights`` (module path, e.g. ``layers.0.mlp.up_proj``,
    or a ``FUSED`` name whose parent has ``fuse``) with a ``QuantLinear``; returns how many."""
    for path, weight in weights.items():
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        dense, bias = _dense_and_bias(parent, attr)
        if tuple(weight.q.shape) != tuple(dense.shape):
            raise ValueError(f"{path}: quantized weight {tuple(weight.q.shape)} != {tuple(dense.shape)}")
        layer = build_quant_linear(weight, bias, dtype, table, dense=dense)
        if attr in FUSED:
            parent.fuse(layer)  # type: ignore[operator]
        else:
            setattr(parent, attr, layer)
    return len(weights)


def linear_shapes(weights: Mapping[str, QuantWeight]) -> list[tuple[str, int, int]]:
    """Distinct (kind, out, in) shapes, the keys of a kernel table."""
    return sorted({(_kind(w), *w.q.shape) for w in weights.values()})
