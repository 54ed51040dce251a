"""The native kernels' fused greedy argmax (``q8native.bound_argmax``): each row's index of its
largest output without writing the outputs, equal to ``bound(...)(x).max(-1).indices`` (the index
the unfused greedy step takes) for every weight format and path, across chunk boundaries (1,024
outputs per chunk), with ties (first index), bf16 rounding and NaN rows; and the served greedy
step on the real SmolLM2 (its Q8_0 head through q8n) choosing the same tokens with and without it.
"""

from __future__ import annotations

import pytest
import torch

from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model import q8native
from confkv_engine.model.loader import load_model
from confkv_engine.model.qlinear import QuantLinear
from confkv_engine.model.quant import Int8GroupWeight, quantize_int4, quantize_int8, quantize_int8_groups

pytestmark = pytest.mark.skipif(not q8native.supported_isas(), reason="native library not built")
ISAS = [pytest.param(i, marks=pytest.mark.skipif(i not in q8native.supported_isas(), reason=f"no {i} path"))
        for i in ("scalar", "avx2", "vnni")]


def packed(fmt: str, w: torch.Tensor) -> q8native.PackedInt8 | q8native.PackedInt4Blocks:
    if fmt == "int4":
        return q8native.pack_int4(quantize_int4(w))
    if fmt == "int8":
        return q8native.pack(quantize_int8(w))
    g = quantize_int8_groups(w, 16 if fmt == "int8g16" else 32)
    return q8native.pack(Int8GroupWeight(g.q, g.scale.half().float(), g.group))


def expected(p: q8native.PackedInt8 | q8native.PackedInt4Blocks, isa: str, x: torch.Tensor) -> torch.Tensor:
    return q8native.bound(p, isa, x.dtype)(x).max(dim=-1).indices


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["int8", "int8g", "int8g16", "int4"])
@pytest.mark.parametrize("n", [37, 2_100])  # a partial block; chunks of 1,024 outputs and a partial one
def test_fused_argmax_equals_the_outputs_argmax(isa: str, fmt: str, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    p = packed(fmt, torch.randn(n, 64, generator=gen) * 0.05)
    fused = q8native.bound_argmax(p, isa, torch.float32)
    assert fused is not None
    for rows in (1, 3, 9, 17):
        x = torch.randn(rows, 64, generator=gen)
        assert torch.equal(fused(x), expected(p, isa, x))


@pytest.mark.parametrize("isa", ISAS)
def test_ties_keep_the_first_index_across_chunks(isa: str) -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(3_000, 64, generator=gen) * 0.05
    w[2_500] = w[700] = w[5] = w[5] * 20  # three equal rows, far the largest outputs, in three chunks
    p = packed("int8g", w)
    x = w[5:6].clone()  # the direction of those rows: their dot product is the largest
    idx = q8native.bound_argmax(p, isa, torch.float32)(x)  # type: ignore[misc]
    assert idx.tolist() == [5] == expected(p, isa, x).tolist()


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_rows_and_nan_rows(isa: str) -> None:
    gen = torch.Generator().manual_seed(4)
    p = packed("int8g", torch.randn(1_500, 64, generator=gen) * 0.05)
    x = torch.randn(4, 64, generator=gen)
    x[2, 7] = float("nan")  # every output of that row is NaN: torch.max answers index 0 there
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        fused = q8native.bound_argmax(p, isa, dtype)(xd)  # type: ignore[misc]
        assert torch.equal(fused, expected(p, isa, xd))


def test_the_fused_argmax_keeps_its_weights_alive() -> None:
    # Its arguments are raw pointers into the packed tensors: a caller that keeps only the function
    # (packing a temporary) must not leave them pointing at freed memory.
    import gc
    import weakref

    w = packed("int8g", torch.randn(64, 96))
    ref = weakref.ref(w)
    fn = q8native.bound_argmax(w, q8native.supported_isas()[0], torch.float32)
    x = torch.randn(3, 96)
    want = expected(w, q8native.supported_isas()[0], x)
    del w
    gc.collect()
    assert ref() is not None
    assert torch.equal(fn(x), want)


def test_quant_linear_fuses_only_its_native_kernels() -> None:
    layer = QuantLinear(64, 8, "int8", {"dense": lambda x: x[:, :8]}, [(1, "dense")])
    assert layer.argmax(torch.randn(2, 64)) is None  # no fused kernel: the caller computes the logits


def test_served_greedy_tokens_equal_with_and_without_the_fused_head(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model("builtin:smollm2-135m", weights="auto")
    head = loaded.model.lm_head
    assert isinstance(head, QuantLinear) and head.argmax(torch.randn(2, head.in_features)) is not None
    prompts = [loaded.tokenizer.encode(t) for t in ("The river flows through the old town and",
                                                     "In 1905 the physicist published four papers on")]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    calls: list[int] = []
    fused = loaded.model.greedy_tokens

    def counted(hidden: torch.Tensor) -> torch.Tensor | None:
        calls.append(hidden.shape[0])
        return fused(hidden)
    monkeypatch.setattr(loaded.model, "greedy_tokens", counted)
    with_fused = [o.output_token_ids for o in LLMEngine(loaded).generate(prompts, params)]
    assert calls and all(c >= 1 for c in calls)
    monkeypatch.setattr(loaded.model, "greedy_tokens", lambda hidden: None)  # the logits' argmax
    assert [o.output_token_ids for o in LLMEngine(loaded).generate(prompts, params)] == with_fused
