"""Shard a loaded ``LlamaForCausalLM`` for one tensor-parallel rank, in place.

Megatron's split, done once at load: q/k/v and gate/up are column-parallel (each rank keeps its
own query heads, its own KV heads and its slice of the MLP's intermediate width), o and down are
row-parallel (each rank multiplies its slice, one all-reduce sums them), the embedding and the LM
head are split by vocabulary (the embedding's partial rows are all-reduced, the head's logits are
gathered so sampling sees the whole vocabulary). The architecture code runs unchanged: a sharded
attention layer simply has fewer heads (``nq`` / ``nkv``), which is also what sizes each rank's KV
pool, so per-rank KV bytes divide by the degree.

Quantized linears (``QuantLinear``) are refused: their packed layouts are not split here, and the
launcher loads dense weights under tensor parallelism (see ``launch``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from confkv_engine.model.llama import LlamaForCausalLM
from confkv_engine.parallel.group import TensorParallelError, TPGroup, check_degree


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b: this rank's input columns; the bias is added once, after."""

    def __init__(self, linear: nn.Linear, cols: slice, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(linear.weight.data[:, cols].contiguous(), requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.data.clone(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        y = self.group.all_reduce(torch.nn.functional.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + shard) of the table; other ids read zeros, the all-reduce fills them in."""

    def __init__(self, weight: Tensor, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.start, self.weight = _vocab_shard(weight, group)

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(x.masked_fill(outside[:, None], 0))


class VocabParallelHead(nn.Module):
    """Logits for this rank's vocabulary rows, gathered over ranks (padding cut off)."""

    def __init__(self, weight: Tensor, group: TPGroup) -> None:
        super().__init__()
        self.group, self.vocab = group, weight.shape[0]
        _, self.weight = _vocab_shard(weight, group)

    def forward(self, hidden: Tensor) -> Tensor:
        local = torch.nn.functional.linear(hidden, self.weight)
        return self.group.all_gather_last(local)[..., : self.vocab]


def _vocab_shard(weight: Tensor, group: TPGroup) -> tuple[int, nn.Parameter]:
    """(first row, rows) of this rank's equal share; the last shard is zero-padded."""
    per = -(-weight.shape[0] // group.world)
    start = group.rank * per
    rows = weight.data[start:start + per]
    if rows.shape[0] < per:
        rows = torch.cat([rows, rows.new_zeros(per - rows.shape[0], rows.shape[1])])
    return start, nn.Parameter(rows.contiguous(), requires_grad=False)


def _rows(linear: nn.Linear, rows: slice) -> None:
    linear.weight = nn.Parameter(linear.weight.data[rows].contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[rows].contiguous(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _part(total: int, group: TPGroup) -> slice:
    per = total // group.world
    return slice(group.rank * per, (group.rank + 1) * per)


def shard_model(model: LlamaForCausalLM, group: TPGroup) -> LlamaForCausalLM:
    """Keep this rank's share of every weight (see the module docstring); returns ``model``."""
    args = model.args
    check_degree(group.world, args.num_heads, args.num_kv_heads)
    if args.intermediate_size % group.world:
        raise TensorParallelError(f"tensorParallel {group.world} does not divide the MLP width "
                                  f"{args.intermediate_size}")
    if any(not isinstance(m, nn.Linear) for layer in model.layers for m in _linears(layer)):
        raise TensorParallelError("quantized linears cannot be sharded: serve fp32 or bf16 weights "
                                  "under tensorParallel > 1")
    d = args.head_dim
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = _part(args.num_heads, group), _part(args.num_kv_heads, group)
        _rows(attn.q_proj, slice(q.start * d, q.stop * d))
        _rows(attn.k_proj, slice(kv.start * d, kv.stop * d))
        _rows(attn.v_proj, slice(kv.start * d, kv.stop * d))
        attn.o_proj = RowParallelLinear(attn.o_proj, slice(q.start * d, q.stop * d), group)
        attn.nq, attn.nkv = q.stop - q.start, kv.stop - kv.start
        cols = _part(args.intermediate_size, group)
        _rows(mlp.gate_proj, cols)
        _rows(mlp.up_proj, cols)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, cols, group)
    head = model.lm_head.weight.data
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight.data, group)  # type: ignore[assignment]
    model.lm_head = VocabParallelHead(head, group)  # type: ignore[assignment]
    return model


def _linears(layer: nn.Module) -> list[nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    if attn.qkv_proj is not None or mlp.gate_up_proj is not None:
        return [attn.qkv_proj or attn.o_proj]
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
