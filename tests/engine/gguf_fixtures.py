"""Writing test GGUF files the way llama.cpp's convert_hf_to_gguf does, and packing K-quant blocks
by hand (gguf.quants has no K-quant quantizer) with the values they must decode to."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np

from confkv_engine.model.gguf_loader import permute_rows
from tests.engine.tiny_models import byte_level_tokenizer

Q = gguf.GGMLQuantizationType
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_GEMMA_NAMES = {**_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    name = hf_name.removeprefix("model.")
    fixed = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if name in fixed:
        return fixed[name]
    if name == "lm_head.weight":
        return "output.weight"
    _, layer, rest = name.split(".", 2)
    module, suffix = rest.rsplit(".", 1)
    names = _GEMMA_NAMES if arch == "gemma3" else _LAYER_NAMES
    return f"blk.{layer}.{names[module]}.{suffix}"


def llama3_rope_factors(config) -> np.ndarray:
    """convert_hf_to_gguf's ``rope_freqs`` for rope_type llama3 (divisors of the base frequencies)."""
    rope = config.rope_scaling if getattr(config, "rope_scaling", None) else config.rope_parameters
    base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    spec = json.loads(byte_level_tokenizer().to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    specials = {t["content"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def write_gguf(path: Path, hf_model, arch: str, qtype: Q = Q.F32,
               overrides: dict[str, tuple[np.ndarray, Q]] | None = None) -> Path:
    """``hf_model`` (transformers, tiny) -> GGUF at ``path``: 2D weights in ``qtype``, norms and
    biases F32, Q/K rows permuted for llama (as llama.cpp does), llama3 scaling as ``rope_freqs``.
    ``overrides``: HF tensor name -> (raw encoded rows, type) written instead (K-quant blocks)."""
    overrides = overrides or {}
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "gemma3":
        _add_gemma3_fields(writer, cfg)
    else:
        theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
        writer.add_rope_freq_base(float(theta))
    if getattr(cfg, "head_dim", None):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    _add_tokenizer(writer)
    tied = getattr(cfg, "tie_word_embeddings", False)
    for name, tensor in hf_model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        array = tensor.float().numpy().copy()
        if arch == "gemma3" and name.endswith("norm.weight"):  # convert_hf_to_gguf stores 1 + w
            array = array + 1
        if arch == "llama" and ".q_proj." in name:
            array = permute_rows(array, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = permute_rows(array, cfg.num_key_value_heads)
        if name in overrides:
            raw, raw_type = overrides[name]
            writer.add_tensor(gguf_name(name, arch), raw.reshape(array.shape[0], -1), raw_dtype=raw_type)
        elif array.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(gguf_name(name, arch), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name, arch), array)
    if arch == "llama" and (getattr(cfg, "rope_scaling", None) or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_gemma3_fields(writer: gguf.GGUFWriter, cfg) -> None:
    """What convert_hf_to_gguf writes for Gemma 3 (llama.cpp assumes the rest: every sixth layer
    global, local RoPE base 10,000, scores scaled by key_length ** -0.5)."""
    full = cfg.rope_parameters["full_attention"]
    writer.add_rope_freq_base(float(full["rope_theta"]))
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full["factor"]))
    writer.add_sliding_window(cfg.sliding_window)
    if cfg.final_logit_softcapping:
        writer.add_float32("gemma3.final_logit_softcapping", cfg.final_logit_softcapping)


def write_raw_tensor(path: Path, name: str, raw: np.ndarray, qtype: Q) -> Path:
    """A GGUF holding one already-encoded tensor (rows of block bytes)."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ----- K-quant blocks (QK_K = 256 values each), packed per ggml-common.h ----------------------------


def _f16(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    return rng.uniform(lo, hi, n).astype(np.float16)


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block -> 12 bytes (inverse of ggml's get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return out


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 8 sub-blocks, 32] 4-bit values -> [n, 128]: sub-blocks 2c (low) and 2c+1 (high) share 32 bytes."""
    q = q.reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128).astype(np.uint8)


def pack_q4_k(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    d, dmin = _f16(rng, n, 1e-3, 1e-2), _f16(rng, n, 1e-3, 1e-2)
    sc, mn = rng.integers(0, 64, (n, 8), dtype=np.uint8), rng.integers(0, 64, (n, 8), dtype=np.uint8)
    q = rng.integers(0, 16, (n, 8, 32), dtype=np.uint8)
    raw = np.concatenate(
        [
            d.view(np.uint8).reshape(n, 2),
            dmin.view(np.uint8).reshape(n, 2),
            _pack_scales_k4(sc, mn),
            _pack_nibbles(q),
        ],
        axis=1,
    )
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    expected = scale[:, :, None] * q - offset[:, :, None]
    return raw, expected.reshape(n, 256).astype(np.float32)


def pack_q5_k(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    d, dmin = _f16(rng, n, 1e-3, 1e-2), _f16(rng, n, 1e-3, 1e-2)
    sc, mn = rng.integers(0, 64, (n, 8), dtype=np.uint8), rng.integers(0, 64, (n, 8), dtype=np.uint8)
    q = rng.integers(0, 32, (n, 8, 32), dtype=np.uint8)
    high = (q >> 4) & 1  # bit s of qh[l] is the fifth bit of sub-block s, element l
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), _pack_scales_k4(sc, mn)]
    raw = np.concatenate([*parts, qh, _pack_nibbles(q & 0xF)], axis=1)
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    expected = scale[:, :, None] * q - offset[:, :, None]
    return raw, expected.reshape(n, 256).astype(np.float32)


def pack_q6_k(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    d = _f16(rng, n, 1e-3, 1e-2)
    sc = rng.integers(-64, 64, (n, 16), dtype=np.int8)
    q = rng.integers(0, 64, (n, 2, 4, 32), dtype=np.uint8)  # [half, group g, l]: element h*128+g*32+l
    ql = np.zeros((n, 2, 64), dtype=np.uint8)
    low = q & 0xF
    ql[:, :, 0:32] = low[:, :, 0] | (low[:, :, 2] << 4)
    ql[:, :, 32:64] = low[:, :, 1] | (low[:, :, 3] << 4)
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2).astype(np.uint8)
    raw = np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1
    )
    l_idx = np.arange(32)
    scale_idx = (
        np.arange(2)[:, None, None] * 8 + np.arange(4)[None, :, None] * 2 + (l_idx // 16)[None, None, :]
    )
    scales = d.astype(np.float32)[:, None, None, None] * sc[:, scale_idx].astype(np.float32)
    expected = scales * (q.astype(np.float32) - 32)
    return raw, expected.reshape(n, 256).astype(np.float32)
