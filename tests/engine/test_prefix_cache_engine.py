"""Prefix cache through LLMEngine on the embedded SmolLM2-135M (fp32): the same greedy tokens with
the cache on and off (long shared system prompt, chunked prefill, continuous batching, a pool small
enough to preempt), hits reported per request and in the stats, prompt logprobs computed for every
row, and retention coexisting with shared prefixes (tokens after the prefix evicted, the shared
blocks untouched; only requests whose tiers never changed register their blocks).

Where greedy tokens differ, the cache-off top-2 logit gap at the first difference must be < 1e-3:
a shared prefix changes which rows run together, so float order may flip a near tie."""

from __future__ import annotations

import pytest
import torch

from confkv_api.config import ConfKVConfig
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.outputs import RequestOutput
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.core.sequence import Sequence
from confkv_engine.model.loader import LoadedModel, load_model

torch.set_num_threads(1)

SYSTEM = (
    "You are a careful assistant for a public library. Answer questions about opening hours, "
    "borrowing rules and events. Opening hours: Monday to Friday from nine in the morning to eight "
    "in the evening, Saturday from ten to five, closed on Sunday and public holidays. Members may "
    "borrow up to twelve items for three weeks and renew them twice online unless another member "
    "has reserved them. Late returns cost twenty cents per item per day, capped at five euros. "
    "Events this month: a reading club every Tuesday evening, a coding workshop for teenagers on "
    "Saturday mornings and a talk about local history on the last Thursday. A lost card is replaced "
    "for two euros at the front desk with an identity document. Wi-Fi is free for everyone and its "
    "password changes every Monday. Be brief and polite.\n"
)
QUESTIONS = [
    "User: When can I visit on Saturday?\nAssistant:",
    "User: How many books may I borrow, and for how long?\nAssistant:",
    "User: What does it cost if I return a book a week late?\nAssistant:",
    "User: Is there anything for teenagers who like computers?\nAssistant:",
]
TAIL = (
    "User: Please summarise the following note for me. The committee met on Monday to discuss the "
    "renovation of the reading room. The budget was approved after a long debate about the cost of "
    "new shelves, the lighting and the heating. Work starts in spring and should end before the "
    "summer holidays, when the room reopens with more seats and quiet study desks.\nAssistant:"
)
NEW = 16
BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("builtin:smollm2-135m", dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def system(loaded) -> list[int]:
    ids = loaded.tokenizer.encode(SYSTEM)
    assert len(ids) > 8 * BS and len(ids) % BS  # long, and ends inside a block
    return ids


@pytest.fixture(scope="module")
def prompts(loaded, system) -> list[list[int]]:
    asked = [system + loaded.tokenizer.encode(q) for q in QUESTIONS]
    return [*asked, asked[0]]  # the last one repeats a whole prompt


def make_engine(loaded, prefix_cache: bool = True, blocks: int | None = None, **confkv) -> LLMEngine:
    args = loaded.model.args
    block_bytes = args.num_layers * args.num_kv_heads * (args.head_dim * 4 + 4) * BS
    size = str((blocks + 1) * block_bytes) if blocks else "64Mi"  # + the null block
    cfg = ConfKVConfig.model_validate({
        "engine": {"prefillChunk": 32, "maxNumBatchedTokens": 64, "blockSize": BS},
        "confkv": {"maxCacheSize": size, "prefixCache": {"enabled": prefix_cache}, **confkv}})
    eng = LLMEngine(loaded, cfg)
    assert blocks is None or eng.cache.num_blocks == blocks
    return eng


def run_staggered(eng: LLMEngine, prompts: list[list[int]],
                  params: SamplingParams) -> tuple[list[RequestOutput], list[Sequence]]:
    """The first prompt alone until its prompt is computed, then all the others at once (so they
    can share its blocks while it decodes); outputs and sequences in prompt order."""
    ids = [f"r{i}" for i in range(len(prompts))]
    seqs: list[Sequence] = []
    final: dict[str, RequestOutput] = {}

    def add(i: int) -> None:
        eng.add_request(ids[i], prompts[i], params)
        seqs.append(eng._seqs[ids[i]])

    def step() -> None:
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out

    add(0)
    while seqs[0].num_computed < len(prompts[0]) and not seqs[0].finished:
        step()
    for i in range(1, len(prompts)):
        add(i)
    while eng.has_unfinished():
        step()
    return [final[rid] for rid in ids], seqs


def drain(eng: LLMEngine) -> dict[str, RequestOutput]:
    """Step until nothing is left; the final output of every request that finished."""
    final = {}
    while eng.has_unfinished():
        final.update((o.request_id, o) for o in eng.step() if o.finished)
    return final


def assert_same_or_near_tie(got: list[RequestOutput], ref: list[RequestOutput]) -> None:
    for g, r in zip(got, ref, strict=True):
        assert len(g.output_token_ids) == len(r.output_token_ids) == NEW
        diff = next((i for i, (x, y) in enumerate(zip(g.output_token_ids, r.output_token_ids, strict=True))
                     if x != y), None)
        if diff is not None:
            top = r.logprobs[diff].top
            assert top[0][1] - top[1][1] < 1e-3, f"{g.request_id}: differs at {diff} with a clear top-2 gap"


@pytest.fixture(scope="module")
def cache_off(loaded, prompts) -> list[RequestOutput]:
    eng = make_engine(loaded, prefix_cache=False)
    outs, seqs = run_staggered(eng, prompts, GREEDY)
    assert eng.stats().prefix_hit_tokens == 0 and not eng.stats().prefix_cache_enabled
    assert all(s.prefix_len == 0 for s in seqs) and len(eng.cache.eviction) == 0
    return outs


def test_second_request_reports_the_hit(loaded, prompts, system) -> None:
    eng = make_engine(loaded)
    _, seqs = run_staggered(eng, prompts[:2], GREEDY)
    shared = len(system) // BS * BS
    assert [s.prefix_len for s in seqs] == [0, shared]
    stats = eng.stats()
    assert stats.prefix_cache_enabled and stats.prefix_hit_tokens == shared
    assert stats.prefix_queried_tokens == len(prompts[0]) + len(prompts[1])
    assert stats.prefix_hit_ratio_window == pytest.approx(shared / stats.prefix_queried_tokens)
    assert stats.num_free_blocks == eng.cache.num_blocks  # every block free or evictable
    assert stats.kv_bytes_evictable == eng.cache.num_cached_blocks * eng.cache.spec.block_bytes > 0


def test_greedy_equal_with_cache_on_and_off(loaded, prompts, system, cache_off) -> None:
    eng = make_engine(loaded)
    outs, seqs = run_staggered(eng, prompts, GREEDY)
    assert_same_or_near_tie(outs, cache_off)
    shared = len(system) // BS * BS
    whole = (len(prompts[0]) - 1) // BS * BS  # a repeated prompt shares all but its last token
    assert [s.prefix_len for s in seqs] == [0, shared, shared, shared, whole]
    assert eng.stats().prefix_hit_tokens == 3 * shared + whole


def test_greedy_equal_with_preemption(loaded, prompts, cache_off) -> None:
    probe = make_engine(loaded)
    need = [probe.cache.blocks_for_tokens(len(p) + NEW) for p in prompts]
    blocks = max(need) + 8  # the longest fits alone; the batch, even sharing its prefix, does not
    on, off = make_engine(loaded, blocks=blocks), make_engine(loaded, prefix_cache=False, blocks=blocks)
    outs_on, seqs_on = run_staggered(on, prompts, GREEDY)
    outs_off, _ = run_staggered(off, prompts, GREEDY)
    assert on.stats().num_preemptions > 0 and off.stats().num_preemptions > 0
    assert on.stats().prefix_hit_tokens > 0
    assert_same_or_near_tie(outs_on, cache_off)
    assert_same_or_near_tie(outs_off, cache_off)
    assert on.stats().num_free_blocks == blocks and off.stats().num_free_blocks == blocks


def test_prompt_logprobs_compute_every_row(loaded, prompts) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    echoes = {}
    for enabled in (True, False):
        eng = make_engine(loaded, prefix_cache=enabled)
        eng.generate([prompts[0]], GREEDY)  # caches the prompt's blocks when enabled
        eng.add_request("echo", prompts[1], params)
        seq = eng._seqs["echo"]
        out = drain(eng)["echo"]
        assert seq.prefix_len == 0 and out.prompt_logprobs is not None
        assert len(out.prompt_logprobs) == len(prompts[1]) and out.prompt_logprobs[0] is None
        echoes[enabled] = out
    on, off = echoes[True].prompt_logprobs, echoes[False].prompt_logprobs
    for a, b in zip(on[1:], off[1:], strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert echoes[True].output_token_ids == echoes[False].output_token_ids


def prefix_blocks(eng: LLMEngine, system: list[int]) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Block ids of the cached system prompt (K then V) and a copy of their contents."""
    entries = eng.cache.match(system, len(system) // BS)
    assert len(entries) == len(system) // BS
    ids = [e.k_block for e in entries] + [e.v_block for e in entries]
    k_slots = torch.tensor([e.k_block * BS + i for e in entries for i in range(BS)])
    return ids, {"kv": eng.cache.kv[:, ids].clone(), "pos": eng.cache.pos[:, k_slots].clone()}


# Requests default to the full cache (no server budget: one would make conf-kv the default); the
# retained ones bring their policy and budget.
RETAINABLE = {"window": 32}


@pytest.mark.parametrize("policy", ["conf-kv", "h2o"])
def test_retention_evicts_after_a_shared_prefix_and_never_touches_it(loaded, system, policy) -> None:
    eng = make_engine(loaded, **RETAINABLE)
    eng.generate([system + loaded.tokenizer.encode(QUESTIONS[0])], GREEDY)
    ids, before = prefix_blocks(eng, system)
    indexed = len(eng.cache.prefix)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, kv_policy=policy, kv_budget=0.25)
    eng.add_request("ret", system + loaded.tokenizer.encode(TAIL), params)
    seq = eng._seqs["ret"]
    out = None
    while eng.has_unfinished():
        out = next((o for o in eng.step() if o.finished), out)
        if not seq.finished:
            assert seq.kv.k_blocks[:len(ids) // 2] == ids[:len(ids) // 2]  # still the shared blocks
    assert seq.prefix_len == len(system) // BS * BS
    u = out.kv_usage  # it acted: h2o drops tokens, conf-kv's default precision chain quantizes or drops
    demoted = u.tokens_discarded + u.tokens_int8 + u.tokens_int4 + u.tokens_k4v2 + u.tokens_int2
    assert seq.policy_state.first_eviction is not None and demoted > 0
    after_ids, after = prefix_blocks(eng, system)
    assert after_ids == ids
    assert torch.equal(after["kv"], before["kv"]) and torch.equal(after["pos"], before["pos"])
    assert len(eng.cache.prefix) == indexed  # its tiers changed: none of its blocks registered
    assert eng.cache.num_free == eng.cache.num_blocks


def test_a_retained_request_whose_tiers_never_changed_registers(loaded, system) -> None:
    eng = make_engine(loaded, **RETAINABLE)
    eng.generate([system + loaded.tokenizer.encode(QUESTIONS[0])], GREEDY)
    indexed = len(eng.cache.prefix)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, kv_policy="h2o", kv_budget=1.0)
    eng.add_request("kept", system + loaded.tokenizer.encode(TAIL), params)
    seq = eng._seqs["kept"]
    out = drain(eng)["kept"]
    assert seq.policy_state is not None and seq.policy_state.first_eviction is None
    assert out.kv_usage.tokens_discarded == 0 and seq.prefix_len == len(system) // BS * BS
    assert len(eng.cache.prefix) == indexed + seq.final_slots // BS - len(system) // BS
    # Its blocks serve the next request with the same prompt.
    eng.generate([system + loaded.tokenizer.encode(TAIL)], GREEDY)
    assert eng.stats().prefix_hit_tokens == seq.prefix_len + (len(seq.prompt_token_ids) - 1) // BS * BS
