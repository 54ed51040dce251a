"""Retention through LLMEngine: budget after every step, blocks back in the pool, usage per tier,
per-request policies, and greedy replay after preemption under conf-kv (tiny random Llama, fp32)."""

from __future__ import annotations

import pytest
import torch

from confkv_api.config import ConfKVConfig
from confkv_engine.cache.block_pool import is_compressed
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import InvalidRequest, SamplingParams
from confkv_engine.core.scheduler import AdmissionPolicy
from confkv_engine.model.loader import load_model
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.tiers import TierConfig
from tests.engine.tiny_models import make_tiny_hf_model

pytest.importorskip("transformers")

CHUNK = 32


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    _, model_dir = make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny-ret"))
    return load_model(str(model_dir), dtype=torch.float32, device="cpu")


def make_engine(loaded, blocks: int | None = None, retention: RetentionConfig | None = None,
                **confkv) -> LLMEngine:
    args = loaded.model.args
    block_bytes = args.num_layers * args.num_kv_heads * (args.head_dim * 4 + 4) * 16
    size = str((blocks + 1) * block_bytes) if blocks else "8Mi"  # + the null block the cache reserves
    cfg = ConfKVConfig.model_validate({
        "engine": {"prefillChunk": CHUNK, "maxNumBatchedTokens": 256},
        "confkv": {"maxCacheSize": size, "window": CHUNK, **confkv}})
    return LLMEngine(loaded, cfg, retention=retention)


def pool_blocks(cache, kv) -> int:
    """Pool blocks a sequence's tables account for: its plain blocks, and the compressed store's arena
    hosts for its frozen blocks (several frozen blocks share one host)."""
    handles = sum(1 for b in kv.k_blocks + kv.v_blocks if is_compressed(b))
    return cache.held_blocks(kv) - handles + cache.store.num_hosts


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 31 + salt * 7 + 3) % 250 for i in range(n)]


def conf_kv(f: float) -> RetentionConfig:
    return RetentionConfig(policy="conf-kv", tiers=TierConfig(window=CHUNK, medium=0.3), budget=f)


@pytest.mark.parametrize("policy", ["streaming", "h2o", "conf-kv"])
def test_budget_holds_after_every_step_and_blocks_return(loaded, policy: str) -> None:
    eng = make_engine(loaded, kvPolicy=policy, budget=0.25)
    eng.add_request("a", prompt(200), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    ret = eng.retention
    while eng.has_unfinished():
        outs = eng.step()
        for seq in eng.scheduler.running:
            st = seq.policy_state
            acct = st.acct
            floor = acct.held_bytes(4 + CHUNK, 4 + CHUNK)
            slack = acct.held_bytes(CHUNK, CHUNK) - acct.fixed_bytes
            held = ret.held_bytes(seq.kv, st)
            assert held <= max(0.25 * acct.full_bytes(seq.num_computed), floor) + slack
            # The pool agrees: the sequence's blocks are exactly the ones in use (plus the null block);
            # its frozen (compressed) blocks share the arena hosts the compressed store took from it.
            assert eng.cache.pool.num_used == pool_blocks(eng.cache, seq.kv) + 1
    usage = outs[-1].kv_usage
    assert usage.tokens_discarded > 0 and usage.tokens_full + usage.tokens_key_only < 260
    assert 0 < usage.peak_kv_bytes < eng.cache.blocks_for_tokens(260) * eng.cache.spec.block_bytes
    assert eng.cache.num_free == eng.cache.num_blocks  # every block is back


def test_per_request_policy_and_stats(loaded) -> None:
    eng = make_engine(loaded)  # engine default: full cache
    with pytest.raises(InvalidRequest) as err:
        eng.add_request("x", prompt(40), SamplingParams(max_tokens=2, kv_policy="h2o"))  # no budget
    assert err.value.param == "kv_policy"
    eng.add_request("f", prompt(150), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.add_request("c", prompt(150, 1), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                       kv_policy="conf-kv", kv_budget=0.25))
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    # 150 prompt + 4 generated tokens; the last sampled token was never run, so 153 are cached.
    assert final["f"].kv_usage.tokens_discarded == 0 and final["f"].kv_usage.tokens_full == 153
    assert final["c"].kv_usage.tokens_discarded > 0
    assert final["c"].kv_usage.peak_kv_bytes < final["f"].kv_usage.peak_kv_bytes
    s = eng.stats()
    assert s.kv_bytes_full + s.kv_bytes_key_only == s.kv_bytes_used


class GreedyAdmission:
    """Retention's chunk alignment without its reservations (so the pool runs out and preempts)."""

    def __init__(self, inner: AdmissionPolicy) -> None:
        self.inner = inner

    def reserved_headroom(self, seq) -> None:
        return None

    def chunk_alignment(self, seq) -> int:
        return self.inner.chunk_alignment(seq)

    def chunk_limit(self, seq) -> int | None:
        return self.inner.chunk_limit(seq)


def _greedy(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    return eng.generate(prompts, params)


def test_preempted_requests_replay_to_the_same_greedy_tokens(loaded) -> None:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    prompts = [prompt(n, i) for i, n in enumerate([40, 90, 130, 70, 160, 50, 110, 100])]
    solo = [_greedy(make_engine(loaded, retention=conf_kv(0.5)), [p], params)[0] for p in prompts]
    eng = make_engine(loaded, blocks=40, retention=conf_kv(0.5))
    # Budget reservations at admission would avoid preemption; admit greedily to force replays.
    eng.scheduler.admission = GreedyAdmission(eng.retention)
    together = _greedy(eng, prompts, params)
    assert eng.scheduler.num_preemptions > 0
    for a, b in zip(solo, together, strict=True):
        if a.output_token_ids == b.output_token_ids:
            continue
        pairs = zip(a.output_token_ids, b.output_token_ids, strict=True)
        i = next(k for k, (x, y) in enumerate(pairs) if x != y)
        top = a.logprobs[i].top
        assert top[0][1] - top[1][1] < 1e-3, f"diverged at {i} with a clear winner"
