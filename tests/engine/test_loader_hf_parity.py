"""Hugging Face directory loading: parity with transformers on random tiny Llama (llama3 rope scaling,
sharded safetensors) and Qwen2 (q/k/v bias, tied embeddings) models, plus the tokenizer side."""

from __future__ import annotations

import json

import pytest
import torch

from confkv_engine.model.hf_loader import weight_files
from confkv_engine.model.loader import load_model
from confkv_engine.model.weights import ModelLoadError
from tests.engine.tiny_models import ARCHS, dense_logits, hf_greedy_reference, make_tiny_hf_model

pytest.importorskip("transformers")
torch.set_num_threads(1)

PROMPT = [5, 77, 200, 13, 256, 99, 42, 150, 3, 300, 18, 64, 7, 250, 111, 90, 1, 222, 40, 17, 180, 60, 9, 310]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, tmp_path):
    hf_model, model_dir = make_tiny_hf_model(arch, tmp_path)
    loaded = load_model(str(model_dir), dtype=torch.float32, device="cpu")
    tokens, ref = hf_greedy_reference(hf_model, PROMPT, steps=20)
    ours = dense_logits(loaded.model, tokens, prompt_len=len(PROMPT))
    assert ours.shape == ref.shape == (len(PROMPT) + 20, loaded.args.vocab_size)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_sharded_checkpoint_is_read_from_every_shard(tmp_path):
    _, model_dir = make_tiny_hf_model("llama", tmp_path, sharded=True)
    files = weight_files(model_dir)
    assert len(files) > 1 and (model_dir / "model.safetensors.index.json").is_file()
    loaded = load_model(str(model_dir))
    assert loaded.args.rope_scaling["rope_type"] == "llama3"
    assert not loaded.args.tie_word_embeddings


def test_qwen2_args_and_tied_head(tmp_path):
    hf_model, model_dir = make_tiny_hf_model("qwen2", tmp_path)
    loaded = load_model(str(model_dir))
    model = loaded.model
    assert loaded.args.attention_bias and loaded.args.tie_word_embeddings
    assert model.lm_head.weight is model.embed_tokens.weight
    hf_bias = hf_model.model.layers[1].self_attn.k_proj.bias
    assert torch.equal(model.layers[1].self_attn.k_proj.bias, hf_bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes_load_and_stay_close(dtype, tmp_path):
    hf_model, model_dir = make_tiny_hf_model("qwen2", tmp_path)
    loaded = load_model(str(model_dir), dtype=dtype)
    assert loaded.dtype == dtype and loaded.model.embed_tokens.weight.dtype == dtype
    assert loaded.model.inv_freq.dtype == torch.float32  # RoPE frequencies stay fp32
    tokens, ref = hf_greedy_reference(hf_model, PROMPT, steps=2)
    ours = dense_logits(loaded.model, tokens, prompt_len=len(PROMPT))
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() < 0.1 * ref.abs().max().item()


def test_hf_tokenizer_side(tmp_path):
    _, model_dir = make_tiny_hf_model("qwen2", tmp_path)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 259]}))
    loaded = load_model(str(model_dir))
    tok = loaded.tokenizer
    assert loaded.name == "qwen2"
    assert tok.bos_token_id == tok.backend.token_to_id("<s>")
    # eos from tokenizer_config (<|im_end|>) first, then generation_config's ids, deduplicated
    assert loaded.eos_token_ids == (tok.backend.token_to_id("<|im_end|>"), 257)
    text = "the cat in the hat: 12 €"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(text, add_bos=True)[0] == tok.bos_token_id
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(prompt)[0] == tok.backend.token_to_id("<|im_start|>")


def test_missing_pieces_raise_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(empty))
    _, model_dir = make_tiny_hf_model("qwen2", tmp_path)
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(ModelLoadError, match="unsupported model_type"):
        load_model(str(model_dir))
    (model_dir / "config.json").write_text(json.dumps(cfg))
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(str(model_dir))
