"""Served defaults honour the budget: an engine configured with nothing but ``budget`` (the default
prefill chunk, window and policy) holds at most f x the full cache's bytes wherever that is above the
floor (sinks + the minimal window + one decision chunk), and reports the floor when it binds."""

from __future__ import annotations

import pytest
import torch

from confkv_api.config import ConfKVConfig
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model.loader import load_model
from tests.engine.tiny_models import make_tiny_hf_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    _, model_dir = make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny-defaults"))
    return load_model(str(model_dir), dtype=torch.float32, device="cpu")


def default_engine(loaded, **confkv) -> LLMEngine:
    return LLMEngine(loaded, ConfKVConfig.model_validate({"confkv": {"maxCacheSize": "16Mi", **confkv}}))


def prompt(n: int) -> list[int]:
    return [(i * 31 + 3) % 250 for i in range(n)]


def run_checking(eng: LLMEngine, tokens: list[int], f: float, params: SamplingParams):
    """Steps ``eng`` to the end, checking the budget bound after every step; returns the output."""
    eng.add_request("r", tokens, params)
    interval, final = eng.retention.interval, None
    while final is None:
        for out in eng.step():
            final = out if out.finished else None
        for seq in eng.scheduler.running:
            st = seq.policy_state
            acct = st.acct
            chunk = acct.held_bytes(interval, interval) - acct.fixed_bytes
            floor = acct.held_bytes(4 + interval, 4 + interval)
            budget = f * acct.full_bytes(st.basis_length(seq.num_computed))  # final: prompt + max_tokens
            # A decision leaves room for the next chunk: the budget itself holds, not budget + chunk,
            # wherever it is above the floor plus that chunk.
            if budget >= floor + chunk:
                assert st.peak_bytes <= budget, (seq.num_computed, st.peak_bytes, budget)
    return final


def test_default_engine_with_only_a_budget_holds_it(loaded) -> None:
    eng = default_engine(loaded, budget=0.25)
    assert eng.retention.defaults.policy == "conf-kv"  # a budget alone is enforced, not ignored
    assert eng.retention.interval == 32 < eng.scheduler.prefill_chunk
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    final = run_checking(eng, prompt(490), 0.25, params)  # the tiny model holds 512 tokens
    usage = final.kv_usage
    full_bytes = eng.cache.blocks_for_tokens(490 + 7) * eng.cache.spec.block_bytes
    assert usage.peak_kv_bytes <= 0.25 * full_bytes  # the budget itself, no chunk on top
    assert usage.tokens_full + usage.tokens_key_only < 0.3 * 497
    assert usage.effective_kv_budget == pytest.approx(0.25, abs=0.01)


def test_per_request_budget_on_a_full_cache_engine(loaded) -> None:
    eng = default_engine(loaded)
    assert eng.retention.defaults.policy == "full"
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, kv_budget=0.25)
    final = run_checking(eng, prompt(400), 0.25, params)
    assert final.kv_usage.tokens_discarded > 0
    assert final.kv_usage.effective_kv_budget == pytest.approx(0.25, abs=0.01)
    opt_out = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = eng.generate([prompt(400)], opt_out)[0]
    assert plain.kv_usage.tokens_discarded == 0 and plain.kv_usage.effective_kv_budget is None


def kept_tokens(usage) -> int:
    return (usage.tokens_full + usage.tokens_key_only + usage.tokens_int8 + usage.tokens_int4
            + usage.tokens_k4v2 + usage.tokens_int2)


def test_default_tiers_are_the_precision_chain(loaded) -> None:
    eng = default_engine(loaded, budget=0.5)
    tiers = eng.retention.defaults.tiers
    assert tiers.precisions == ("int4", "k4v2", "int2") and not tiers.uses_key_only
    assert tiers.min_window == 2  # the precision chain's own minimal window
    # Its quantized floor: the FULL chains' floor bytes (4 + 48 + a 16-token interval = 4 + 32 + 32).
    assert tiers.floor_tokens == 4 + 48 and eng.retention.interval_for(eng.retention.defaults) == 16
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    usage = eng.generate([prompt(400)], params)[0].kv_usage
    assert usage.tokens_int4 + usage.tokens_int2 > 0 and usage.tokens_key_only == 0


