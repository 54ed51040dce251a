"""Sampling layer: token choice, logprobs, min_tokens, stop strings, incremental detokenization."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel

from confkv_engine.core.sampling import (
    IncrementalDetokenizer,
    OutputTracker,
    apply_min_tokens_mask,
    distribution_stats,
    find_stop,
    greedy_tokens,
    make_generator,
    partial_stop_len,
    plain_greedy,
    prompt_logprobs,
    sample,
    token_logprobs,
)
from confkv_engine.core.sampling_params import SamplingParams
from testkit.gpt2_bytes import gpt2_byte_map

V = 1000
EOS = 256


def _logits(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * 3.0


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: every UTF-8 byte is its own token, so multi-byte characters
    are always split across tokens (the worst case for incremental decoding). 256 = <eos>."""
    byte_map = gpt2_byte_map()
    vocab = {byte_map[b]: b for b in range(256)} | {"<eos>": EOS}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return tok


# ---------------------------------------------------------------- token choice


def test_greedy_rows_take_argmax() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0)] * 6
    assert torch.equal(sample(logits, params, [None] * 6), logits.argmax(-1))


def test_greedy_tokens_equal_argmax_on_ties_and_in_bf16() -> None:
    """The fast greedy path picks what ``argmax`` of the fp32 logits picks: the first maximum on
    ties (here far apart in a wide row), and the same index from bf16 logits as from their fp32
    widening."""
    logits = _logits(4, vocab=300_000).bfloat16()
    logits[0, 7] = logits[0, 299_999] = 50.0
    logits[1, 200_000] = logits[1, 3] = 60.0
    assert greedy_tokens(logits)[:2].tolist() == [7, 3]
    assert torch.equal(greedy_tokens(logits), logits.float().argmax(-1))
    assert torch.equal(greedy_tokens(logits.float()), logits.float().argmax(-1))


def test_plain_greedy_only_without_processing_or_logprobs() -> None:
    plain = SamplingParams(temperature=0.0)
    assert plain_greedy([plain, plain], [0, 5])
    assert not plain_greedy([plain, SamplingParams(temperature=0.0, logprobs=2)], [0, 0])
    assert not plain_greedy([SamplingParams(temperature=0.5)], [0])
    assert not plain_greedy([SamplingParams(temperature=0.0, logit_bias=((3, 5.0),))], [0])
    assert not plain_greedy([SamplingParams(temperature=0.0, presence_penalty=0.5)], [0])
    banned = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=8)
    assert not plain_greedy([banned], [1])
    assert plain_greedy([banned], [2])


def test_sample_leaves_logits_untouched() -> None:
    logits = _logits(3)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9)] * 3
    sample(logits, params, [make_generator(i) for i in range(3)])
    assert torch.equal(logits, before)


def _decode_seeded(row_logits: list[torch.Tensor], neighbours: list[SamplingParams], seed: int) -> list[int]:
    """Sample one seeded row for several steps, with the given other rows in the same batch."""
    me = SamplingParams(temperature=1.3, seed=seed)
    gen = make_generator(seed)
    other_gens = [make_generator(100 + i) if p.seed is not None else None for i, p in enumerate(neighbours)]
    tokens = []
    for step, mine in enumerate(row_logits):
        others = _logits(len(neighbours), seed=1000 + step)
        batch = torch.cat([others, mine[None]]) if neighbours else mine[None]
        out = sample(batch, [*neighbours, me], [*other_gens, gen])
        tokens.append(int(out[-1]))
    return tokens


def test_seed_reproducible_regardless_of_batch_neighbours() -> None:
    steps = [_logits(1, seed=50 + s)[0] for s in range(24)]
    alone = _decode_seeded(steps, [], seed=7)
    neighbours = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=20, seed=3),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=2.0, top_k=1),
    ]
    torch.manual_seed(1234)  # the unseeded neighbour draws from the global RNG
    crowded = _decode_seeded(steps, neighbours, seed=7)
    assert alone == crowded
    assert _decode_seeded(steps, [], seed=7) == alone
    assert _decode_seeded(steps, [], seed=8) != alone  # the seed matters (24 draws from ~1000 tokens)


