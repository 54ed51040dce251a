"""The memory planner's arithmetic with a fake reader (no GPU here): the numbers of
examples/gpu-32b.yaml's model (Qwen2.5-32B: 64 layers, 8 KV heads, head dim 128, bf16 weights of
~65.5 GB) on an 80 GB card. The activation peak is the reader's figure: a profiling step would
measure it on the GPU; 1.5 GiB is an assumed reading of that size (4,096 batched tokens through a
5,120-wide model with a 27,648-wide MLP)."""

from __future__ import annotations

import pytest
import torch

from confkv_api.units import parse_size
from confkv_engine.attention.paged import gather_slot_bytes
from confkv_engine.cache.kv_cache import CacheSpec
from confkv_engine.cache.planner import (
    DeviceFigures,
    GiB,
    MiB,
    NoMemoryLeft,
    decode_gather_bound,
    plan_memory,
    requested_pool_bytes,
)

H100_TOTAL = 85_520_809_984  # what an 80 GB H100 reports (81,559 MiB)
WEIGHTS_32B = 65_500_000_000
ACTIVATION = 3 * GiB // 2
RESERVE = 512 * MiB + 256 * MiB  # CUDA context and workspaces outside torch, plus the margin
SPEC_32B = CacheSpec(num_layers=64, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16,
                     device=torch.device("cpu"))


def _figures(free: int | None = None) -> DeviceFigures:
    free = H100_TOTAL - WEIGHTS_32B - 512 * MiB if free is None else free
    return DeviceFigures("cuda:0", H100_TOTAL, free, WEIGHTS_32B, RESERVE)


def _gather() -> int:
    return decode_gather_bound(gather_slot_bytes(SPEC_32B), max_model_len=32768, max_batch_size=64)


def test_the_32b_examples_decode_gather_bound() -> None:
    slot = gather_slot_bytes(SPEC_32B)
    assert slot == 2 * 8 * 128 * 2  # K and V of one token in one layer, bf16
    assert slot * 32768 == 128 * MiB  # one row at maxModelLen
    assert slot * 32768 * 64 == 8 * GiB  # the unsplit padded gather the bound replaces
    assert _gather() == 512 * MiB  # four rows of 32K tokens per group
    assert SPEC_32B.block_bytes // 16 == 64 * 8 * (128 * 2 + 4)  # K (or V) bytes per token, all layers


def test_the_32b_examples_12gi_pool_fits() -> None:
    plan = plan_memory(parse_size("12Gi"), _figures(), ACTIVATION, _gather())
    assert plan.pool_bytes == 12 * GiB and plan.capped_by is None
    assert 12 * GiB // (2 * SPEC_32B.block_bytes // 16) == 48_395  # tokens (K and V, positions) it holds
    text = "\n".join(plan.lines())
    for figure in ("total 79.65 GiB", "weights 61.00 GiB", "activation peak 1.50 GiB",
                   "decode gather bound 0.50 GiB", "reserve 0.75 GiB", "KV pool 12.00 GiB"):
        assert figure in text


def test_a_fraction_is_of_total_memory_less_everything_else() -> None:
    plan = plan_memory(parse_size("90%"), _figures(), ACTIVATION, _gather())
    expected = int(0.9 * H100_TOTAL) - WEIGHTS_32B - ACTIVATION - _gather() - RESERVE
    assert plan.pool_bytes == expected
    assert 7.9 * GiB < expected < 8.0 * GiB
    assert plan_memory(None, _figures(), ACTIVATION, _gather()).pool_bytes == expected  # CUDA default: 90%


def test_a_fraction_that_leaves_nothing_is_a_clear_error() -> None:
    with pytest.raises(NoMemoryLeft) as err:
        plan_memory(parse_size("80%"), _figures(), ACTIVATION, _gather())
    message = str(err.value)
    assert "80%" in message and "weights 61.00 GiB" in message and "activation peak 1.50 GiB" in message
    assert "give at least 80.1%" in message  # what would leave a pool


def test_bytes_beyond_what_is_free_are_capped_and_say_so() -> None:
    free = 10 * GiB  # another process holds part of the card
    plan = plan_memory(parse_size("12Gi"), _figures(free), ACTIVATION, _gather())
    assert plan.pool_bytes == free - ACTIVATION - _gather() - RESERVE
    assert plan.capped_by is not None and "12.00 GiB" in plan.capped_by
    with pytest.raises(NoMemoryLeft, match="no memory left"):
        plan_memory(parse_size("1Gi"), _figures(2 * GiB), ACTIVATION, _gather())


def test_live_request_uses_the_start_up_figures() -> None:
    plan = plan_memory(parse_size("12Gi"), _figures(), ACTIVATION, _gather())
    assert requested_pool_bytes(plan, parse_size("90%")) == plan_memory(
        parse_size("90%"), _figures(), ACTIVATION, _gather()).pool_bytes
    assert requested_pool_bytes(plan, parse_size("100Gi")) == 100 * GiB  # uncapped: growth checks it
    with pytest.raises(NoMemoryLeft):
        requested_pool_bytes(plan, parse_size("50%"))


def test_cpu_default_and_bound_edges() -> None:
    cpu = DeviceFigures("cpu", 16 * GiB, 6 * GiB, 300 * MiB)
    assert plan_memory(None, cpu, 0, 64 * MiB).pool_bytes == GiB
    assert decode_gather_bound(1000, 10, 4, limit=1) == 10_000  # one row is never split
    assert decode_gather_bound(1000, 10, 4, limit=10**9) == 40_000  # never more than the whole batch
