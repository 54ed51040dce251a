"""GGUF loading: round trips of tiny random models written as llama.cpp does (permuted Q/K, rope_freqs,
F32 and Q8_0), parity with transformers, and dequantization of Q4_0/Q4_1 and the K-quants."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from confkv_engine.model.gguf_loader import dequantize, open_gguf, permute_rows, unpermute_rows
from confkv_engine.model.gguf_reader import read_gguf
from confkv_engine.model.loader import load_model
from confkv_engine.model.weights import ModelLoadError
from tests.engine.gguf_fixtures import pack_q4_k, pack_q5_k, pack_q6_k, write_gguf, write_raw_tensor
from tests.engine.tiny_models import (
    byte_level_tokenizer,
    dense_logits,
    hf_greedy_reference,
    make_tiny_hf_model,
)

pytest.importorskip("transformers")
torch.set_num_threads(1)
Q = gguf.GGMLQuantizationType
PROMPT = [7, 100, 31, 256, 12, 250, 64, 3, 199, 45, 87, 140, 2, 301, 77, 18]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{arch: (hf_model, f32 gguf path)}"""
    out = {}
    for arch in ("llama", "qwen2"):
        root = tmp_path_factory.mktemp(arch)
        hf_model, _ = make_tiny_hf_model(arch, root)
        out[arch] = (hf_model, write_gguf(root / f"tiny-{arch}.gguf", hf_model, arch))
    return out


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    assert not np.array_equal(permute_rows(w, 4), w)
    assert np.array_equal(unpermute_rows(permute_rows(w, 4), 4), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_round_trip_is_exact(tiny, arch):
    hf_model, path = tiny[arch]
    loaded = load_model(str(path))
    ours = loaded.model.state_dict()
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(ours[name.removeprefix("model.")], tensor), name
    assert loaded.args.attention_bias == (arch == "qwen2")
    assert loaded.args.tie_word_embeddings == (arch == "qwen2")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_gguf_matches_transformers(tiny, arch):
    """Covers the Q/K un-permutation (llama only) and Llama-3 scaling from ``rope_freqs``."""
    hf_model, path = tiny[arch]
    loaded = load_model(str(path))
    tokens, ref = hf_greedy_reference(hf_model, PROMPT, steps=20)
    assert (dense_logits(loaded.model, tokens, len(PROMPT)) - ref).abs().max().item() <= 1e-4


def test_q8_0_weights_within_quantization_error(tiny, tmp_path):
    hf_model, _ = tiny["llama"]
    path = write_gguf(tmp_path / "tiny-q8.gguf", hf_model, "llama", qtype=Q.Q8_0)
    types = {t.type_name for t in read_gguf(path).tensors.values()}
    assert types == {"Q8_0", "F32"}
    loaded = load_model(str(path))
    ours = loaded.model.state_dict()
    for name, tensor in hf_model.state_dict().items():
        got = ours[name.removeprefix("model.")]
        if tensor.ndim == 1:
            assert torch.equal(got, tensor), name
            continue
        blocks = tensor.reshape(-1, 32)
        # half a step, plus the fp16 rounding of the block scale carried over 127 steps
        bound = blocks.abs().amax(dim=1, keepdim=True) / 127 * (0.5 + 127 * 2**-11) + 1e-7
        assert ((got.reshape(-1, 32) - blocks).abs() <= bound).all(), name
    tokens, ref = hf_greedy_reference(hf_model, PROMPT, steps=4)
    diff = (dense_logits(loaded.model, tokens, len(PROMPT)) - ref).abs().max().item()
    assert 0 < diff < 0.05 * ref.abs().max().item()


def test_gguf_tokenizer_matches_source_tokenizer(tiny):
    _, path = tiny["llama"]
    loaded = load_model(str(path))
    source = byte_level_tokenizer()
    text = "the theme in a tent: 42 <|im_end|> ünï"
    assert loaded.tokenizer.encode(text) == source.encode(text, add_special_tokens=False).ids
    assert loaded.name == "tiny-llama"
    assert loaded.eos_token_ids == (source.token_to_id("<|im_end|>"),)


@pytest.mark.parametrize(("qtype", "bound"), [(Q.Q4_0, 1 / 8), (Q.Q4_1, 1 / 15), (Q.Q8_0, 1 / 127)])
def test_legacy_quants_dequantize(tmp_path, qtype, bound):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    tensor = read_gguf(write_raw_tensor(tmp_path / "t.gguf", "blk.0.attn_q.weight", raw, qtype)).tensors
    got = dequantize(tensor["blk.0.attn_q.weight"])
    assert got.shape == w.shape and got.dtype == np.float32
    blocks = w.reshape(-1, 32)
    spread = blocks.max(1) - blocks.min(1) if qtype == Q.Q4_1 else np.abs(blocks).max(1)
    assert (np.abs(got.reshape(-1, 32) - blocks) <= spread[:, None] * bound * 1.02 + 1e-6).all()


@pytest.mark.parametrize(("qtype", "pack"), [(Q.Q4_K, pack_q4_k), (Q.Q5_K, pack_q5_k), (Q.Q6_K, pack_q6_k)])
def test_k_quants_dequantize(tmp_path, qtype, pack):
    rows, blocks_per_row = 6, 2
    raw, expected = pack(np.random.default_rng(1), rows * blocks_per_row)
    raw = raw.reshape(rows, -1)
    path = write_raw_tensor(tmp_path / "k.gguf", "blk.0.ffn_up.weight", raw, qtype)
    tensor = read_gguf(path).tensors["blk.0.ffn_up.weight"]
    assert tensor.shape == (rows, 256 * blocks_per_row)
    np.testing.assert_allclose(dequantize(tensor), expected.reshape(rows, -1), rtol=1e-5, atol=1e-6)


def test_unsupported_gguf_contents_raise(tmp_path, tiny):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), arch="gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(str(tmp_path / "gpt2.gguf"))
    fake = read_gguf(tiny["llama"][1]).tensors["blk.0.attn_q.weight"]
    iq = type(fake)(name=fake.name, qtype=Q.IQ2_XXS, shape=fake.shape, data=fake.data)
    with pytest.raises(ModelLoadError, match="unsupported type IQ2_XXS"):
        dequantize(iq)
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(tiny["llama"][1].read_bytes()[:4000])
    with pytest.raises(ModelLoadError, match="corrupt|truncated"):
        open_gguf(truncated)