def test_seeded_filtered_row_independent_of_neighbours_filters() -> None:
    """A top-k/top-p row gives the same tokens whether its group is cut by topk or by a full sort."""
    steps = [_logits(1, seed=80 + s)[0] for s in range(16)]
    me = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=11)
    results = []
    # alone: topk over 40; with a top_p-only row: full sort of the vocabulary; with top_k=3: topk over 40
    others = (None, SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_k=3))
    for neighbour in others:
        gen = make_generator(11)
        toks = []
        for step, mine in enumerate(steps):
            if neighbour is None:
                out = sample(mine[None], [me], [gen])
            else:
                batch = torch.cat([_logits(1, seed=500 + step), mine[None]])
                out = sample(batch, [neighbour, me], [make_generator(step), gen])
            toks.append(int(out[-1]))
        results.append(toks)
    assert results[0] == results[1] == results[2]


def test_top_k_one_equals_greedy() -> None:
    logits = _logits(8, seed=3)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 8
    assert torch.equal(sample(logits, params, [make_generator(i) for i in range(8)]), logits.argmax(-1))


def test_tiny_top_p_equals_greedy() -> None:
    logits = _logits(8, seed=4)
    params = [SamplingParams(temperature=1.0, top_p=1e-6)] * 8
    assert torch.equal(sample(logits, params, [make_generator(i) for i in range(8)]), logits.argmax(-1))


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 8000
    logits = probs.log().expand(n, 4).contiguous()
    torch.manual_seed(0)
    counts = torch.bincount(sample(logits, [SamplingParams(temperature=1.0)] * n, [None] * n), minlength=4)
    assert torch.allclose(counts.float() / n, probs, atol=0.02)


def test_top_k_and_top_p_restrict_support() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 2000
    logits = probs.log().expand(n, 4).contiguous()
    torch.manual_seed(1)
    nucleus = sample(logits, [SamplingParams(temperature=1.0, top_p=0.75)] * n, [None] * n)
    assert set(nucleus.tolist()) == {0, 1}  # smallest set reaching 0.75: {0.5, 0.3}
    top3 = sample(logits, [SamplingParams(temperature=1.0, top_k=3)] * n, [None] * n)
    assert set(top3.tolist()) == {0, 1, 2}


def test_low_temperature_concentrates_high_temperature_spreads() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(2000, 4).contiguous()
    torch.manual_seed(2)
    cold = sample(logits, [SamplingParams(temperature=0.05)] * 2000, [None] * 2000)
    hot = sample(logits, [SamplingParams(temperature=50.0)] * 2000, [None] * 2000)
    assert (cold == 0).float().mean() > 0.99
    assert (hot == 0).float().mean() < 0.4 and len(set(hot.tolist())) == 4


def test_sample_rejects_mismatched_batch() -> None:
    with pytest.raises(ValueError):
        sample(_logits(2), [SamplingParams()], [None])


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = _logits(4)
    params = [
        SamplingParams(min_tokens=3, max_tokens=10, stop_token_ids=(7,)),
        SamplingParams(min_tokens=3, max_tokens=10, stop_token_ids=(7,), ignore_eos=True),
        SamplingParams(min_tokens=3, max_tokens=10, stop_token_ids=(7,)),  # already has 3 tokens
        SamplingParams(max_tokens=10),
    ]
    masked = apply_min_tokens_mask(logits.clone(), params, [0, 2, 3, 0], eos_token_ids=[EOS, 9])
    inf = float("-inf")
    assert masked[0, EOS] == inf and masked[0, 9] == inf and masked[0, 7] == inf
    assert masked[1, 7] == inf and masked[1, EOS] == logits[1, EOS] and masked[1, 9] == logits[1, 9]
    assert torch.equal(masked[2], logits[2]) and torch.equal(masked[3], logits[3])
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[[7, 9, EOS]] = False
    assert torch.equal(masked[0, untouched], logits[0, untouched])
    forced = logits.clone()
    forced[0, EOS] = 100.0  # EOS would win greedily; the mask forbids it
    apply_min_tokens_mask(forced, params[:1], [0], [EOS])
    assert int(sample(forced[:1], [SamplingParams(temperature=0.0)], [None])[0]) != EOS


# ---------------------------------------------------------------- logprobs


