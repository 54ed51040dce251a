"""The budget basis: what a fractional budget is a fraction of (``RetentionConfig.budget_basis``).

"final" takes the full cache at the request's final length (prompt + max_tokens, what admission
reserves) at every step; "length" the full cache at the current length. Pure arithmetic on a
``RetentionState`` over a hand-made accounting: blocks of 4 tokens, a FULL block pair 100 bytes.
"""

from __future__ import annotations

import pytest

from confkv_api.config import ConfKVSection
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.runtime import RetentionState
from confkv_engine.retention.tiers import KVAccounting, TierConfig

TIERS = TierConfig(sinks=1, window=4, key_only=False, precisions=("int4",), precision_window=4,
                   precision_floor=None)


def _state(basis: str, max_len: int | None, budget: float = 0.5) -> RetentionState:
    cfg = RetentionConfig(policy="conf-kv", tiers=TIERS, budget=budget, budget_basis=basis)
    acct = KVAccounting(block_size=4, half_block_bytes=50, pair_bytes=((4, 30),))
    return RetentionState(cfg=cfg, acct=acct, num_layers=1, num_kv_heads=1, head_dim=4, group=1, interval=4,
                          max_len=max_len)


def test_final_basis_holds_the_budget_at_the_final_length_from_the_first_token() -> None:
    final, length = _state("final", 64), _state("length", 64)
    # 0.5 x 64 tokens' FULL bytes (16 block pairs of 100) = 800 at every length up to 64.
    assert [final.target_bytes(n, False) for n in (8, 16, 40, 64)] == [800, 800, 800, 800]
    # (At 8 tokens the floor, sinks + window = 5 tokens in 2 blocks, is above 0.5 x 8 tokens.)
    assert [length.target_bytes(n, False) for n in (8, 16, 40, 64)] == [200, 200, 500, 800]
    # The fraction reported is of the basis: the requested one, not 800 / the bytes of 16 tokens.
    assert final.effective_budget(16) == 0.5 and length.effective_budget(16) == 0.5
    # A decision leaves room for the next interval's 4 FULL tokens (one block pair) under the same target.
    assert final.decision_target(16, False) == 700


def test_final_basis_never_holds_more_than_admission_reserves() -> None:
    state = _state("final", 100, budget=0.25)
    reserved = state.target_bytes(100, False)
    for n in range(8, 100, 4):
        kept = state.decision_target(n, False)
        for k in range(1, 5):
            assert kept + state.acct.held_bytes(k, k) <= reserved, (n, k)


def test_without_a_final_length_the_basis_is_the_current_length() -> None:
    unknown = _state("final", None)  # the offline drivers do not know a request's max_tokens
    assert [unknown.target_bytes(n, False) for n in (16, 64)] == [200, 800]
    past = _state("final", 32)  # never under the current length's budget
    assert past.target_bytes(64, False) == 800


def test_the_basis_is_validated_once_and_defaults_to_final() -> None:
    assert RetentionConfig().budget_basis == "final"
    assert ConfKVSection.model_validate({}).budget_basis == "final"
    assert ConfKVSection.model_validate({"budgetBasis": "length"}).budget_basis == "length"
    with pytest.raises(ValueError, match="budget basis"):
        RetentionConfig(policy="conf-kv", budget=0.5, budget_basis="peak")
    with pytest.raises(ValueError):
        ConfKVSection.model_validate({"budgetBasis": "peak"})
