"""Retention on the real paged cache (tiny random model, no scheduler): budget invariant after every
step, blocks back in the pool, exactness when nothing is evicted, KEY_ONLY frees V blocks."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.cache.kv_cache import CacheSpec, KVCache
from confkv_engine.model.llama import DenseAttention, LlamaForCausalLM
from confkv_engine.retention.manager import RetentionManager
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.scorer import ScorerConfig
from confkv_engine.retention.tiers import TierConfig
from testkit.drivers.offline import run_sequence
from testkit.drivers.tiny_model import tiny_model

CHUNK, BLOCK = 32, 16


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_model()


@pytest.fixture()
def cache() -> KVCache:
    return KVCache(CacheSpec(2, 2, 16, BLOCK, torch.float32, torch.device("cpu")), 120)


def _tokens(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(model: LlamaForCausalLM, toks: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(toks), torch.arange(len(toks)), DenseAttention()))
    lp = torch.log_softmax(logits[:-1], -1)
    return lp.gather(-1, torch.tensor(toks[1:])[:, None]).squeeze(-1)


def test_nothing_evicted_matches_dense_reference(model, cache) -> None:
    cfg = RetentionConfig(policy="conf-kv", tiers=TierConfig(high=0.01, medium=0.0, window=CHUNK))
    run = run_sequence(model, cache, RetentionManager(cache, 4, cfg, CHUNK), cfg, _tokens(200), CHUNK)
    torch.testing.assert_close(run.logprobs, _reference(model, _tokens(200)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", ["streaming", "h2o", "conf-kv", "conf-kv-discard"])
@pytest.mark.parametrize("f", [0.5, 0.25])
def test_budget_invariant_after_every_step_and_blocks_return(model, cache, policy: str, f: float) -> None:
    cfg = RetentionConfig(policy=policy, tiers=TierConfig(window=CHUNK, high=0.9, medium=0.3), budget=f)
    manager = RetentionManager(cache, 4, cfg, CHUNK)
    free_before = cache.pool.num_free
    run = run_sequence(model, cache, manager, cfg, _tokens(320), CHUNK)
    acct = manager.new_state(cfg).acct
    chunk_bytes = acct.held_bytes(CHUNK, CHUNK) - acct.fixed_bytes
    for length, held in zip(run.lengths, run.peak_before, strict=True):
        floor = acct.held_bytes(4 + CHUNK, 4 + CHUNK)
        assert held <= max(f * acct.full_bytes(length), floor) + chunk_bytes, (length, held)
    # Memory really went back: the held bytes at the end are well under the full cache's.
    assert run.held_bytes[-1] < 0.5 * acct.full_bytes(run.lengths[-1]) + chunk_bytes
    # Every block is back after the sequence ends (the null block was never handed out).
    assert cache.num_free == free_before and cache.pool.ref_count(cache.null_block) == 1


def test_compaction_frees_blocks_in_the_same_step(model, cache) -> None:
    cfg = RetentionConfig(policy="streaming", tiers=TierConfig(window=CHUNK), budget=0.25)
    run = run_sequence(model, cache, RetentionManager(cache, 4, cfg, CHUNK), cfg, _tokens(256), CHUNK)
    # Free blocks stop shrinking once the budget binds: the pool gets blocks back every step.
    assert min(run.free_blocks[-4:]) > min(run.free_blocks[:2]) - 6
    assert max(run.held_bytes[-4:]) <= run.peak_before[-1]


def test_key_only_tier_frees_values(model, cache) -> None:
    # Everything leaving the window becomes KEY_ONLY (medium 0, high 1): V blocks of old tokens go.
    cfg = RetentionConfig(policy="conf-kv", tiers=TierConfig(high=1.0, medium=0.0, sinks=4, window=CHUNK),
                          scorer=ScorerConfig(mode="attention"))
    manager = RetentionManager(cache, 4, cfg, CHUNK)
    from confkv_engine.attention.retention import RetentionAttention
    from confkv_engine.cache.kv_cache import SeqKV

    backend, seq, state = RetentionAttention(cache, 4), SeqKV(), manager.new_state(cfg)
    _run_chunks(model, cache, manager, backend, seq, state, _tokens(160))
    full, key_only, discarded = state.tier_counts(160)
    assert (full, key_only, discarded) == (4 + CHUNK, 160 - 4 - CHUNK, 0)
    nulls = sum(b == cache.null_block for b in seq.v_blocks)
    assert nulls == key_only // BLOCK and len(seq.k_blocks) == 10
    assert manager.held_bytes(seq, state) == state.acct.held_bytes(160, full)
    # KEY_ONLY slots come first per unit, in position order, then FULL (sinks, window).
    assert state.pos[0, 0, :key_only].tolist() == list(range(4, 4 + key_only))
    assert float(state.v_weight.min()) > 0
    cache.free(seq)


def test_null_block_survives_sequences_that_end(model, cache) -> None:
    cfg = RetentionConfig(policy="conf-kv", tiers=TierConfig(high=1.0, medium=0.0, window=CHUNK),
                          scorer=ScorerConfig(mode="attention"))
    manager = RetentionManager(cache, 4, cfg, CHUNK)
    for seed in (1, 2):  # the second sequence reuses the null block after the first freed its entries
        run_sequence(model, cache, manager, cfg, _tokens(128, seed), CHUNK)
        assert cache.pool.ref_count(cache.null_block) == 1
    assert cache.num_free == cache.num_blocks


def _run_chunks(model, cache, manager, backend, seq, state, toks: list[int]) -> None:
    """Feed ``toks`` in chunks of CHUNK through the retention backend, the policy after each."""
    with torch.inference_mode():
        for start in range(0, len(toks), CHUNK):
            cache.reserve(seq, CHUNK)
            pos = torch.arange(start, start + CHUNK)
            backend.begin_step([seq], [CHUNK], pos, [state])
            model(torch.tensor(toks[start:start + CHUNK]), pos, backend)
            backend.end_step()
            manager.after_step(seq, state, start + CHUNK)


class _RecordingDense(DenseAttention):
    """Dense reference that also keeps each layer's attention probabilities, summed per KV head."""

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group, self.probs = group, {}

    def attend(self, layer, q, k, v):
        out = super().attend(layer, q, k, v)
        keys = self.keys[layer].float().repeat_interleave(self.group, dim=1)
        s = keys.shape[0]
        scores = torch.einsum("thd,shd->hts", q.float(), keys) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1)[None], float("-inf"))
        self.probs[layer] = scores.softmax(-1).view(-1, self.group, s, s).sum(1)  # [Hkv, T, S]
        return out


