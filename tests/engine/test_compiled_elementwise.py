"""``model.compile``: the compiled elementwise blocks give the eager model's outputs, and the
engine reports the compile time and puts inductor's cache under its cache directory."""

from __future__ import annotations

import os

import pytest
import torch

from confkv_engine.model import compiled
from confkv_engine.model.llama import DenseAttention, LlamaForCausalLM, ModelArgs

pytestmark = pytest.mark.slow  # inductor generates and builds C++ kernels (tens of seconds on 2 cores)


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=200, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16)
    model = LlamaForCausalLM(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.2)
    return model


def _logits(model: LlamaForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        backend = DenseAttention()
        prefill = model(tokens[:-1], torch.arange(len(tokens) - 1), backend)
        step = model(tokens[-1:], torch.tensor([len(tokens) - 1]), backend)  # the one-row graph
        return model.compute_logits(torch.cat([prefill, step]))


def test_compiled_blocks_match_eager_and_cache_under_the_cache_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(compiled.CACHE_ENV, "unset")  # restored after the test
    monkeypatch.delenv(compiled.CACHE_ENV)
    model = _model()
    tokens = torch.randint(0, 200, (23,), generator=torch.Generator().manual_seed(1))
    eager = _logits(model, tokens)
    seconds = compiled.compile_elementwise(model, torch.float32, tmp_path)
    assert seconds > 0 and model.ops.norm is not None and model.ops.rope is not None
    assert os.environ[compiled.CACHE_ENV] == str(tmp_path / "inductor")
    assert any((tmp_path / "inductor").iterdir())  # kernels written where a restart finds them
    torch.testing.assert_close(_logits(model, tokens), eager, atol=1e-5, rtol=1e-5)
