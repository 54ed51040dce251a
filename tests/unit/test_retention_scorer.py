"""Retention scorer: exact small examples and chunk-size independence of the attention signal."""

from __future__ import annotations

import math

import pytest
import torch

from confkv_engine.retention import scorer
from confkv_engine.retention.scorer import ScorerConfig


def test_sampling_signal_exact_values() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.7, 0.1, 0.1, 0.1]]))
    sig = scorer.sampling_signal(logits, torch.tensor([1, 0]))
    assert sig.prob.tolist() == pytest.approx([0.25, 0.7])
    h0 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)) / math.log(4)
    h1 = -(0.7 * math.log(0.7) + 3 * 0.1 * math.log(0.1)) / math.log(4)
    assert sig.entropy.tolist() == pytest.approx([h0, h1])  # a zero-probability entry is not nan
    assert sig.margin.tolist() == pytest.approx([0.25, 0.6])
    assert scorer.sampling_confidence(sig, "surprise").tolist() == pytest.approx([0.75, 0.3])
    assert scorer.sampling_confidence(sig, "margin").tolist() == pytest.approx([0.75, 0.4])


def test_the_probability_alone_matches_and_the_spread_is_refused_without_it() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.7, 0.1, 0.1, 0.1]])) + 3.0
    full, alone = scorer.sampling_signal(logits, torch.tensor([1, 0])), \
        scorer.sampling_signal(logits, torch.tensor([1, 0]), spread=False)
    assert alone.prob.tolist() == pytest.approx(full.prob.tolist())
    assert alone.prob.tolist() == pytest.approx([0.25, 0.7])
    assert alone.entropy is None and alone.margin is None
    assert scorer.sampling_confidence(alone, "surprise").tolist() == pytest.approx([0.75, 0.3])
    with pytest.raises(ValueError, match="spread=False"):
        scorer.sampling_confidence(alone, "entropy")
    # Rows of a signal taken in slices join back in order.
    both = scorer.SamplingSignal.cat([full.rows(0, 1), full.rows(1, 2)])
    assert both.prob.tolist() == full.prob.tolist() and both.margin.tolist() == full.margin.tolist()


def test_sampling_signal_ignores_temperature_scaled_copies() -> None:
    """The signal comes from the logits as given: a tempered copy is a different distribution, so
    callers must pass untempered logits (the engine does); here we pin that the function itself
    applies no temperature."""
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    p = torch.softmax(logits, -1)[0, 0].item()
    assert scorer.sampling_signal(logits, torch.tensor([0])).prob.item() == pytest.approx(p)


def _fold(probs: torch.Tensor, key_pos: torch.Tensor, chunks: list[int], decay: float):
    u, t, s = probs.shape
    acc, norm = torch.zeros(u, s, dtype=torch.float64), torch.zeros(u, s, dtype=torch.float64)
    last, start = -1, 0
    for c in chunks:
        qpos = torch.arange(start, start + c)
        chunk = probs[:, start:start + c].double()
        last = scorer.update_attention(acc, norm, chunk, key_pos, qpos, last, decay)
        start += c
    return acc, norm


def test_attention_signal_exact_small_example() -> None:
    # One unit, keys at positions 0 and 1, queries at 0, 1, 2 (query 0 sees only key 0).
    probs = torch.tensor([[[1.0, 0.0], [0.4, 0.6], [0.2, 0.8]]])
    acc, norm = _fold(probs, torch.tensor([[0, 1]]), [3], decay=0.5)
    # A_0 = 0.25*1 + 0.5*0.4 + 0.2 ; N_0 = 0.25 + 0.5 + 1 ; A_1 = 0.5*0.6 + 0.8 ; N_1 = 0.5 + 1
    assert acc[0].tolist() == pytest.approx([0.65, 1.1])
    assert norm[0].tolist() == pytest.approx([1.75, 1.5])
    att = scorer.attention_signal(acc, norm)
    assert att[0].tolist() == pytest.approx([0.65 / 1.75, 1.1 / 1.5])


@pytest.mark.parametrize("chunks", [[1] * 12, [5, 7], [12], [3, 1, 8]])
def test_attention_signal_independent_of_chunk_size(chunks: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    u, t = 3, 12
    scores = torch.randn(u, t, t, generator=gen)
    causal = torch.arange(t)[None, :] <= torch.arange(t)[:, None]
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1) * 3  # summed over a group of 3
    key_pos = torch.arange(t).expand(u, t)
    ref_acc, ref_norm = _fold(probs, key_pos, [1] * t, decay=0.9)
    acc, norm = _fold(probs, key_pos, chunks, decay=0.9)
    torch.testing.assert_close(acc, ref_acc)
    torch.testing.assert_close(norm, ref_norm)
    # Normalised by the (decayed) number of queries that could see the key: last key saw one query.
    assert norm[0, -1].item() == pytest.approx(1.0)


def test_attention_confidence_relative_to_uniform() -> None:
    att = torch.tensor([[0.0, 1.0 / 10, 3.0 / 10]]) * 3  # group of 3, context of 10 tokens
    c = scorer.attention_confidence(att, context_len=10, group=3, scale=1.0)
    assert c[0].tolist() == pytest.approx([0.0, 1 - math.exp(-1), 1 - math.exp(-3)])