def test_token_logprobs_match_log_softmax_and_sorted_top() -> None:
    logits = _logits(5, seed=9)
    chosen = torch.tensor([3, 1, 4, 1, 5])
    ref = torch.log_softmax(logits, -1)
    out = token_logprobs(logits, chosen, [3, None, 0, 5, 1])
    assert out[1] is None
    for i in (0, 2, 3, 4):
        entry = out[i]
        assert entry is not None and entry.token_id == int(chosen[i])
        assert entry.logprob == ref[i, chosen[i]].item()
        n = [3, None, 0, 5, 1][i]
        assert len(entry.top) == n
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True)
        best = ref[i].argsort(descending=True)[:n].tolist()
        assert [tid for tid, _ in entry.top] == best
        assert all(lp == ref[i, tid].item() for tid, lp in entry.top)


def test_temperature_never_changes_logprobs() -> None:
    logits = _logits(2, seed=10)
    hot = sample(logits, [SamplingParams(temperature=5.0)] * 2, [make_generator(1), make_generator(2)])
    entries = token_logprobs(logits, hot, [2, 2])
    raw = torch.log_softmax(logits, -1)
    tempered = torch.log_softmax(logits / 5.0, -1)
    for i, entry in enumerate(entries):
        assert entry is not None and entry.logprob == raw[i, hot[i]].item()
        assert entry.logprob != tempered[i, hot[i]].item()


def test_prompt_logprobs_first_null_and_chunks_concatenate() -> None:
    ids = [5, 17, 3, 99, 42, 8, 61]
    logits = _logits(len(ids), seed=11)
    whole = prompt_logprobs(logits, ids, top_n=2)
    assert len(whole) == len(ids) and whole[0] is None
    ref = torch.log_softmax(logits, -1)
    for i in range(1, len(ids)):
        entry = whole[i]
        assert entry is not None and entry.token_id == ids[i] and entry.logprob == ref[i - 1, ids[i]].item()
        assert len(entry.top) == 2
    chunked = prompt_logprobs(logits[:3], ids, 2) + prompt_logprobs(logits[3:], ids, 2, first_position=3)
    assert chunked == whole


def test_distribution_stats() -> None:
    logits = torch.tensor([[0.0, 0.0, float("-inf")], [5.0, 0.0, 0.0]])
    p, entropy, margin = distribution_stats(logits, torch.tensor([1, 0]))
    probs = torch.softmax(logits, -1)
    assert torch.allclose(p, torch.tensor([0.5, probs[1, 0].item()]))
    assert torch.allclose(entropy[0], torch.log(torch.tensor(2.0)))
    assert torch.allclose(margin, torch.tensor([0.0, (probs[1, 0] - probs[1, 1]).item()]))


# ---------------------------------------------------------------- stop strings


def test_find_stop_earliest_and_partial_suffix() -> None:
    assert find_stop("abc END xyz STOP", ["STOP", "END"]) == (4, "END")
    assert find_stop("no stop here", ["STOP"]) is None
    assert find_stop("xxSTOP", ["STOP"], new_chars=1) == (2, "STOP")
    assert partial_stop_len("hello ST", ["STOP"]) == 2
    assert partial_stop_len("hello S", ["STOP", "Sx"]) == 1
    assert partial_stop_len("hello", ["STOP"]) == 0
    assert partial_stop_len("STO", ["STOP"]) == 3


def _feed(tracker: OutputTracker, ids: list[int]) -> list[str]:
    deltas = []
    for tid in ids:
        step = tracker.append(tid)
        deltas.append(step.delta)
        if step.finish_reason is not None:
            break
    return deltas


def test_stop_string_truncates_and_holds_back(byte_tokenizer: Tokenizer) -> None:
    params = SamplingParams(max_tokens=100, stop=("STOP",))
    tracker = OutputTracker(byte_tokenizer, params, [EOS])
    ids = byte_tokenizer.encode("hello STOP world").ids
    deltas = _feed(tracker, ids)
    assert "".join(deltas) == "hello " and tracker.text == "hello "
    assert tracker.finish_reason == "stop"
    assert "S" not in "".join(deltas)  # the partial "S", "ST", "STO" were never emitted
    assert len(deltas) == len("hello STOP")  # stopped at the token completing the stop string
    # A false start is released once it can no longer become a stop string.
    tracker = OutputTracker(byte_tokenizer, params, [EOS])
    deltas = _feed(tracker, byte_tokenizer.encode("a STx").ids)
    assert deltas == ["a", " ", "", "", "STx"] and tracker.finish_reason is None
    done = tracker.finish("abort")
    assert done.finish_reason == "abort" and tracker.text == "a STx"


