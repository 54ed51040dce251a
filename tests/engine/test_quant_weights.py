"""Quantized weights: the maths (exact Q4 -> int4 conversion), the kernels, the module swap and
``load_model(weights=...)`` on tiny GGUF fixtures against the dequantized dense model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from confkv_engine.model import kernels, q8native
from confkv_engine.model.gguf_loader import dequantize
from confkv_engine.model.gguf_reader import read_gguf
from confkv_engine.model.loader import load_model
from confkv_engine.model.qlinear import QuantLinear, build_quant_linear
from confkv_engine.model.quant import int8_keeps_dense, quantize_int4, quantize_int8, unpack_q4
from confkv_engine.model.weights import ModelLoadError
from tests.engine.gguf_fixtures import write_gguf, write_raw_tensor
from tests.engine.tiny_models import dense_logits, make_tiny_hf_model

pytest.importorskip("transformers")
torch.set_num_threads(1)
Q = gguf.GGMLQuantizationType
PROMPT = [7, 100, 31, 256, 12, 250, 64, 3, 199, 45, 87, 140]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_q4_blocks_unpack_exactly(tmp_path, qtype):
    w = np.random.default_rng(1).standard_normal((40, 96)).astype(np.float32)
    path = write_raw_tensor(tmp_path / "t.gguf", "blk.0.attn_q.weight", gguf.quants.quantize(w, qtype), qtype)
    tensor = read_gguf(path).tensors["blk.0.attn_q.weight"]
    int4 = unpack_q4(tensor.data, tensor.type_name, 96)
    assert int4.q.min() >= 0 and int4.q.max() <= 15 and int4.group == 32
    assert torch.equal(int4.dequantize(), torch.from_numpy(dequantize(tensor)))


def test_dense_quantizers_stay_within_one_step():
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    int4, int8 = quantize_int4(w), quantize_int8(w)
    assert ((int4.dequantize() - w).abs() <= int4.scale.repeat_interleave(32, 1) / 2 + 1e-6).all()
    assert ((int8.dequantize() - w).abs() <= int8.scale[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("name", ["int4", "int8", "dense"])
def test_kernels_match_dense_matmul_in_fp32(name):
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(48, 64, generator=gen), torch.randn(5, 64, generator=gen)
    b = torch.randn(48, generator=gen)
    weight = quantize_int4(w) if name == "int4" else quantize_int8(w)
    fn = {"int4": kernels.int4_kernel, "int8": kernels.int8_kernel}.get(name)
    dense = weight.dequantize()
    run = kernels.dense_kernel(dense, b, torch.float32) if fn is None else fn(weight, b, torch.float32)
    assert torch.allclose(run(x), F.linear(x, dense, b), atol=1e-4, rtol=1e-4)


def test_quant_linear_dispatches_on_rows():
    weight = quantize_int4(torch.randn(32, 64))
    plan = ["int4", "int4", "dense", "dense", "dense"]  # per ROW_GRID bucket (1, 4, 16, 64, 256)
    table = kernels.KernelTable({kernels.KernelTable.key("int4", 32, 64): plan}, "measured")
    layer = build_quant_linear(weight, None, torch.float32, table)
    assert [layer.kernel_for(r) for r in (1, 4, 5, 1000)] == ["int4", "int4", "dense", "dense"]
    x = torch.randn(3, 7, 64)  # leading dims are flattened into rows and restored
    assert torch.allclose(layer(x), F.linear(x, weight.dequantize()), atol=1e-4)


def test_derived_table_follows_the_cpu():
    with_bf16 = kernels.CpuInfo("AVX512", frozenset({"avx512_bf16"}), "x")
    avx2 = kernels.CpuInfo("AVX2", frozenset({"avx2"}), "y")
    assert kernels.activation_dtype(with_bf16) == torch.bfloat16
    assert kernels.activation_dtype(avx2) == torch.float32
    assert kernels.derived_choice("int4", 1, with_bf16) == "int4"
    assert kernels.derived_choice("int4", 256, with_bf16) == "dense"
    assert kernels.derived_choice("int8", 8, avx2) == "dense"


def test_measured_table_is_cached(tmp_path):
    shapes = [("int4", 32, 64), ("int8", 16, 64)]
    first = kernels.load_or_measure(shapes, torch.float32, measure=True, cache_dir=tmp_path)
    assert first.source == "measured" and len(list(tmp_path.glob("kernels-*.json"))) == 1
    for kind, n, k in shapes:
        assert {name for _, name in first.plan(kind, n, k)} <= set(kernels.CANDIDATES[kind])
    again = kernels.load_or_measure(shapes, torch.float32, measure=True, cache_dir=tmp_path)
    assert again.choices == first.choices
    assert kernels.load_or_measure(shapes, torch.float32, measure=False).source == "derived"


@pytest.fixture(scope="module")
def q4_1_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("q41")
    hf_model, _ = make_tiny_hf_model("llama", root)
    return write_gguf(root / "tiny-q4_1.gguf", hf_model, "llama", Q.Q4_1)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_int4_from_q4_1_within_bf16_rounding_of_dequantized(q4_1_llama):
    """Decode steps (one row) go through an int4 kernel; its logits differ from the fp32
    dequantized model by no more than the bf16 dense model does (plus a little)."""
    dense = load_model(str(q4_1_llama), torch.float32)
    bf16 = load_model(str(q4_1_llama), weights="bf16")
    int4 = load_model(str(q4_1_llama), weights="int4")
    layers = [m for m in int4.model.modules() if isinstance(m, QuantLinear)]
    # per layer: qkv, o, gate_up, down (q/k/v and gate/up fused); plus the LM head
    one_row = kernels.derived_choice("int4", 1, kernels.cpu_info())  # int4, or q4n where it wins
    assert len(layers) == 2 * 4 + 1 and all(m.kernel_for(1) == one_row for m in layers if m.kind == "int4")
    assert int4.weights == "int4" and int4.dtype == kernels.activation_dtype()
    tokens = PROMPT + [5, 77, 300, 12, 9, 41]
    ref = dense_logits(dense.model, tokens, len(PROMPT))
    bf16_err = _max_diff(dense_logits(bf16.model, tokens, len(PROMPT)), ref)
    int4_err = _max_diff(dense_logits(int4.model, tokens, len(PROMPT)), ref)
    assert int4_err <= 2 * bf16_err + 1e-3, (int4_err, bf16_err)


@pytest.mark.parametrize("native8", ["1", "0"])
def test_auto_serves_q8_0_as_int8(tmp_path, monkeypatch, native8):
    """Q8_0 blocks as stored (int8 with their scale per 32, ``int8g``) where the native int8 kernel
    serves int8 weights; per-row int8 where it does not (or is switched off)."""
    monkeypatch.setenv(q8native.SWITCH, native8)
    hf_model, _ = make_tiny_hf_model("qwen2", tmp_path)  # tied embeddings, q/k/v biases
    path = write_gguf(tmp_path / "tiny-q8.gguf", hf_model, "qwen2", Q.Q8_0)
    dense = load_model(str(path), torch.float32)
    auto = load_model(str(path), weights="auto")
    kinds = {m.kind for m in auto.model.modules() if isinstance(m, QuantLinear)}
    grouped = native8 == "1" and kernels.grouped_int8_served()
    assert auto.weights == "int4" and kinds == ({"int8g"} if grouped else {"int8"})  # no 4-bit tensor
    assert auto.model.lm_head is not auto.model.embed_tokens  # the tied head got its own weights
    ref = dense_logits(dense.model, PROMPT, 8)
    assert _max_diff(dense_logits(auto.model, PROMPT, 8), ref) <= 0.05 * ref.abs().max().item()


def test_dense_source_quantizes_on_request(tmp_path):
    _, hf_dir = make_tiny_hf_model("llama", tmp_path)
    assert load_model(str(hf_dir), weights="auto").weights == "fp32"
    int8 = load_model(str(hf_dir), weights="int8")
    assert {m.kind for m in int8.model.modules() if isinstance(m, QuantLinear)} == {"int8"}
    attn = int8.model.layers[0].self_attn
    assert type(attn.q_proj) is type(attn.v_proj) is torch.nn.Linear  # INT8_DENSE_LINEARS
    assert isinstance(attn.k_proj, QuantLinear)


def test_int8_mode_keeps_query_and_value_projections_dense(q4_1_llama):
    """``--weights int8`` on a Q4_1 file: q/v stay dense in the activation dtype (so q/k/v are not
    fused), every other linear is per-row int8; int4 mode still quantizes q/v. Decode logits stay
    close to the dequantized model."""
    dense = load_model(str(q4_1_llama), torch.float32)
    int8 = load_model(str(q4_1_llama), weights="int8")
    int4 = load_model(str(q4_1_llama), weights="int4")
    for layer in int8.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv_proj is None and attn.q_proj.weight.dtype == int8.dtype
        assert type(attn.q_proj) is type(attn.v_proj) is torch.nn.Linear
        assert all(isinstance(m, QuantLinear) and m.kind == "int8"
                   for m in (attn.k_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
    assert all(layer.self_attn.qkv_proj is not None for layer in int4.model.layers)
    tokens = PROMPT + [5, 77, 300, 12, 9, 41]
    ref = dense_logits(dense.model, tokens, len(PROMPT))
    assert _max_diff(dense_logits(int8.model, tokens, len(PROMPT)), ref) <= 0.05 * ref.abs().max().item()


@pytest.mark.parametrize(("path", "kept"), [("layers.3.self_attn.q_proj", True), ("v_proj", True),
                                            ("layers.3.self_attn.k_proj", False), ("lm_head", False),
                                            ("layers.0.mlp.down_proj", False)])
def test_int8_dense_linears_match_on_the_last_path_part(path, kept):
    assert int8_keeps_dense(path) is kept


def test_bad_weights_modes_are_rejected(q4_1_llama):
    with pytest.raises(ModelLoadError, match="unknown weights mode"):
        load_model(str(q4_1_llama), weights="int3")
    with pytest.raises(ModelLoadError, match="CPU kernels only"):
        load_model(str(q4_1_llama), device="cuda", weights="int4")


def test_engine_on_quantized_model_matches_dense_reference(q4_1_llama):
    """Paged attention over the fused, quantized model gives the tokens the dense reference
    backend gives on the same model (same kernels: prompt and decode rows dispatch alike)."""
    from confkv_engine.core.engine import LLMEngine
    from confkv_engine.core.sampling_params import SamplingParams

    loaded = load_model(str(q4_1_llama), weights="int4")
    assert loaded.model.layers[0].self_attn.qkv_proj is not None
    out = LLMEngine(loaded).generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    tokens = PROMPT + out[0].output_token_ids
    logits = dense_logits(loaded.model, tokens, len(PROMPT))
    assert logits[len(PROMPT) - 1:-1].argmax(-1).tolist() == out[0].output_token_ids
