"""Per-layer budget shapes keep the mean fraction exactly and stay in bounds; the entropy probe
attends like the dense reference and measures 1 for uniform attention."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.model.llama import dense_causal_attention
from testkit.budget_shapes import EntropyProbe, fit_mean, layer_fractions


@pytest.mark.parametrize("shape", ["uniform", "pyramid:2", "pyramid:0.5", "pyramid:40", "entropy:1",
                                   "entropy:3"])
@pytest.mark.parametrize("f", [0.25, 0.125, 0.9])
def test_shapes_keep_the_mean_and_the_bounds(shape: str, f: float) -> None:
    entropy = [0.2 + 0.6 * (i % 7) / 6 for i in range(30)]
    fr = layer_fractions(shape, f, 30, entropy)
    assert len(fr) == 30
    assert sum(fr) / 30 == pytest.approx(f, abs=1e-9)
    assert min(fr) >= f / 4 - 1e-12 and max(fr) <= 1.0


def test_pyramid_decreases_linearly_with_the_requested_ratio() -> None:
    fr = layer_fractions("pyramid:2", 0.25, 30)
    assert fr[0] / fr[-1] == pytest.approx(2.0)
    assert all(a > b for a, b in zip(fr, fr[1:], strict=False))
    assert fr[0] == pytest.approx(2 * 0.25 * 2 / 3)
    inv = layer_fractions("pyramid:0.5", 0.25, 30)
    assert inv == pytest.approx(fr[::-1])


def test_entropy_shape_is_proportional_until_a_bound_pins_a_layer() -> None:
    fr = layer_fractions("entropy:1", 0.2, 4, [0.1, 0.2, 0.3, 0.4])
    assert fr == pytest.approx([0.08, 0.16, 0.24, 0.32])
    pinned = fit_mean([1.0, 1.0, 1.0, 100.0], 0.5, 0.125, 1.0)
    assert pinned[3] == 1.0 and sum(pinned) / 4 == pytest.approx(0.5)


@pytest.mark.parametrize(("shape", "entropy"), [("cone", None), ("entropy", None), ("entropy", [0.5])])
def test_bad_shapes_are_rejected(shape: str, entropy: list[float] | None) -> None:
    with pytest.raises(ValueError):
        layer_fractions(shape, 0.25, 30, entropy)


def test_entropy_probe_attends_like_the_dense_reference() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(12, 4, 8, generator=g)
    k, v = torch.randn(12, 2, 8, generator=g), torch.randn(12, 2, 8, generator=g)
    probe = EntropyProbe(num_layers=2, skip=6)
    torch.testing.assert_close(probe.attend(1, q, k, v), dense_causal_attention(q, k, v))
    probe.attend(0, torch.zeros_like(q), k, v)  # zero queries: uniform attention, entropy log(i + 1)
    ent = probe.entropies()
    assert ent[0] == pytest.approx(1.0, abs=1e-5)
    assert 0.0 < ent[1] < 1.0
