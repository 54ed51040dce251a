"""The native row-wise blocks (model/_rowops.c via model.rowops) against the PyTorch reference
functions of model.llama, one by one and in a whole forward pass (Llama-style and Gemma-style layers,
fused q/k/v and gate/up as the quantized models run them)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from confkv_engine.model import llama, rowops
from confkv_engine.model.llama import DenseAttention, LlamaForCausalLM, ModelArgs

pytestmark = pytest.mark.skipif(not rowops.available(), reason="the native row-op library is not built")
DTYPES = [torch.float32, torch.bfloat16]


def _close(got: Tensor, ref: Tensor, share: float = 0.01) -> None:
    """The same roundings of the same fp32 values, up to a sum taken in another order (and the last
    bit of exp / tanh): fp32 within a few ulps; bf16 within one bf16 step, and on few elements."""
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=1e-6)
        assert (got != ref).float().mean().item() <= share
    else:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)


def _rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0, shift: float = 0.0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_norms_match_reference(dtype: torch.dtype, rows: int) -> None:
    x, y = _rand(rows, 576, dtype=dtype, seed=1, scale=3.0), _rand(rows, 576, dtype=dtype, seed=2)
    w, w2 = _rand(576, dtype=dtype, seed=3, scale=0.2, shift=1.0), _rand(576, dtype=dtype, seed=4, shift=1.0)
    _close(rowops.rms_norm(x, w, 1e-5), llama.rms_norm(x, w, 1e-5))
    s, h = rowops.add_rms_norm(x, y, w, 1e-5)
    assert torch.equal(s, x + y)
    _close(h, llama.rms_norm(x + y, w, 1e-5))
    s, h = rowops.add_rms_norm(x, y, w, 1e-6, y_weight=w2)  # Gemma: x + post-norm(y), then the next norm
    ref_s = x + llama.rms_norm(y, w2, 1e-6)
    _close(s, ref_s)
    _close(h, llama.rms_norm(s, w, 1e-6))
    s, h = rowops.add_rms_norm(x, y, None, 1e-6, y_weight=w2)
    assert h is None
    _close(s, ref_s)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("qk_norm,q_scale", [(False, 1.0), (True, 1.0), (True, 0.7)])
def test_qk_rope_matches_reference(dtype: torch.dtype, rows: int, qk_norm: bool, q_scale: float) -> None:
    nq, nkv, d = 4, 2, 64
    qkv = _rand(rows, nq + 2 * nkv, d, dtype=dtype, seed=5)
    freqs = torch.arange(300, 300 + rows).float()[:, None] * (1e4 ** (-torch.arange(0, d, 2).float() / d))
    cos, sin = freqs.cos(), freqs.sin()
    norm_w = _rand(nq + nkv, d, dtype=dtype, seed=6, shift=1.0) if qk_norm else None
    qk = qkv[:, : nq + nkv]
    ref = llama.apply_rope(llama.rms_norm(qk, norm_w, 1e-6) if norm_w is not None else qk, cos, sin)
    got = qkv.clone()
    assert rowops.qk_rope_(got, nq + nkv, nq, cos, sin, norm_w, 1e-6, q_scale)
    _close(got[:, :nq], ref[:, :nq] * q_scale if q_scale != 1.0 else ref[:, :nq])
    _close(got[:, nq : nq + nkv], ref[:, nq:])
    assert torch.equal(got[:, nq + nkv :], qkv[:, nq + nkv :])  # the value heads are left alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activations_match_reference(dtype: torch.dtype) -> None:
    gate_up = _rand(rowops.ACT_MAX_ROWS["silu"], 2 * 1536, dtype=dtype, seed=7, scale=3.0)
    _close(rowops.gated_act(gate_up, "silu"), llama.silu_mul(*gate_up.chunk(2, -1)))
    got, ref = rowops.gated_act(gate_up, "gelu_pytorch_tanh"), llama.gelu_tanh_mul(*gate_up.chunk(2, -1))
    _close(got, ref, share=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 40])
def test_gelu_at_any_row_count_and_far_tails(dtype: torch.dtype, rows: int) -> None:
    """GELU runs natively at every row count (40: the OpenMP path); its exp is clamped far out in
    both tails, where the result is the input itself or zero to within the tolerance."""
    gate_up = _rand(rows, 2 * 2048, dtype=dtype, seed=8, scale=3.0)
    gate_up[:, :8] = torch.tensor([-200.0, -90.0, -12.0, -0.0, 1e-30, 12.0, 90.0, 200.0]).to(dtype)
    got = rowops.gated_act(gate_up, "gelu_pytorch_tanh")
    assert got is not None
    _close(got, llama.gelu_tanh_mul(*gate_up.chunk(2, -1)), share=0.02)


def test_declines_what_it_does_not_serve() -> None:
    x, w = torch.randn(2, 64), torch.ones(64)
    assert rowops.rms_norm(x.half(), w.half(), 1e-5) is None  # fp16
    assert rowops.rms_norm(x, w.bfloat16(), 1e-5) is None  # mixed dtypes
    assert rowops.rms_norm(x.t().contiguous().t(), torch.ones(2), 1e-5) is None  # not contiguous
    assert rowops.rms_norm(x.requires_grad_(), w, 1e-5) is None  # autograd
    assert rowops.gated_act(torch.randn(2, 8), "relu") is None
    assert rowops.gated_act(torch.randn(rowops.ACT_MAX_ROWS["silu"] + 1, 8), "silu") is None  # PyTorch's


def _fused(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """q/k/v and gate/up stacked into one linear each, as ``qlinear.swap_linears`` serves them."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = nn.Linear(attn.q_proj.in_features, attn.nq * attn.d + 2 * attn.nkv * attn.d, bias=False)
        qkv.weight.data = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        attn.fuse(qkv)
        gate_up = nn.Linear(mlp.gate_proj.in_features, 2 * mlp.gate_proj.out_features, bias=False)
        gate_up.weight.data = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        mlp.fuse(gate_up)
    return model


def _model(gemma: bool, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    extra = dict(qk_norm=True, sandwich_norms=True, hidden_act="gelu_pytorch_tanh", embed_scale=8.0,
                 attn_scale=0.2, layer_windows=(4, 0), local_rope_theta=1e4) if gemma else {}
    args = ModelArgs(vocab_size=200, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, rope_theta=1e5, **extra)
    model = LlamaForCausalLM(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1.0)
    return _fused(model).to(dtype).requires_grad_(False)


def _hidden(model: LlamaForCausalLM, tokens: Tensor) -> Tensor:
    with torch.inference_mode():
        backend = DenseAttention()
        prefill = model(tokens[:-2], torch.arange(len(tokens) - 2), backend)
        n = len(tokens)
        steps = [model(tokens[i : i + 1], torch.tensor([i]), backend) for i in (n - 2, n - 1)]
        return torch.cat([prefill, *steps]).float()


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_reference_blocks(gemma: bool, dtype: torch.dtype) -> None:
    model = _model(gemma, dtype)
    tokens = torch.randint(0, 200, (21,), generator=torch.Generator().manual_seed(1))
    native = _hidden(model, tokens)
    # The reference functions set explicitly: every native call site then runs them instead.
    model.ops.norm, model.ops.rope, model.ops.act = llama.rms_norm, llama.apply_rope, llama.silu_mul
    reference = _hidden(model, tokens)
    if dtype == torch.float32:
        torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)
    else:  # a bf16 step here and there, which later roundings carry a little further
        torch.testing.assert_close(native, reference, rtol=3e-2, atol=3e-2)
        assert ((native - reference).norm() / reference.norm()).item() < 5e-3
