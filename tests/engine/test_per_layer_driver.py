"""The per-layer driver (one paged cache per layer): exact when nothing is evicted, each layer holds
its own budget, and a shape with a larger early-layer budget keeps more tokens there."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.cache.kv_cache import CacheSpec, KVCache
from confkv_engine.model.llama import DenseAttention, LlamaForCausalLM
from confkv_engine.retention.manager import RetentionManager
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.tiers import TierConfig
from testkit.drivers.per_layer import run_sequence_per_layer
from testkit.drivers.tiny_model import tiny_model

CHUNK = 32


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_model()


def _tokens(n: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def _cfg(f: float | None) -> RetentionConfig:
    if f is None:
        return RetentionConfig(policy="conf-kv", tiers=TierConfig(high=0.01, medium=0.0, window=CHUNK))
    return RetentionConfig(policy="conf-kv", tiers=TierConfig(window=CHUNK), budget=f)


def test_nothing_evicted_matches_the_dense_reference(model) -> None:
    toks = _tokens(200)
    run = run_sequence_per_layer(model, [_cfg(None), RetentionConfig()], toks, CHUNK)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(toks), torch.arange(len(toks)), DenseAttention()))
    ref = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(toks[1:])[:, None]).squeeze(-1)
    torch.testing.assert_close(run.logprobs, ref, atol=1e-5, rtol=1e-5)
    assert run.layer_slots == [200, 200]


def test_each_layer_holds_its_own_budget(model) -> None:
    toks = _tokens(480)
    fracs = [0.5, 0.125]
    run = run_sequence_per_layer(model, [_cfg(f) for f in fracs], toks, CHUNK)
    assert run.layer_slots[0] > 2 * run.layer_slots[1]
    targets = []
    for f in fracs:  # what each one-layer manager allows at the final length
        cache = KVCache(CacheSpec(1, 2, 16, 16, torch.float32, torch.device("cpu")), 80)
        state = RetentionManager(cache, 4, _cfg(f), CHUNK).new_state(_cfg(f))
        targets.append(state.target_bytes(len(toks), False))
    assert run.held_bytes[-1] <= sum(targets)
    assert run.held_bytes[-1] > 0.8 * sum(targets)
