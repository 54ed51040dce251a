"""Llama-family decoder in plain PyTorch (Llama 2/3, Mistral, Qwen2/2.5/3, Gemma 3, SmolLM2).

One module serves them all; ``ModelArgs`` switches on what differs (``model.arch`` reads each
checkpoint's config into them):

- Qwen3 and Gemma 3 normalise each query and key head (``qk_norm``) before RoPE;
- Gemma 3 scales the embeddings by sqrt(hidden), wraps both sublayers in a pre- and a post-norm
  (``sandwich_norms``), gates with GELU (tanh) instead of SiLU, scales the scores by
  ``query_pre_attn_scalar ** -0.5`` (``attn_scale``), may soft-cap the final logits, and interleaves
  sliding-window layers (``layer_windows``) that have their own RoPE base (``local_rope_theta``).
  Its RMSNorm multiplies by ``1 + w``; the loaders store ``1 + w`` (GGUF files already do), so one
  norm serves every family;
- a sliding-window layer hands its window to the backend (``attend(..., window=W)``): the token at
  position p sees the keys at positions p - W + 1 .. p, as transformers masks them.

The elementwise blocks (RMSNorm, the residual add with the next norm, q/k norms with RoPE, the gated
activation) run as one native call each where ``model.rowops`` serves them (CPU, fp32 / bf16, its
library built, no ``Elementwise`` override set), else as the PyTorch functions below, which remain
the reference.

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

from confkv_engine.model import rowops
from confkv_engine.model.rope import llama3_inv_freq, rope_frequencies

__all__ = ["ModelArgs", "AttentionBackend", "LlamaForCausalLM", "DenseAttention", "dense_causal_attention",
           "rope_inv_freq", "llama3_inv_freq", "Elementwise"]


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
    qk_norm: bool = False
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh"
    embed_scale: float | None = None
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcap: float | None = None
    layer_windows: tuple[int, ...] = ()  # per layer, 0 = global attention; () = all global
    local_rope_theta: float | None = None  # RoPE base of the sliding-window layers (unscaled)
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

    def window(self, layer: int) -> int | None:
        """The layer's sliding window in tokens, None for a global layer."""
        return (self.layer_windows[layer] or None) if self.layer_windows else None

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 bytes of K plus V for one token over all layers (scale by dtype size / 4)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


class AttentionBackend(Protocol):
    """Stores a step's k/v and computes attention for the step's tokens.

    ``attend(layer, q, k, v)``: q [T, Hq, D], k/v [T, Hkv, D] for the T new tokens of this step
    (post-RoPE, in the order the backend's step metadata describes); returns [T, Hq, D]. Each token
    attends causally to its own sequence's cached tokens plus the new ones up to itself. Scores are
    scaled by D ** -0.5. A sliding-window layer passes ``window=W`` (only then, so a backend for
    models without such layers may omit the keyword): a token sees the last W positions up to itself.
    """

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor: ...


def rope_inv_freq(args: ModelArgs) -> Tensor:
    """The global layers' RoPE inverse frequencies (fp32)."""
    return rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling,
                            args.max_position_embeddings)[0]


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


def gelu_tanh_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.gelu(gate, approximate="tanh") * up


