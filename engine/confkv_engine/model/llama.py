"""Llama-family decoder in plain PyTorch (Llama 2/3, Mistral, Qwen2/2.5, SmolLM2).

The model owns no KV cache: every attention layer hands its post-RoPE q/k/v for the step's new
tokens to an ``AttentionBackend`` (the paged cache in serving, a dense reference in tests), which
stores k/v and returns the attention output. That keeps eviction policy entirely outside the model.

Shapes: T = tokens in this step (all sequences flattened), H = hidden size, Hq/Hkv = query/KV
heads, D = head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Build from a Hugging Face ``config.json`` dict (llama, mistral, qwen2)."""
        num_heads = cfg["num_attention_heads"]
        arch = cfg.get("model_type", "llama")
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        bias = cfg.get("attention_bias")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 1e4),
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"} or None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=(arch == "qwen2") if bias is None else bias,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 bytes of K plus V for one token over all layers (scale by dtype size / 4)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


class AttentionBackend(Protocol):
    """Stores a step's k/v and computes attention for the step's tokens.

    ``attend(layer, q, k, v)``: q [T, Hq, D], k/v [T, Hkv, D] for the T new tokens of this step
    (post-RoPE, in the order the backend's step metadata describes); returns [T, Hq, D]. Each token
    attends causally to its own sequence's cached tokens plus the new ones up to itself.
    """

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


def llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    """Llama-3 frequency-dependent RoPE scaling (rope_type 'llama3')."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(args: ModelArgs) -> Tensor:
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    return inv_freq.float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Half-split (NeoX/HF) rotation. x [T, Hx, D]; cos/sin [T, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # One fused kernel (fp32 statistics, as Hugging Face computes them) instead of five ops.
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


@dataclass
class Elementwise:
    """The elementwise functions the layers call; ``model.compiled`` swaps in compiled ones.
    ``None`` means the module-level function (looked up at call time)."""

    norm: Callable[[Tensor, Tensor, float], Tensor] | None = None
    rope: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None
    act: Callable[[Tensor, Tensor], Tensor] | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Elementwise | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = ops or Elementwise()

    def forward(self, x: Tensor) -> Tensor:
        return (self.ops.norm or rms_norm)(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, ops: Elementwise | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.ops = ops or Elementwise()
        self.nq, self.nkv, self.d = args.num_heads, args.num_kv_heads, args.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.nq * self.d, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.nkv * self.d, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.nkv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.nq * self.d, args.hidden_size, bias=False)
        self.qkv_proj: nn.Module | None = None  # set by ``fuse``: q, k, v rows in one matmul

    def fuse(self, qkv_proj: nn.Module) -> None:
        """Serve q/k/v through one linear whose output rows are q's, then k's, then v's."""
        self.qkv_proj = qkv_proj
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend) -> Tensor:
        t = x.shape[0]
        rope = self.ops.rope or apply_rope
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(t, self.nq + 2 * self.nkv, self.d)
            qk = rope(qkv[:, : self.nq + self.nkv], cos, sin)  # q and k heads rotated together
            q, k, v = qk[:, : self.nq], qk[:, self.nq :], qkv[:, self.nq + self.nkv :]
        else:
            q = rope(self.q_proj(x).view(t, self.nq, self.d), cos, sin)  # [T, Hq, D]
            k = rope(self.k_proj(x).view(t, self.nkv, self.d), cos, sin)  # [T, Hkv, D]
            v = self.v_proj(x).view(t, self.nkv, self.d)
        out = backend.attend(self.layer, q, k, v)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.nq * self.d))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, ops: Elementwise | None = None) -> None:
        super().__init__()
        self.ops = ops or Elementwise()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # set by ``fuse``: gate rows, then up rows

    def fuse(self, gate_up_proj: nn.Module) -> None:
        self.gate_up_proj = gate_up_proj
        del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        act = self.ops.act or silu_mul
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(act(gate, up))
        return self.down_proj(act(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, ops: Elementwise | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer, ops)
        self.mlp = MLP(args, ops)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Parameter names follow Hugging Face's (``model.layers.N.self_attn.q_proj.weight``...) minus
    the ``model.`` prefix, so HF state dicts load after stripping it."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.ops = Elementwise()  # shared by every layer: one swap changes them all
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i, self.ops) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, self.ops)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def forward(self, input_ids: Tensor, positions: Tensor, backend: AttentionBackend) -> Tensor:
        """input_ids/positions [T] -> final hidden states [T, H] (normed)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, backend)
        return self.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, H] -> fp32 logits [N, V]."""
        return self.lm_head(hidden).float()


class DenseAttention:
    """Reference backend for one sequence: keeps every k/v densely and attends causally.

    Used by tests and as the simplest correct implementation; not for serving.
    """

    def __init__(self) -> None:
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        prev_k = self.keys.get(layer)
        k_all = k if prev_k is None else torch.cat([prev_k, k])  # [S, Hkv, D]
        v_all = v if prev_k is None else torch.cat([self.values[layer], v])
        self.keys[layer], self.values[layer] = k_all, v_all
        return dense_causal_attention(q, k_all, v_all)


def dense_causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """q [T, Hq, D] are the last T of S positions; k/v [S, Hkv, D]; returns [T, Hq, D] (fp32 math)."""
    t, nq, d = q.shape
    s, nkv = k.shape[0], k.shape[1]
    group = nq // nkv
    kf = k.float().repeat_interleave(group, dim=1)  # [S, Hq, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), kf) / math.sqrt(d)  # [Hq, T, S]
    q_pos = torch.arange(s - t, s)[:, None]
    mask = torch.arange(s)[None, :] > q_pos  # [T, S]
    scores = scores.masked_fill(mask[None], float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), vf)
    return out.to(q.dtype)
