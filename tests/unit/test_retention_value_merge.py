"""KEY_ONLY value stand-in: running weighted mean and attention against a dense reference."""

from __future__ import annotations

import math

import torch

from confkv_engine.model.llama import dense_causal_attention
from confkv_engine.retention.value_merge import WEIGHT_FLOOR, merge_values, tiered_attention


def test_running_weighted_mean_is_exact_over_two_merges() -> None:
    mean, weight = torch.zeros(1, 2), torch.zeros(1)
    vals = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [4.0, 4.0]]])
    w = torch.tensor([[1.0, 3.0, 100.0]])
    merge_values(mean, weight, vals, w, torch.tensor([[True, False, False]]))
    merge_values(mean, weight, vals, w, torch.tensor([[False, True, False]]))
    w1, w2 = 1.0 + WEIGHT_FLOOR, 3.0 + WEIGHT_FLOOR
    expect = (w1 * vals[0, 0] + w2 * vals[0, 1]) / (w1 + w2)
    torch.testing.assert_close(mean[0], expect)
    assert weight.item() == torch.tensor(w1 + w2).item()


def test_tiered_attention_matches_dense_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    hq, hkv, s, t, d = 4, 2, 9, 3, 8
    q = torch.randn(t, hq, d, generator=gen)
    k = torch.randn(s, hkv, d, generator=gen)
    v = torch.randn(s, hkv, d, generator=gen)
    key_only = torch.zeros(hkv, s, dtype=torch.bool)
    key_only[0, [1, 4]] = True
    key_only[1, [2]] = True
    v_mean = torch.randn(hkv, d, generator=gen)
    causal = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
    mask = torch.zeros(t, s).masked_fill(~causal, -math.inf)
    qg = q.view(t, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # [U, G, T, D]
    out, probs = tiered_attention(qg, k.transpose(0, 1), v.transpose(0, 1), key_only, v_mean, mask)
    # Dense reference: the same attention with the KEY_ONLY values replaced by the mean.
    v_ref = torch.where(key_only.T[..., None], v_mean[None], v)
    ref = dense_causal_attention(q, k, v_ref)
    torch.testing.assert_close(out.permute(2, 0, 1, 3).reshape(t, hq, d), ref)
    # The formula: sum_FULL p_i v_i + (sum_KEY_ONLY p_j) v_mean, with the exact normalisation.
    p = probs[0, 0, -1]
    manual = (p[~key_only[0], None] * v[~key_only[0], 0]).sum(0) + p[key_only[0]].sum() * v_mean[0]
    torch.testing.assert_close(out[0, 0, -1], manual)
    torch.testing.assert_close(probs.sum(-1), torch.ones(hkv, hq // hkv, t))
