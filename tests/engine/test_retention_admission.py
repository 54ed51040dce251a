"""Admission under a retention budget (the budget is reserved, not the full length) and the
pressure budget mode (applied only when the pool runs short). Tiny random Llama, fp32."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import InvalidRequest, SamplingParams
from confkv_engine.model.loader import load_model
from tests.engine.test_retention_engine import make_engine, prompt
from tests.engine.tiny_models import make_tiny_hf_model

pytest.importorskip("transformers")

PROMPT, GEN = 200, 60  # 260 tokens: 34 blocks as a full cache (K and V, block 16)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    _, model_dir = make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny-adm"))
    return load_model(str(model_dir), dtype=torch.float32, device="cpu")


def params(**extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, **extra)


def budgeted(**extra) -> SamplingParams:
    return params(kv_policy="conf-kv", kv_budget=0.25, **extra)


def reservation(eng: LLMEngine) -> int:
    cfg = eng.retention.config_for("conf-kv", 0.25)
    blocks = eng.retention.reserve_blocks(cfg, PROMPT + GEN)
    assert blocks is not None
    return blocks


def run(eng: LLMEngine) -> tuple[dict, int]:
    """Step to the end; final outputs by id and the most sequences running in one step."""
    final, most = {}, 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        most = max(most, len(eng.scheduler.running))
    return final, most


def test_budgeted_request_fits_a_pool_too_small_for_its_full_length(loaded) -> None:
    probe = make_engine(loaded)
    need = reservation(probe)
    full_blocks = probe.cache.blocks_for_tokens(PROMPT + GEN)
    assert need < full_blocks
    eng = make_engine(loaded, blocks=need)  # room for the reservation, not the full length
    with pytest.raises(InvalidRequest) as err:
        eng.add_request("full", prompt(PROMPT), params())
    assert err.value.code == "kv_cache_too_small"
    eng.add_request("conf", prompt(PROMPT), budgeted())
    final, _ = run(eng)
    out = final["conf"]
    assert out.finish_reason == "length" and len(out.output_token_ids) == GEN
    assert eng.scheduler.num_preemptions == 0 and out.num_preemptions == 0
    assert out.kv_usage.tokens_discarded > 0
    # One block short of the reservation: judged never-fit up front instead of thrashing.
    small = make_engine(loaded, blocks=need - 1)
    with pytest.raises(InvalidRequest):
        small.add_request("conf", prompt(PROMPT), budgeted())


@pytest.mark.parametrize("copies", [1, 2])
def test_admission_holds_back_what_running_budgets_may_still_take(loaded, copies: int) -> None:
    need = reservation(make_engine(loaded))
    # Pool for `copies` reservations plus part of another: at most `copies` run at once. Greedy
    # admission (first chunk fits) would start all three and then preempt.
    eng = make_engine(loaded, blocks=copies * need + need // 2)
    for i in range(3):
        eng.add_request(f"r{i}", prompt(PROMPT, i), budgeted())
    final, most = run(eng)
    assert most == copies
    assert eng.scheduler.num_preemptions == 0
    assert all(len(o.output_token_ids) == GEN for o in final.values())


def test_pressure_mode_applies_the_budget_only_when_the_pool_runs_short(loaded) -> None:
    usage = {}
    for name, extra in [("thresholds", {}), ("pressure", {"budget": 0.25, "budgetMode": "pressure"}),
                        ("always", {"budget": 0.25})]:
        eng = make_engine(loaded, kvPolicy="conf-kv", **extra)
        eng.add_request("a", prompt(PROMPT), params())
        usage[name] = run(eng)[0]["a"].kv_usage
    # With room the pressure budget is not applied: only the thresholds act, as with no budget
    # (usage still names the budget the pressure would bring).
    assert replace(usage["pressure"], effective_kv_budget=None) == usage["thresholds"]
    assert usage["pressure"].effective_kv_budget == usage["always"].effective_kv_budget
    assert usage["always"].tokens_discarded > usage["pressure"].tokens_discarded
    assert usage["always"].peak_kv_bytes < usage["pressure"].peak_kv_bytes
    # 14 blocks: the full 260 tokens would need 34, the thresholds alone (most tokens at int4 once
    # they leave the window) about 15; the budget applies once < 10% are free.
    thr = trajectory(make_engine(loaded, kvPolicy="conf-kv"))  # thresholds alone, any pool
    short = make_engine(loaded, blocks=14, kvPolicy="conf-kv", budget=0.25, budgetMode="pressure")
    seen: list[bool] = []
    probe = short.retention.under_pressure
    short.retention.under_pressure = lambda: seen.append(probe()) or seen[-1]  # type: ignore[method-assign]
    held = trajectory(short, seen)
    first = next(k for k, (_, pressed) in enumerate(held) if pressed)
    # Same bytes as the thresholds alone until the pool ran short, then the budget cut them.
    assert [h for h, _ in held[:first]] == [h for h, _ in thr[:first]]
    assert held[first][0] < thr[first][0]
    assert short.scheduler.num_preemptions == 0


def trajectory(eng: LLMEngine, seen: list[bool] | None = None) -> list[tuple[int, bool]]:
    """Held bytes after each step, and whether the pool was found short at a decision point."""
    eng.add_request("a", prompt(PROMPT), params())
    out: list[tuple[int, bool]] = []
    while eng.has_unfinished():
        before = len(seen) if seen is not None else 0
        eng.step()
        seq = next(iter(eng.scheduler.running), None)
        if seq is not None:  # the policy only acts at decision points (multiples of its interval)
            at_decision = seq.num_computed % seq.policy_state.interval == 0
            pressed = seen is not None and any(seen[before:]) and at_decision
            out.append((eng.retention.held_bytes(seq.kv, seq.policy_state), pressed))
    return out


def test_requests_without_a_budget_never_take_blocks_promised_to_budgeted_ones(loaded) -> None:
    probe = make_engine(loaded)
    need, full_blocks = reservation(probe), probe.cache.blocks_for_tokens(PROMPT + GEN)
    # The full-cache request starts first; the budgeted one is admitted against its reservation.
    # Without the hold-back the full request would grow into the promised blocks and the budgeted
    # request (the most recently admitted) would be the one preempted.
    eng = make_engine(loaded, blocks=need + full_blocks - 8)
    eng.add_request("full", prompt(PROMPT, 1), params())
    eng.add_request("conf", prompt(PROMPT, 2), budgeted())
    final, most = run(eng)
    assert most == 2
    assert final["conf"].num_preemptions == 0
    assert final["full"].num_preemptions >= 1
    assert all(len(o.output_token_ids) == GEN for o in final.values())


def test_tiered_requests_run_within_their_reservations(loaded) -> None:
    """Precision tiers under admission: frozen blocks live in shared arena hosts and count at their
    bytes against the reservation, so two reservations (and part of a third) run two at a time."""
    tiers = ("full", "int4", "int2")
    probe = make_engine(loaded)
    need = probe.retention.reserve_blocks(probe.retention.config_for("conf-kv", 0.5, tiers), PROMPT + GEN)
    assert need is not None
    eng = make_engine(loaded, blocks=2 * need + need // 2)
    for i in range(3):
        eng.add_request(f"r{i}", prompt(PROMPT, i),
                        params(kv_policy="conf-kv", kv_budget=0.5, kv_tiers=tiers))
    final, most = run(eng)
    assert most == 2 and eng.scheduler.num_preemptions == 0
    assert all(len(o.output_token_ids) == GEN for o in final.values())
    assert all(o.kv_usage.tokens_int4 > 0 for o in final.values())