_GATED_ACTS = {"silu": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul}


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
        if self.ops.norm is None:
            out = rowops.rms_norm(x, self.weight, self.eps)  # one native call, else the reference
            if out is not None:
                return out
        return (self.ops.norm or rms_norm)(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, ops: Elementwise | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.ops = ops or Elementwise()
        self.nq, self.nkv, self.d = args.num_heads, args.num_kv_heads, args.head_dim
        self.window = args.window(layer)
        # The backends scale scores by head_dim ** -0.5; another scale is folded into the queries.
        scale = args.attn_scale
        self.q_scale = 1.0 if scale is None else scale * math.sqrt(self.d)
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.nq * self.d, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.nkv * self.d, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.nkv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.nq * self.d, args.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, args.rms_norm_eps, ops) if args.qk_norm else None
        self.k_norm = RMSNorm(self.d, args.rms_norm_eps, ops) if args.qk_norm else None
        self.qkv_proj: nn.Module | None = None  # set by ``fuse``: q, k, v rows in one matmul
        self.qk_norm_weight: Tensor | None  # set by ``fuse`` with q/k norms: [Hq + Hkv, D]
        self.register_buffer("qk_norm_weight", None, persistent=False)

    def fuse(self, qkv_proj: nn.Module) -> None:
        """Serve q/k/v through one linear whose output rows are q's, then k's, then v's. With
        per-head q/k norms, their weights are stacked per head so that the adjacent q and k heads
        are normalised (and then rotated) in one call each, with the same per-element maths."""
        self.qkv_proj = qkv_proj
        del self.q_proj, self.k_proj, self.v_proj
        if self.q_norm is not None and self.k_norm is not None:
            stacked = torch.cat([self.q_norm.weight.expand(self.nq, self.d),
                                 self.k_norm.weight.expand(self.nkv, self.d)])
            self.qk_norm_weight = stacked

    def _qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Post-RoPE q [T, Hq, D] (times ``q_scale``), k/v [T, Hkv, D]."""
        t = x.shape[0]
        rope = self.ops.rope or apply_rope
        if self.qkv_proj is not None:  # q and k heads are adjacent: normed and rotated in one call
            qkv = self.qkv_proj.forward(x).view(t, self.nq + 2 * self.nkv, self.d)
            heads = self.nq + self.nkv
            qk, v = qkv[:, :heads], qkv[:, heads:]
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            # Native: norm, rotation and query scale in place on the projection's fresh output.
            native = self.ops.norm is None and self.ops.rope is None
            if native and rowops.qk_rope_(qkv, heads, self.nq, cos, sin, self.qk_norm_weight, eps,
                                          self.q_scale):
                return qkv[:, : self.nq], qkv[:, self.nq : heads], v
            if self.q_norm is not None and self.qk_norm_weight is not None:
                qk = (self.ops.norm or rms_norm)(qk, self.qk_norm_weight, eps)
            qk = rope(qk, cos, sin)
            return self._scaled(qk[:, : self.nq]), qk[:, self.nq :], v
        q = self.q_proj(x).view(t, self.nq, self.d)
        k = self.k_proj(x).view(t, self.nkv, self.d)
        v = self.v_proj(x).view(t, self.nkv, self.d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self._scaled(rope(q, cos, sin)), rope(k, cos, sin), v

    def _scaled(self, q: Tensor) -> Tensor:
        return q * self.q_scale if self.q_scale != 1.0 else q

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend) -> Tensor:
        q, k, v = self._qkv(x, cos, sin)
        if self.window is None:
            out = backend.attend(self.layer, q, k, v)  # [T, Hq, D]
        else:
            out = backend.attend(self.layer, q, k, v, window=self.window)
        return self.o_proj.forward(out.reshape(x.shape[0], self.nq * self.d))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, ops: Elementwise | None = None) -> None:
        super().__init__()
        self.ops = ops or Elementwise()
        # ``ops.act`` (possibly compiled) is SiLU's; other activations keep their own function.
        self.act = None if args.hidden_act == "silu" else _GATED_ACTS[args.hidden_act]
        self.act_name = args.hidden_act
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # set by ``fuse``: gate rows, then up rows

    def fuse(self, gate_up_proj: nn.Module) -> None:
        self.gate_up_proj = gate_up_proj
        del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        act = self.act or self.ops.act or silu_mul
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj.forward(x)
            gated = rowops.gated_act(gate_up, self.act_name) if self.ops.act is None else None
            return self.down_proj.forward(act(*gate_up.chunk(2, dim=-1)) if gated is None else gated)
        return self.down_proj(act(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, ops: Elementwise | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer, ops)
        self.mlp = MLP(args, ops)
        h, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, ops)
        # Llama: the norm before the MLP. Gemma: the norm after attention, with two around the MLP.
        self.post_attention_layernorm = RMSNorm(h, eps, ops)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, ops) if args.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(h, eps, ops) if args.sandwich_norms else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend) -> Tensor:
        pre, post = self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        attn = self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, backend)
        if pre is None or post is None:  # Llama: x + attn, then its norm, in one native call
            fused = self._add_norm(x, attn, self.post_attention_layernorm)
            x, h = fused or (x + attn, None)
            return x + self.mlp.forward(h if h is not None else self.post_attention_layernorm(x))
        # Gemma: x + post-norm(attn), then the pre-feedforward norm; x + post-norm(mlp) at the end.
        fused = self._add_norm(x, attn, pre, self.post_attention_layernorm)
        x, h = fused or (x + self.post_attention_layernorm(attn), None)
        mlp = self.mlp.forward(h if h is not None else pre(x))
        fused = self._add_norm(x, mlp, None, post)
        return fused[0] if fused else x + post(mlp)

    def _add_norm(self, x: Tensor, y: Tensor, norm: RMSNorm | None,
                  y_norm: RMSNorm | None = None) -> tuple[Tensor, Tensor | None] | None:
        """``rowops.add_rms_norm`` with the layer's norms, None where the reference must run."""
        if self.input_layernorm.ops.norm is not None:
            return None
        eps = self.input_layernorm.eps
        return rowops.add_rms_norm(x, y, None if norm is None else norm.weight, eps,
                                   None if y_norm is None else y_norm.weight)


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
        inv_freq, self.rope_attention_factor = rope_frequencies(
            args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        local = None if args.local_rope_theta is None else rope_frequencies(
            args.head_dim, args.local_rope_theta, None, args.max_position_embeddings)[0]
        self.register_buffer("local_inv_freq", local, persistent=False)

    def _cos_sin(self, positions: Tensor, inv_freq: Tensor, factor: float) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        if factor == 1.0:
            return freqs.cos(), freqs.sin()
        return freqs.cos() * factor, freqs.sin() * factor

    def forward(self, input_ids: Tensor, positions: Tensor, backend: AttentionBackend) -> Tensor:
        """input_ids/positions [T] -> final hidden states [T, H] (normed)."""
        rope = self._cos_sin(positions, self.inv_freq, self.rope_attention_factor)
        local = rope if self.local_inv_freq is None else self._cos_sin(positions, self.local_inv_freq, 1.0)
        x = self.embed_tokens(input_ids)
        if self.args.embed_scale is not None:  # in the activation dtype, as Gemma rounds it
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
        # Layers call their children's ``forward`` directly on the per-step path: at one decode row
        # ``nn.Module.__call__``'s hook bookkeeping, about 240 calls a step for SmolLM2, cost several
        # per cent of the step, and no hooks are registered on these modules.
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, *(rope if self.args.window(i) is None else local), backend)
        return self.norm(x)

    def compute_logits(self, hidden: Tensor, fp32: bool = True) -> Tensor:
        """hidden [N, H] -> logits [N, V], fp32 (soft-capped where the model caps them).

        ``fp32=False`` returns an uncapped head's output in its own dtype (bf16 activations give
        bf16 logits): widening to fp32 is exact, so every comparison (an argmax) is the same, and a
        greedy step skips a [N, V] fp32 copy (32 x 262,144 for Gemma 3: 7 ms a step here).
        """
        logits = self.lm_head(hidden)
        cap = self.args.final_logit_softcap
        if cap is None:
            return logits.float() if fp32 else logits
        logits = logits.float()
        return torch.tanh(logits / cap) * cap

    def greedy_tokens(self, hidden: Tensor) -> Tensor | None:
        """hidden [N, H] -> each row's argmax of ``compute_logits(hidden, fp32=False)`` [N], without
        the logits, where the head's kernel fuses it (the native int8 / int4 ones: at one row the
        262,144 x 640 head's logits and their scan were a third of its time); None elsewhere. A
        soft-capped head keeps the logits: saturated caps can tie where the raw logits do not."""
        argmax = getattr(self.lm_head, "argmax", None)  # a QuantLinear's; nn.Linear has none
        if self.args.final_logit_softcap is not None or argmax is None:
            return None
        return argmax(hidden)


