"""Precision tiers through LLMEngine (tiny random Llama, fp32): the bytes the pool holds equal the
budget walk's accounting after every step, greedy replay after preemption is identical, and a
shared prefix block is never recompressed or demoted by one of its readers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from confkv_engine.cache import prefix_cache as prefix_cache_module
from confkv_engine.cache.tiered import freeze_blocks, requantize_block
from confkv_engine.core.sampling_params import InvalidRequest, SamplingParams
from confkv_engine.retention import compaction, precision
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.scorer import ScorerConfig, attention_signal
from confkv_engine.retention.tiers import Tier, TierConfig
from tests.engine.test_retention_engine import CHUNK, GreedyAdmission, loaded, make_engine, prompt

__all__ = ["loaded"]  # the module fixture, shared with the retention engine tests

pytest.importorskip("transformers")

TIERS = TierConfig(window=CHUNK, medium=0.3, key_only=False, precisions=("int4", "int2"), precision_group=16)


def tiered(f: float, scale: float | None = None, **changes) -> RetentionConfig:
    """``scale``: the precision chain's confidence scale (None: the default)."""
    scoring = ScorerConfig() if scale is None else ScorerConfig(precision_scale=scale)
    # The length basis: the budget binds from early on, so a short request passes through every tier.
    return RetentionConfig(policy="conf-kv", tiers=replace(TIERS, **changes), budget=f, scorer=scoring,
                           budget_basis="length")


def walk_bytes(state) -> int:
    """What ``precision.held_bytes`` says the sequence holds, from its tiers alone."""
    kept = precision.chain_of(state.cfg.tiers)
    rewritable = state.tiers[0, 0, state.key_start:]
    staged = [int((rewritable == t).sum()) for t in kept[1:]]
    n_full = rewritable.numel() - sum(staged)
    return precision.held_bytes(state.acct, state.base, state.frozen_block_tiers(), n_full, staged, kept[1:])


@pytest.mark.parametrize(("f", "changes"), [(0.5, {}), (0.5, {"freeze_order": "confidence"}),
                                           (0.5, {"precision_window": None}),
                                           (0.35, {"precisions": ("int4", "k4v2"), "scale": 0.3})])