def test_combined_modes() -> None:
    acc = torch.tensor([[0.3, 0.0]])
    norm = torch.tensor([[1.0, 1.0]])
    c_samp = torch.tensor([0.2, 0.9])
    c_att = scorer.attention_confidence(scorer.attention_signal(acc, norm), 10, 3)
    att_only = scorer.confidence(acc, norm, c_samp, 10, 3, ScorerConfig(mode="attention", scale=1.0))
    samp_only = scorer.confidence(acc, norm, c_samp, 10, 3, ScorerConfig(mode="sampling", scale=1.0))
    mixed_cfg = ScorerConfig(mode="combined", sampling_weight=0.25, scale=1.0)
    mixed = scorer.confidence(acc, norm, c_samp, 10, 3, mixed_cfg)
    torch.testing.assert_close(att_only, c_att)
    torch.testing.assert_close(samp_only, c_samp[None])
    torch.testing.assert_close(mixed, 0.75 * c_att + 0.25 * c_samp)
    assert float(mixed.min()) >= 0 and float(mixed.max()) <= 1


def test_a_given_weight_overrides_the_mode() -> None:
    # The precision chain passes its own weight (RetentionConfig.sampling_weight), whatever the mode.
    acc, norm, c_samp = torch.tensor([[0.3, 0.0]]), torch.tensor([[1.0, 1.0]]), torch.tensor([0.2, 0.9])
    c_att = scorer.attention_confidence(scorer.attention_signal(acc, norm), 10, 3)
    cfg = ScorerConfig(mode="attention", scale=1.0)
    torch.testing.assert_close(scorer.confidence(acc, norm, c_samp, 10, 3, cfg, weight=0.6),
                               0.4 * c_att + 0.6 * c_samp)
    torch.testing.assert_close(scorer.confidence(acc, norm, c_samp, 10, 3, cfg, weight=0.0), c_att)
    with pytest.raises(ValueError, match="precision_sampling_weight"):
        ScorerConfig(precision_sampling_weight=1.5)


def test_scorer_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="decay"):
        ScorerConfig(decay=0.0)
    with pytest.raises(ValueError, match="mode"):
        ScorerConfig(mode="magic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pool"):
        ScorerConfig(pool=4)


def test_pool_signal_keeps_neighbours_of_a_peak() -> None:
    att = torch.tensor([[0.0, 0.0, 0.9, 0.0, 0.0, 0.1, 0.0], [0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2]])
    pooled = scorer.pool_signal(att, 3)
    expected = torch.tensor([[0.0, 0.9, 0.9, 0.9, 0.1, 0.1, 0.1], [0.3, 0.3, 0.0, 0.0, 0.0, 0.2, 0.2]])
    torch.testing.assert_close(pooled, expected)
    assert torch.equal(scorer.pool_signal(att, 1), att)
    assert scorer.pool_signal(torch.zeros(2, 0), 5).shape == (2, 0)


def test_update_peak_exact_mean_of_far_queries_relative_to_uniform() -> None:
    # One unit, keys 0..3, queries 0..3 (causal), group 1, queries nearer than 2 do not count.
    probs = torch.tensor([[[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], [0.2, 0.2, 0.6, 0.0],
                           [0.1, 0.1, 0.1, 0.7]]])
    peak = torch.zeros(1, 4)
    scorer.update_peak(peak, probs, torch.arange(4)[None], torch.arange(4), 1, 2)
    # key 0: queries 2 and 3 saw 3 and 4 keys: (0.2 * 3 + 0.1 * 4) / 2; key 1: query 3, 0.1 * 4.
    assert peak[0].tolist() == pytest.approx([0.5, 0.4, 0.0, 0.0])
    # A later chunk raises the peak where it is higher and never lowers it.
    later = torch.tensor([[[0.05, 0.05, 0.8, 0.1]] * 2]) * 2  # group 2: summed over two heads
    scorer.update_peak(peak, later, torch.arange(4)[None], torch.tensor([5, 6]), 2, 2)
    assert peak[0].tolist() == pytest.approx([0.5, 0.4, 3.2, 0.4])
    # ``fade`` scales the old peak first (0.5, 0.4, 3.2, 0.4 -> half), then this chunk's values
    # (0.1 x 4 / 2 = 0.2, 0.2, 3.2, 0.4) raise it where higher.
    scorer.update_peak(peak, later, torch.arange(4)[None], torch.tensor([5, 6]), 2, 2, fade=0.5)
    assert peak[0].tolist() == pytest.approx([0.25, 0.2, 3.2, 0.4])
    # ``reach`` 2: only queries 2 positions after the key count (key 0: query 2, 0.2 x 3; key 1: query 3).
    near = torch.zeros(1, 4)
    scorer.update_peak(near, probs, torch.arange(4)[None], torch.arange(4), 1, 2, reach=2)
    assert near[0].tolist() == pytest.approx([0.6, 0.4, 0.0, 0.0])
    with pytest.raises(ValueError, match="memory_reach"):
        ScorerConfig(memory_distance=16, memory_reach=16)


def test_memory_keeps_a_once_attended_token_above_a_newer_one() -> None:
    # Token 0 was attended (peak 2) but its decayed mean fell to 0.01; token 1's mean is 0.05.
    acc, norm = torch.tensor([[0.01, 0.05]]), torch.ones(1, 2)
    peak = torch.tensor([[2.0, 0.1]])
    c_samp = torch.zeros(2)
    plain = scorer.confidence(acc, norm, c_samp, 10, 1, ScorerConfig(scale=1.0), peak)
    assert plain[0].tolist() == pytest.approx([1 - math.exp(-0.1), 1 - math.exp(-0.5)])
    remembered = scorer.confidence(acc, norm, c_samp, 10, 1, ScorerConfig(scale=1.0, memory=0.5), peak)
    # max(att * L / G, memory * peak): token 0 -> max(0.1, 1.0), token 1 -> max(0.5, 0.05).
    assert remembered[0].tolist() == pytest.approx([1 - math.exp(-1.0), 1 - math.exp(-0.5)])
    with pytest.raises(ValueError, match="memory"):
        ScorerConfig(memory=-1.0)