def test_a_request_picking_conf_kv_on_a_full_server_gets_the_precision_chain(loaded) -> None:
    # The server's default policy is full; the request's kv_budget (or kv_policy conf-kv) is conf-kv
    # with the configured tiers, as on a server started with --kv-policy conf-kv.
    eng = default_engine(loaded)
    assert eng.retention.defaults.policy == "full" and not eng.retention.defaults.uses_precision
    for extra in ({"kv_budget": 0.5}, {"kv_budget": 0.5, "kv_policy": "conf-kv"}):
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, **extra)
        usage = eng.generate([prompt(400)], params)[0].kv_usage
        assert usage.tokens_int4 + usage.tokens_k4v2 + usage.tokens_int2 > 0, extra
        assert usage.tokens_key_only == 0


def test_floor_reported_when_it_makes_the_budget_unreachable(loaded) -> None:
    eng = default_engine(loaded, budget=0.1)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    final = eng.generate([prompt(200)], params)[0]
    # 0.1 x 200 tokens is below the floor (sinks + 48 tokens' bytes for the default precision chain)
    # and a decision chunk: the floor is what it holds.
    assert final.kv_usage.effective_kv_budget > 0.15
    assert kept_tokens(final.kv_usage) >= 4 + eng.retention.defaults.tiers.min_window


def test_budget_in_tokens_scales_the_window(loaded) -> None:
    eng = default_engine(loaded, budgetTokens=128)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    final = eng.generate([prompt(490)], params)[0]
    kept = final.kv_usage.tokens_full + final.kv_usage.tokens_key_only
    assert kept <= 128 + 32  # one decision chunk over the budget at most
    assert final.kv_usage.effective_kv_budget == pytest.approx(128 / 491, abs=0.02)



def test_final_budget_basis_holds_what_admission_reserves_from_the_first_token(loaded) -> None:
    """The default basis takes the budget at prompt + max_tokens at every step, so the sequence holds
    what admission reserved for it from early on; the length basis holds f x what it has so far (down
    to its floor). Both stay within the reservation and end at the same budget."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    held, dropped, usage = {}, {}, {}
    for basis in ("final", "length"):
        eng = default_engine(loaded, budget=0.25, budgetBasis=basis)
        eng.add_request("r", prompt(400), params)
        reserved = eng.retention.reserve_blocks(eng.retention.defaults, 404) * eng.cache.spec.block_bytes
        held[basis], dropped[basis] = {}, {}
        while eng.has_unfinished():
            for out in eng.step():
                usage[basis] = out.kv_usage
            for seq in eng.scheduler.running:
                n, st = seq.num_computed, seq.policy_state
                held[basis][n] = eng.retention.held_bytes(seq.kv, st)
                dropped[basis][n] = st.tier_counts(n)[2]
        assert max(held[basis].values()) <= reserved, basis
        assert usage[basis].peak_kv_bytes <= reserved
    # This tiny model's tokens all fit at int4 under 0.25 x 256 tokens' bytes; past that the length
    # basis drops tokens, the final one holds them until its reservation (0.25 x 404 tokens) is full.
    mid = [n for n in held["final"] if 272 <= n <= 304]
    assert mid and all(dropped["final"][n] == 0 < dropped["length"][n] for n in mid), (dropped, mid)
    assert all(held["final"][n] > held["length"][n] for n in mid), (held, mid)
    assert usage["final"].effective_kv_budget == pytest.approx(0.25, abs=0.01)
    assert usage["length"].effective_kv_budget == pytest.approx(0.25, abs=0.01)
