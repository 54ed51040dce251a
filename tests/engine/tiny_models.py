"""Randomly initialised tiny Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 models saved as Hugging Face
directories, plus reference logits from transformers, for parity tests (dense here; the paged-cache
tests reuse these helpers).

    hf_model, model_dir = make_tiny_hf_model("llama", tmp_path)
    tokens, ref = hf_greedy_reference(hf_model, prompt_ids, steps=20)   # ref: [len(tokens), V] fp32
    ours = dense_logits(loaded.model, tokens, prompt_len=len(prompt_ids))
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from torch import Tensor

from confkv_engine.model.llama import DenseAttention, LlamaForCausalLM

VOCAB_SIZE = 320
SPECIALS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")
# transformers class per architecture
_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
            "gemma3-llamacpp": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}


def tiny_config(arch: str):  # -> transformers.PretrainedConfig
    import transformers

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=256,
        eos_token_id=257,
        initializer_range=0.1,
    )
    if arch == "llama":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return transformers.LlamaConfig(**common, rope_scaling=scaling, rope_theta=10000.0)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
    if arch == "mistral":  # a window shorter than the parity sequences, so it masks
        return transformers.MistralConfig(**common, sliding_window=16, rope_theta=1e6)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, rope_theta=1e6)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(**gemma3_fields(common))
    if arch == "phi3":  # fused qkv / gate_up projections, a sliding window
        return transformers.Phi3Config(**common, sliding_window=16, pad_token_id=0)
    if arch == "gemma3-llamacpp":  # what a GGUF can say: llama.cpp's fixed layer pattern and scales
        fields = {**gemma3_fields(common), "num_hidden_layers": 6, "query_pre_attn_scalar": 32}
        del fields["layer_types"]
        return transformers.Gemma3TextConfig(**fields)
    raise ValueError(f"unknown arch {arch!r}")


def gemma3_fields(common: dict) -> dict:
    """Local, global, local layers; a window shorter than the sequences; a score scale other
    than head_dim's; a linearly scaled global RoPE and a local one of its own; soft-capped logits."""
    return {**common, "num_hidden_layers": 3, "head_dim": 32, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24, "final_logit_softcapping": 5.0,
            "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}


def byte_level_tokenizer() -> HFTokenizer:
    """A byte-level BPE over the 256-byte alphabet with a few merges and ChatML specials."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    specials_at = len(vocab)
    for i, tok in enumerate(SPECIALS):
        vocab[tok] = specials_at + i
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return backend


def make_tiny_hf_model(arch: str, tmp_path: Path, *, sharded: bool | None = None, seed: int = 0):
    """Random tiny model saved to ``tmp_path / arch`` (safetensors; Llama sharded by default)
    with tokenizer.json and tokenizer_config.json. Returns (eval-mode transformers model, dir)."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(arch)
    hf_model = getattr(transformers, _CLASSES[arch])(config).eval()
    with torch.no_grad():  # norms initialise to one (Gemma's to zero): random ones test their loading
        for name, param in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
    model_dir = Path(tmp_path) / arch
    sharded = arch == "llama" if sharded is None else sharded
    hf_model.save_pretrained(model_dir, safe_serialization=True, max_shard_size="100KB" if sharded else "1GB")
    byte_level_tokenizer().save(str(model_dir / "tokenizer.json"))
    tokenizer_config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": CHATML}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return hf_model, model_dir


@torch.no_grad()
def hf_greedy_reference(hf_model, prompt_ids: list[int], steps: int = 20) -> tuple[list[int], Tensor]:
    """Greedy-decode ``steps`` tokens with transformers (full re-forward each step), then return the
    whole sequence and the fp32 logits at every position [len(prompt)+steps, V]."""
    tokens = list(prompt_ids)
    for _ in range(steps):
        logits = hf_model(torch.tensor([tokens])).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens, hf_model(torch.tensor([tokens])).logits[0].float()


@torch.no_grad()
def dense_logits(model: LlamaForCausalLM, tokens: list[int], prompt_len: int) -> Tensor:
    """Our model through DenseAttention: one prefill over the prompt, then one token per step.
    Returns fp32 logits at every position [len(tokens), V]."""
    backend = DenseAttention()
    hidden = model(torch.tensor(tokens[:prompt_len]), torch.arange(prompt_len), backend)
    rows = [model.compute_logits(hidden)]
    for pos in range(prompt_len, len(tokens)):
        hidden = model(torch.tensor([tokens[pos]]), torch.tensor([pos]), backend)
        rows.append(model.compute_logits(hidden))
    return torch.cat(rows)
