"""The decode gather stays within the planned bound: a long sequence decoding beside short ones is
split into groups (no allocation of the step above the bound), with the same outputs as the unsplit
gather; the start-up profiling step runs on this CPU and the plan's figures are logged."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from confkv_api.config import ConfKVConfig, EngineSection
from confkv_engine.attention.paged import PagedAttention, gather_slot_bytes
from confkv_engine.cache.kv_cache import CacheSpec, KVCache, SeqKV
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.memory_profile import (
    activation_peak,
    profile_lengths,
    run_profile_step,
    weights_bytes,
)
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model.loader import load_model
from tests.engine.tiny_models import make_tiny_hf_model

L, HQ, HKV, D, BS = 2, 4, 2, 16, 16
LONG, SHORT = 200, 10


class LargestAllocation(TorchDispatchMode):
    """Records the largest fresh tensor any op returns (every allocation is some op's output; an
    in-place op or a view returns storage one of its inputs already had, which is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                  if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _decode_batch(bound: int | None) -> tuple[torch.Tensor, int, int]:
    """Prefill one long and three short sequences, then one decode step of all four at ``bound``;
    returns (the decode outputs of every layer, the step's largest allocation, groups)."""
    spec = CacheSpec(L, HKV, D, BS, torch.float32, torch.device("cpu"))
    cache = KVCache(spec, 128)
    # The gathering path (the native decode kernel reads the pool in place and gathers nothing).
    backend = PagedAttention(cache, HQ, max_gather_bytes=bound, native=False)
    gen = torch.Generator().manual_seed(0)
    seqs = [SeqKV() for _ in range(4)]
    lengths = [SHORT, LONG, SHORT, SHORT]  # the long row in the middle: groups are runs in step order

    def step(num_new: list[int]) -> tuple[list[torch.Tensor], int]:
        for s, n in zip(seqs, num_new, strict=True):
            cache.reserve(s, n)
        pos = torch.cat([torch.arange(s.num_slots, s.num_slots + n)
                         for s, n in zip(seqs, num_new, strict=True)])
        t = sum(num_new)
        qkv = [(torch.randn(t, HQ, D, generator=gen), torch.randn(t, HKV, D, generator=gen),
                torch.randn(t, HKV, D, generator=gen)) for _ in range(L)]
        with LargestAllocation() as watch:
            backend.begin_step(seqs, num_new, pos)
            outs = [backend.attend(layer, *qkv[layer]) for layer in range(L)]
            backend.end_step()
        return outs, watch.largest

    step(lengths)
    outs, largest = step([1, 1, 1, 1])
    return torch.stack(outs), largest, len(backend.decode)


def test_long_and_short_decode_batch_stays_within_the_bound() -> None:
    spec = CacheSpec(L, HKV, D, BS, torch.float32, torch.device("cpu"))
    row = gather_slot_bytes(spec) * BS * -(-(LONG + 1) // BS)  # the long row's gather, alone
    unbounded, largest_unbounded, groups = _decode_batch(None)
    assert groups == 1 and largest_unbounded == 4 * row  # every short row padded to the long width
    bound = row + row // 2
    bounded, largest, groups = _decode_batch(bound)
    assert groups == 3  # [short], [long], [short, short]: a short row padded to the long width exceeds it
    assert largest <= bound < largest_unbounded
    torch.testing.assert_close(bounded, unbounded, atol=1e-6, rtol=1e-6)


def test_profiling_step_runs_the_largest_step_and_engine_logs_its_plan(tmp_path: Path, caplog) -> None:
    _, model_dir = make_tiny_hf_model("llama", tmp_path)
    loaded = load_model(str(model_dir))
    engine = EngineSection(max_batch_size=3, max_num_batched_tokens=160, prefill_chunk=64)
    assert profile_lengths(engine) == [64, 64, 32]
    spec = CacheSpec(loaded.args.num_layers, loaded.args.num_kv_heads, loaded.args.head_dim, 16,
                     torch.float32, torch.device("cpu"))
    blocks = 2 * (4 + 4 + 2) + 1  # K and V tables of 64, 64 and 32 tokens, and the null block
    assert run_profile_step(loaded.model, spec, profile_lengths(engine), 3) == blocks * spec.block_bytes
    assert weights_bytes(loaded.model) >= sum(p.numel() * 4 for p in loaded.model.parameters())
    config = ConfKVConfig.model_validate({"confkv": {"maxCacheSize": "4Mi"}})
    with caplog.at_level(logging.INFO, logger="confkv.memory"):
        core = LLMEngine(loaded, config)
    assert "memory plan on cpu" in caplog.text and "KV pool 0.00 GiB (maxCacheSize 0.00 GiB)" in caplog.text
    assert core.memory_plan.pool_bytes == 4 << 20
    # a greedy run with the gather bound forced below two long rows gives the same tokens
    prompts = [[5] * 150, [7, 8, 9], [11] * 4]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    free = [o.output_token_ids for o in core.generate(prompts, params)]
    core.backend.max_gather_bytes = gather_slot_bytes(core.cache.spec) * 160
    split = [o.output_token_ids for o in core.generate(prompts, params)]
    assert split == free


def test_activation_peak_arithmetic() -> None:
    """The CUDA allocator's counters as ``measure_activation_peak`` reads them (no GPU here): weights
    61 GiB before, 63 GiB allocated at the peak of which 0.25 GiB is the temporary cache, 63.5 GiB
    reserved."""
    gib = 1 << 30
    assert activation_peak(61 * gib, 63 * gib, 63 * gib + gib // 2, gib // 4) == gib * 7 // 4 + gib // 2
    assert activation_peak(10, 5, 5, 0) == 0  # never negative