def test_finish_reasons_eos_stop_ids_length(byte_tokenizer: Tokenizer) -> None:
    text_ids = byte_tokenizer.encode("abc").ids
    tracker = OutputTracker(byte_tokenizer, SamplingParams(max_tokens=10), [EOS])
    _feed(tracker, [*text_ids, EOS, 65])
    assert tracker.finish_reason == "stop" and tracker.text == "abc"  # EOS text never included
    tracker = OutputTracker(byte_tokenizer, SamplingParams(max_tokens=10, stop_token_ids=(98,)), [EOS])
    last = _feed(tracker, text_ids)
    assert tracker.finish_reason == "stop" and tracker.text == "a" and last[-1] == ""
    tracker = OutputTracker(byte_tokenizer, SamplingParams(max_tokens=2), [EOS])
    _feed(tracker, text_ids)
    assert tracker.finish_reason == "length" and tracker.text == "ab"
    tracker = OutputTracker(byte_tokenizer, SamplingParams(max_tokens=3, ignore_eos=True), [EOS])
    _feed(tracker, [97, EOS, 98])
    assert tracker.finish_reason == "length" and tracker.text == "ab"


def test_min_tokens_defers_every_stop_condition(byte_tokenizer: Tokenizer) -> None:
    params = SamplingParams(max_tokens=10, min_tokens=4, stop=("b",))
    tracker = OutputTracker(byte_tokenizer, params, [EOS])
    deltas = _feed(tracker, [97, 98, EOS, 99, 98, 100])
    assert tracker.finish_reason == "stop" and tracker.text == "abc"
    assert "".join(deltas) == "abc" and tracker.num_generated == 5


# ---------------------------------------------------------------- detokenizer


@pytest.mark.parametrize("text", ["你好，世界", "emoji 🎉🚀 mixed ü text", "plain ascii"])
def test_detokenizer_never_emits_broken_characters(byte_tokenizer: Tokenizer, text: str) -> None:
    ids = byte_tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(byte_tokenizer)
    deltas = [detok.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.text
    if len(text.encode()) > len(text):
        assert "" in deltas  # some token ended mid-character and was held


def test_detokenizer_flush_emits_incomplete_tail(byte_tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer)
    ids = byte_tokenizer.encode("ok 🎉").ids
    assert "".join(detok.add(t) for t in ids[:-1]) == "ok "
    assert detok.flush() == "\ufffd"


def test_detokenizer_with_prompt_context(byte_tokenizer: Tokenizer) -> None:
    prompt = byte_tokenizer.encode("Q: 你").ids
    detok = IncrementalDetokenizer(byte_tokenizer, prompt_token_ids=prompt)
    out = "".join(detok.add(t) for t in byte_tokenizer.encode("好 A").ids)
    assert out == "好 A"


@pytest.fixture(scope="module")
def smollm_tokenizer():
    """SmolLM2's real byte-level BPE (read from the embedded GGUF's metadata, weights not loaded)."""
    from confkv_engine.model.gguf_loader import open_gguf
    from confkv_engine.model.loader import builtin_path
    from confkv_engine.model.tokenizer import Tokenizer as GGUFTokenizer

    return GGUFTokenizer.from_gguf_metadata(open_gguf(builtin_path("smollm2-135m")).metadata)


def test_detokenizer_with_embedded_tokenizer(smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    text = "Café 你好世界 🎉 — naïve"
    ids = list(tok.encode(text))
    split = [tok.decode(ids[:i]) for i in range(1, len(ids))]
    assert any(s.endswith("\ufffd") for s in split)  # the tokenizer really splits a character
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)


def test_tracker_with_embedded_tokenizer_stop_across_tokens(smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    ids = list(tok.encode("Answer: 你好🎉 ###END### trailing words"))
    params = SamplingParams(max_tokens=100, stop=("###END###",))
    tracker = OutputTracker(tok, params, tok.eos_token_ids, prompt_token_ids=tok.encode("Question?"))
    deltas = _feed(tracker, ids)
    assert tracker.finish_reason == "stop" and tracker.text == "Answer: 你好🎉 "
    assert "".join(deltas) == tracker.text and all("\ufffd" not in d and "#" not in d for d in deltas)
    assert len(deltas) < len(ids)  # stopped before the trailing words