class DenseAttention:
    """Reference backend for one sequence: keeps every k/v densely and attends causally.

    Used by tests and as the simplest correct implementation; not for serving.
    """

    def __init__(self) -> None:
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
        prev_k = self.keys.get(layer)
        k_all = k if prev_k is None else torch.cat([prev_k, k])  # [S, Hkv, D]
        v_all = v if prev_k is None else torch.cat([self.values[layer], v])
        self.keys[layer], self.values[layer] = k_all, v_all
        return dense_causal_attention(q, k_all, v_all, window)


def dense_causal_attention(q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
    """q [T, Hq, D] are the last T of S positions; k/v [S, Hkv, D]; returns [T, Hq, D] (fp32 math).
    ``window``: each query sees only the last ``window`` positions up to itself."""
    t, nq, d = q.shape
    s, nkv = k.shape[0], k.shape[1]
    group = nq // nkv
    kf = k.float().repeat_interleave(group, dim=1)  # [S, Hq, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), kf) / math.sqrt(d)  # [Hq, T, S]
    q_pos = torch.arange(s - t, s)[:, None]
    mask = torch.arange(s)[None, :] > q_pos  # [T, S]
    if window is not None:
        mask |= torch.arange(s)[None, :] <= q_pos - window
    scores = scores.masked_fill(mask[None], float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), vf)
    return out.to(q.dtype)
