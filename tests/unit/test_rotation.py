"""The rotated-cache measurement aid (``testkit.rotation``): the rotation is orthogonal, a full
cache's attention is unchanged by it, and a per-token int2 group of rotated values with one large
channel decodes closer than the same values unrotated (the effect the benchmark measures)."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.cache.arena import block_codecs
from confkv_engine.cache.codec import decode_rows, encode_rows
from confkv_engine.model.llama import DenseAttention
from testkit.rotation import RotatedBackend, hadamard, rotate_engine


@pytest.mark.parametrize("n", [1, 2, 64, 128])
def test_hadamard_is_orthogonal_and_seeded(n: int) -> None:
    r = hadamard(n, seed=3)
    torch.testing.assert_close(r @ r.T, torch.eye(n), atol=1e-6, rtol=0)
    assert torch.equal(r, hadamard(n, seed=3))
    if n > 2:
        assert not torch.equal(r, hadamard(n, seed=4))


def test_hadamard_refuses_other_sizes() -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(96)


def test_rotated_backend_attends_as_the_plain_one() -> None:
    g = torch.Generator().manual_seed(0)
    plain, turned = DenseAttention(), RotatedBackend(DenseAttention(), hadamard(64))
    for t in (5, 1, 3):  # a prefill chunk, then single-token and three-token steps
        q = torch.randn(t, 6, 64, generator=g)
        k, v = torch.randn(t, 2, 64, generator=g), torch.randn(t, 2, 64, generator=g)
        torch.testing.assert_close(turned.attend(0, q, k, v), plain.attend(0, q, k, v), atol=1e-5, rtol=1e-5)
    # what the wrapped backend cached is the rotated basis, and its attributes show through
    assert turned.keys[0].shape == plain.keys[0].shape
    assert not torch.allclose(turned.keys[0], plain.keys[0])


def test_rotation_narrows_a_value_group_with_one_large_channel() -> None:
    g = torch.Generator().manual_seed(1)
    v = torch.randn(4, 16, 2, 64, generator=g)  # [blocks, block_size, heads, head_dim]
    v[..., 7] *= 20.0  # one outlier channel, as SmolLM2's first layer has
    spec = block_codecs(16, 2, 64, 2, 64)[1]
    r = hadamard(64)

    def err(x: torch.Tensor, back: torch.Tensor) -> float:
        return float((decode_rows(encode_rows(x, spec), spec) @ back - v).square().mean())

    assert err(v @ r, r.T) < 0.5 * err(v, torch.eye(64))


def test_rotate_engine_checks_its_name() -> None:
    class Engine:
        backend, decode_runner = DenseAttention(), object()

    engine = Engine()
    rotate_engine(engine, "none", 64)
    assert isinstance(engine.backend, DenseAttention) and engine.decode_runner is not None
    rotate_engine(engine, "hadamard", 64)
    assert isinstance(engine.backend, RotatedBackend) and engine.decode_runner is None
    with pytest.raises(ValueError, match="rotation must be one of"):
        rotate_engine(engine, "random", 64)