def test_pool_bytes_equal_the_budget_walk_after_every_step(loaded, f: float, changes: dict) -> None:
    # 0.5: at 0.25 of 300 tokens, after the room left for the next chunk, a unit cannot stage the 16
    # tokens a frozen block needs and the walk keeps FULL tokens only (nothing would be frozen); at 0.5
    # every token fits at int4, so the k4v2 chain runs at 0.35. The default window (8) is under the
    # decision interval (CHUNK): a precision chain may run one; None is the interval's window. The
    # k4v2 chain runs at the confidence scale of 0.3: at the default 4 this random model's near-uniform
    # attention makes dropping its least attended tokens cheaper than k4v2 at every budget tried
    # (0.27-0.35), and the bookkeeping under test is the same at any scale.
    eng = make_engine(loaded, retention=tiered(f, **changes))
    eng.add_request("a", prompt(300), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    frozen_seen, tiers_seen = 0, set()
    while eng.has_unfinished():
        outs = eng.step()
        for seq in eng.scheduler.running:
            st = seq.policy_state
            held = eng.retention.held_bytes(seq.kv, st)
            assert held == walk_bytes(st), seq.num_computed
            floor = st.acct.held_bytes(4 + CHUNK, 4 + CHUNK)
            slack = st.acct.held_bytes(CHUNK, CHUNK)
            assert held <= max(f * st.acct.full_bytes(st.basis_length(seq.num_computed)), floor + slack)
            frozen_seen = max(frozen_seen, st.frozen)
            tiers_seen.update(name for name, n in st.precision_counts().items() if n)
            # Frozen blocks are compressed handles in both tables; the rest are pool blocks.
            nb = st.key_start // 16
            assert all(b < 0 for b in seq.kv.k_blocks[:nb] + seq.kv.v_blocks[:nb])
            assert all(b >= 0 for b in seq.kv.k_blocks[nb:])
    usage = outs[-1].kv_usage
    assert frozen_seen > 0 and usage.tokens_int4 + usage.tokens_int2 > 0
    assert set(changes.get("precisions", ())) <= tiers_seen  # every tier of the chain was held
    assert eng.cache.num_free == eng.cache.num_blocks and len(eng.cache.store) == 0  # all back


def test_confidence_freeze_order_fills_blocks_from_the_most_attended_staged_tokens(loaded,
                                                                                  monkeypatch) -> None:
    # Each freeze: per unit, the blocks hold the tier's staged tokens by attention signal, high to
    # low, and every token left staged is below all of them (it stays individually droppable).
    frozen_now: list[tuple[int, list[int]]] = []
    real = compaction.freeze_blocks

    def recording(cache, seq, start, bits, group):
        frozen_now.append((start, list(bits)))
        return real(cache, seq, start, bits, group)

    monkeypatch.setattr(compaction, "freeze_blocks", recording)
    eng = make_engine(loaded, retention=tiered(0.5, freeze_order="confidence"))
    eng.add_request("a", prompt(300), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    checked = 0
    while eng.has_unfinished():
        frozen_now.clear()
        eng.step()
        for seq in eng.scheduler.running:
            st = seq.policy_state
            signal = attention_signal(st.acc, st.norm)
            for start, bits in frozen_now:
                for b in set(bits):  # one run of blocks per tier, int4 then int2
                    first, n = 16 * (start + bits.index(b)), 16 * bits.count(b)
                    block = signal[..., first:first + n]
                    assert bool((block[..., :-1] >= block[..., 1:]).all())
                    tier = Tier.INT4 if b == 4 else Tier.INT2
                    staged = (st.tiers == tier) & (torch.arange(st.num_slots) >= st.key_start)
                    rest = torch.where(staged, signal, torch.full_like(signal, -1.0)).amax(-1)
                    assert bool((rest <= block.amin(-1)).all())
                    checked += 1
    assert checked > 0


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_preempted_requests_replay_to_the_same_greedy_tokens(loaded, prefix_cache: bool) -> None:
    # Preemptions free every compressed block of the victims, so arenas empty and their hosts go back
    # to the pool while others run: a replay then decodes over blocks that were hosts. Prompts of
    # 190-260 tokens: at 0.5, shorter ones leave no room for a frozen block once the budget keeps
    # room for the next chunk, and nothing would be tiered.
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    prompts = [prompt(n, i) for i, n in enumerate([190, 230, 260, 210, 200, 240])]
    solo = [make_engine(loaded, retention=tiered(0.5)).generate([p], params)[0] for p in prompts]
    eng = make_engine(loaded, blocks=40, retention=tiered(0.5), prefixCache={"enabled": prefix_cache})
    eng.scheduler.admission = GreedyAdmission(eng.retention)  # no reservations: force preemptions
    together = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    assert any(o.kv_usage.tokens_int4 + o.kv_usage.tokens_int2 for o in solo)
    for a, b in zip(solo, together, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert a.kv_usage.tokens_int4 == b.kv_usage.tokens_int4


@pytest.mark.parametrize("compressed", [False, True])
def test_shared_prefix_blocks_are_never_recompressed_or_demoted(loaded, compressed: bool,
                                                                monkeypatch) -> None:
    if compressed:
        # A hit with blocks to spare decodes compressed entries back (``compress.promote_entry``, its
        # own tests); here the reader must share the handles, as it does when the pool is short.
        monkeypatch.setattr(prefix_cache_module, "promote_entry", lambda cache, entry, spare: (entry, 0))
    eng = make_engine(loaded, prefixCache={"enabled": True})
    shared = prompt(128, 5)
    eng.generate([shared + prompt(8, 6)], SamplingParams(temperature=0, max_tokens=1))  # registers it
    if compressed:  # the cached prefix is int8 compressed blocks: the reader shares handles, not pool ids
        assert eng.compress(bits=8, force=True).blocks == 16
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, kv_policy="conf-kv", kv_budget=0.6,
                            kv_tiers=("full", "int4", "int2"))
    eng.add_request("r", shared + prompt(300, 7), params)
    before, tables, frozen_seen = None, None, False
    while eng.has_unfinished():
        eng.step()
        for seq in eng.scheduler.running:
            st = seq.policy_state
            assert st is not None and st.base == 128
            prefix = seq.kv.k_blocks[:8] + seq.kv.v_blocks[:8]
            data = torch.stack([eng.cache.store.block_data(b) for b in prefix])
            if before is None:
                before, tables = data.clone(), prefix
                assert all((b < 0) == compressed for b in prefix)
            assert prefix == tables and torch.equal(data, before)  # same blocks, same bytes
            assert all(eng.cache.store.ref(b) == 2 for b in prefix)  # the prefix index and this reader
            if st.frozen:
                frozen_seen = True
                assert all(b < 0 for b in seq.kv.k_blocks[8:st.key_start // 16])  # its own frozen blocks
                with pytest.raises(ValueError, match="private blocks"):
                    freeze_blocks(eng.cache, seq.kv, 0, [(4, 4)], 16)
                with pytest.raises(ValueError, match="private blocks"):
                    requantize_block(eng.cache, seq.kv, 0, (2, 2), 16)
    assert frozen_seen
    # Once the reader is gone the index still holds the same blocks with the same bytes.
    assert tables is not None and before is not None
    entries = eng.cache.match(shared, 8)
    assert [e.k_block for e in entries] + [e.v_block for e in entries] == tables
    assert torch.equal(torch.stack([eng.cache.store.block_data(b) for b in tables]), before)


def test_only_a_precision_chain_may_run_a_window_under_the_decision_interval(loaded) -> None:
    eng = make_engine(loaded)
    eng.retention.check(tiered(0.5, precision_window=16))
    short = RetentionConfig(policy="conf-kv", tiers=TierConfig(window=16), budget=0.5)
    with pytest.raises(ValueError, match="must hold a prefill chunk"):
        eng.retention.check(short)


def test_bad_tiers_are_a_clear_request_error(loaded) -> None:
    eng = make_engine(loaded)
    with pytest.raises(InvalidRequest) as err:
        eng.add_request("x", prompt(40), SamplingParams(max_tokens=2, kv_policy="conf-kv", kv_budget=0.5,
                                                       kv_tiers=("full", "int2", "int4")))
    assert err.value.param == "kv_tiers" and "highest first" in str(err.value)
    assert Tier.INT4 in precision.chain_of(TIERS)