def test_signal_recomputed_at_decision_points_equals_every_query(model, cache) -> None:
    # The fused forward records queries; score_pending recomputes their probabilities at each
    # decision point. The accumulators must equal folding every query of a dense reference.
    from confkv_engine.attention.retention import RetentionAttention
    from confkv_engine.cache.kv_cache import SeqKV

    n, decay = 192, 0.97
    cfg = RetentionConfig(policy="conf-kv", tiers=TierConfig(high=0.01, medium=0.0, window=CHUNK),
                          scorer=ScorerConfig(decay=decay))
    manager = RetentionManager(cache, 4, cfg, CHUNK)
    backend, seq, state = RetentionAttention(cache, 4), SeqKV(), manager.new_state(cfg)
    _run_chunks(model, cache, manager, backend, seq, state, _tokens(n))
    ref = _RecordingDense(group=2)
    with torch.inference_mode():
        model(torch.tensor(_tokens(n)), torch.arange(n), ref)
    weights = decay ** torch.arange(n - 1, -1, -1, dtype=torch.float64)  # query i weighs lam^(t - i)
    visible = torch.ones(n, n, dtype=torch.float64).tril()  # [T, S]
    for layer in range(2):
        acc = torch.einsum("t,hts->hs", weights, ref.probs[layer].double())
        torch.testing.assert_close(state.acc[layer].double(), acc, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(state.norm[layer].double(), (weights @ visible).expand(2, n), atol=1e-6,
                                   rtol=1e-6)
    assert state.take_queries() is None  # the ring was emptied at the last decision point
    cache.free(seq)


class _KeptCacheReference:
    """Attends a decode token over exactly what the sequence keeps: each unit's kept keys, the
    values of FULL slots and the merged mean for KEY_ONLY slots (explicit softmax, no paging)."""

    def __init__(self, cache, seq, state) -> None:
        idx_k = cache.slot_index(seq.k_blocks, torch.arange(state.num_slots))
        idx_v = cache.slot_index(seq.v_blocks, torch.arange(state.num_slots))
        self.k = [cache.kv_flat[layer, idx_k].clone() for layer in range(cache.spec.num_layers)]
        self.v = [cache.kv_flat[layer, idx_v].clone() for layer in range(cache.spec.num_layers)]
        for layer, v in enumerate(self.v):
            v[: state.n_key] = state.v_mean[layer][None]

    def attend(self, layer, q, k, v):
        from confkv_engine.model.llama import dense_causal_attention

        return dense_causal_attention(q, torch.cat([self.k[layer], k]), torch.cat([self.v[layer], v]))


def test_key_only_stand_in_through_the_fused_path_matches_explicit_reference(model, cache) -> None:
    from confkv_engine.attention.retention import RetentionAttention
    from confkv_engine.cache.kv_cache import SeqKV

    cfg = RetentionConfig(policy="conf-kv", tiers=TierConfig(high=1.0, medium=0.0, sinks=4, window=CHUNK))
    manager = RetentionManager(cache, 4, cfg, CHUNK)
    backend, seq, state = RetentionAttention(cache, 4), SeqKV(), manager.new_state(cfg)
    _run_chunks(model, cache, manager, backend, seq, state, _tokens(160))
    assert state.n_key == 160 - 4 - CHUNK and float(state.v_mean.abs().sum()) > 0
    token, pos = torch.tensor([7]), torch.tensor([160])
    with torch.inference_mode():
        expected = model.compute_logits(model(token, pos, _KeptCacheReference(cache, seq, state)))
        cache.reserve(seq, 1)
        backend.begin_step([seq], [1], pos, [state])
        got = model.compute_logits(model(token, pos, backend))
        backend.end_step()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    cache.free(seq)


@pytest.mark.parametrize("granularity", ["layer", "token"])
def test_coarser_granularity_keeps_the_same_tokens_across_units(model, cache, granularity: str) -> None:
    from confkv_engine.attention.retention import RetentionAttention
    from confkv_engine.cache.kv_cache import SeqKV

    # 0.5: at 0.25 of 256 tokens the room left for the next chunk brings the target to the floor
    # (sinks + window), where every unit keeps the same tokens whatever the granularity.
    tiers = TierConfig(window=CHUNK, granularity=granularity)
    cfg = RetentionConfig(policy="conf-kv", tiers=tiers, budget=0.5)
    manager = RetentionManager(cache, 4, cfg, CHUNK)
    backend, seq, state = RetentionAttention(cache, 4), SeqKV(), manager.new_state(cfg)
    _run_chunks(model, cache, manager, backend, seq, state, _tokens(256))
    assert state.tier_counts(256)[2] > 0  # tokens were discarded
    same = state.pos[:, :1] if granularity == "layer" else state.pos[:1, :1]
    assert torch.equal(state.pos, same.expand_as(state.pos))
    head_cfg = RetentionConfig(policy="conf-kv", tiers=TierConfig(window=CHUNK), budget=0.5)
    other, seq2 = manager.new_state(head_cfg), SeqKV()
    cache.free(seq)
    _run_chunks(model, cache, RetentionManager(cache, 4, head_cfg, CHUNK), backend, seq2, other, _tokens(256))
    assert not torch.equal(other.pos, other.pos[:1, :1].expand_as(other.pos))  # per head: they differ
    cache.free(seq2)
