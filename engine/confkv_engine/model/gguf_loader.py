"""Load a llama.cpp GGUF file (llama / qwen2 / qwen3 / gemma3 architectures) into ``LlamaForCausalLM``.

Quantized tensors are dequantized with ``gguf.quants.dequantize`` (vectorised numpy, one tensor at a
time) to fp32, then cast to the requested dtype. llama.cpp's converter permutes the rows of Q and K
in llama-architecture files for its interleaved RoPE; the model here uses the half-split (NeoX/HF)
layout, so those rows are permuted back. qwen2, qwen3 and gemma3 files are written unpermuted.
Gemma 3 files store its norms as the ``1 + w`` they multiply by (the model's convention too); what
the file does not say is llama.cpp's: every sixth layer global, the others sliding-window with RoPE
base 10,000 (``rope.freq_base_swa`` when present), scores scaled by ``key_length ** -0.5``
(hidden / heads for the 62-layer 27B). Q4_K linears stay 4-bit (``quant.unpack_q4_k``); Q5_K ones
are served dense in the activation dtype rather than requantized, and so are Q6_K ones but where the
native int8 kernel serves their exact groups of 16 at a few rows (``quantized_linears``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from confkv_engine.model.gguf_reader import GGUFContents, GGUFTensor, read_gguf
from confkv_engine.model.llama import ModelArgs, rope_inv_freq
from confkv_engine.model.quant import (
    DENSE_K_TYPES,
    GROUPED_INT8_SERVED,
    INT4_TYPES,
    Int4Weight,
    Int8GroupWeight,
    Int8Weight,
    int8_groups,
    int8_keeps_dense,
    quantize_int8,
    unpack_q4,
)
from confkv_engine.model.weights import ModelLoadError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
# Types gguf.quants can dequantize that we accept (the i-quants are far too slow in numpy).
SUPPORTED_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
)

_CHUNK_ELEMENTS = 1 << 22
_DENSE_SERVED = frozenset({"F32", "F16", "BF16", *DENSE_K_TYPES})
QuantWeight = Int4Weight | Int8Weight | Int8GroupWeight

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma's four norms per layer: ffn_norm is the one before the MLP, as in llama files, but the
# norm after attention is a separate tensor.
_GEMMA_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


@dataclass(frozen=True)
class GGUFModel:
    args: ModelArgs
    architecture: str
    metadata: dict[str, Any]
    contents: GGUFContents


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """llama.cpp tensor name -> ``LlamaForCausalLM`` parameter name (None for ``rope_freqs``)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name == "rope_freqs.weight":
        return None
    names = _GEMMA_NAMES if arch == "gemma3" else _BLOCK_NAMES
    match = _BLOCK_RE.match(gguf_name)
    if match is None or match.group(2) not in names:
        raise ModelLoadError(f"unsupported tensor {gguf_name!r} in GGUF file")
    layer, kind, suffix = match.groups()
    return f"layers.{layer}.{names[kind]}.{suffix}"


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's ``permute``: rows per head go from interleaved pairs
    (x0, x_{D/2}, x1, ...) back to the half-split order (x0..x_{D/2-1}, x_{D/2}..)."""
    rest = w.shape[1:]
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's ``permute`` (HF half-split -> llama.cpp interleaved); used by tests."""
    rest = w.shape[1:]
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *rest).swapaxes(1, 2).reshape(w.shape)


def _meta(metadata: dict[str, Any], key: str, default: Any = None, required: bool = False) -> Any:
    if key in metadata:
        return metadata[key]
    if required:
        raise ModelLoadError(f"GGUF metadata lacks required key {key!r}")
    return default


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = _meta(metadata, f"{arch}.rope.scaling.type", "none")
    factor = _meta(metadata, f"{arch}.rope.scaling.factor")
    if kind == "none" and _meta(metadata, f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", metadata[f"{arch}.rope.scale_linear"]
    if kind == "none" or factor in (None, 0.0, 1.0):
        return None
    if kind == "yarn":
        original = _meta(metadata, f"{arch}.rope.scaling.original_context_length", required=True)
        return {"rope_type": "yarn", "factor": float(factor),
                "original_max_position_embeddings": int(original)}
    if kind != "linear":
        raise ModelLoadError(f"unsupported GGUF rope scaling type {kind!r} (supported: linear, yarn)")
    return {"rope_type": "linear", "factor": float(factor)}


def args_from_gguf(metadata: dict[str, Any], tensors: dict[str, GGUFTensor]) -> ModelArgs:
    """Architecture metadata (``llama.*`` / ``qwen2.*``) -> ModelArgs."""
    arch = _meta(metadata, "general.architecture", required=True)
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    hidden = int(_meta(metadata, f"{arch}.embedding_length", required=True))
    heads = int(_meta(metadata, f"{arch}.attention.head_count", required=True))
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")
    vocab = tensors["token_embd.weight"].shape[0]
    args = ModelArgs(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_meta(metadata, f"{arch}.feed_forward_length", required=True)),
        num_layers=int(_meta(metadata, f"{arch}.block_count", required=True)),
        num_heads=heads,
        num_kv_heads=int(_meta(metadata, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_meta(metadata, f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(_meta(metadata, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_meta(metadata, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(metadata, arch),
        max_position_embeddings=int(_meta(metadata, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        extra={"architecture": arch, "gguf_file_type": metadata.get("general.file_type")},
    )
    return _gemma3_args(args, metadata) if arch == "gemma3" else args


def _gemma3_args(args: ModelArgs, metadata: dict[str, Any]) -> ModelArgs:
    window = int(_meta(metadata, "gemma3.attention.sliding_window", 0))
    pattern = _meta(metadata, "gemma3.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # newer converters: one flag per layer
        local = [bool(x) for x in pattern]
    else:
        local = [(i + 1) % 6 != 0 for i in range(args.num_layers)]
    scale_dim = args.hidden_size // args.num_heads if args.num_layers == 62 else args.head_dim
    softcap = _meta(metadata, "gemma3.final_logit_softcapping")
    return dataclasses.replace(
        args,
        sandwich_norms=True,
        hidden_act="gelu_pytorch_tanh",
        embed_scale=math.sqrt(args.hidden_size),
        attn_scale=scale_dim ** -0.5,
        final_logit_softcap=float(softcap) if softcap else None,
        layer_windows=tuple(window if w else 0 for w in local) if window else (),
        local_rope_theta=float(_meta(metadata, "gemma3.rope.freq_base_swa", 10000.0)),
        rms_norm_eps=float(_meta(metadata, "gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
    )


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """Raw GGUF tensor -> writable fp32 numpy array in torch's (row-major, reversed-ne) shape."""
    import gguf.quants

    if tensor.type_name not in SUPPORTED_TYPES:
        raise ModelLoadError(
            f"tensor {tensor.name!r} has unsupported type {tensor.type_name} "
            f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})"
        )
    raw = tensor.data
    if tensor.type_name in ("F32", "F16"):
        return np.array(gguf.quants.dequantize(raw, tensor.qtype), dtype=np.float32).reshape(tensor.shape)
    # gguf.quants.dequantize works in groups of 16 rows (Python overhead per group); whole chunks of
    # rows through the same block kernel are several times faster and keep the temporaries bounded.
    kernel = getattr(gguf.quants, tensor.type_name)
    rows = raw.reshape(-1, raw.shape[-1])
    out = np.empty((rows.shape[0], tensor.shape[-1]), dtype=np.float32)
    step = max(1, _CHUNK_ELEMENTS // tensor.shape[-1])
    for start in range(0, rows.shape[0], step):
        out[start : start + step] = kernel.dequantize_rows(rows[start : start + step])
    return out.reshape(tensor.shape)


def iter_tensors(model: GGUFModel) -> Iterator[tuple[str, Tensor]]:
    """(model parameter name, fp32 tensor) for every weight, Q/K rows un-permuted for llama files."""
    args = model.args
    permuted = model.architecture == "llama"
    for name, tensor in model.contents.tensors.items():
        target = hf_name(name, model.architecture)
        if target is None:
            continue
        array = dequantize(tensor)
        if permuted and target.endswith(("q_proj.weight", "q_proj.bias")):
            array = unpermute_rows(array, args.num_heads)
        elif permuted and target.endswith(("k_proj.weight", "k_proj.bias")):
            array = unpermute_rows(array, args.num_kv_heads)
        yield target, torch.from_numpy(np.ascontiguousarray(array))  # writable: dequantize copies


def rope_freqs(model: GGUFModel) -> Tensor | None:
    """Llama-3.x GGUFs store their RoPE scaling as per-dimension divisors in ``rope_freqs.weight``."""
    tensor = model.contents.tensors.get("rope_freqs.weight")
    if tensor is None:
        return None
    factors = torch.from_numpy(dequantize(tensor).copy()).double()
    if factors.shape != (model.args.head_dim // 2,):
        raise ModelLoadError(
            f"rope_freqs.weight has shape {tuple(factors.shape)}, expected ({model.args.head_dim // 2},)"
        )
    return (rope_inv_freq(model.args).double() / factors).float()


def open_gguf(path: str | Path) -> GGUFModel:
    contents = read_gguf(path)
    args = args_from_gguf(contents.metadata, contents.tensors)
    return GGUFModel(
        args=args, architecture=args.extra["architecture"], metadata=contents.metadata, contents=contents
    )


def _linear_sources(model: GGUFModel) -> Iterator[tuple[str, GGUFTensor]]:
    """(module path, GGUF tensor) for every linear layer's weight; a tied LM head reads token_embd."""
    for name, tensor in model.contents.tensors.items():
        target = hf_name(name, model.architecture)
        if target is not None and (target.endswith("proj.weight") or target == "lm_head.weight"):
            yield target.removesuffix(".weight"), tensor  # type: ignore[union-attr]
    if model.args.tie_word_embeddings:
        yield "lm_head", model.contents.tensors["token_embd.weight"]


def _row_order(path: str, rows: int, args: ModelArgs, permuted: bool) -> Tensor | None:
    if not permuted or not path.endswith(("q_proj", "k_proj")):
        return None
    heads = args.num_heads if path.endswith("q_proj") else args.num_kv_heads
    return torch.from_numpy(unpermute_rows(np.arange(rows), heads).copy())


def has_quantized_linears(model: GGUFModel) -> bool:
    return any(t.type_name not in ("F32", "F16", "BF16") for _, t in _linear_sources(model))


def quantized_linears(model: GGUFModel, prefer_int4: bool,
                      grouped_int8: bool = False) -> dict[str, QuantWeight]:
    """Linear weights stored quantized in the file, converted without an fp32 model copy: Q4_0 /
    Q4_1 / Q4_K -> exact int4 groups when ``prefer_int4``; Q8_0 / Q5_0 -> exact int8 groups
    and Q6_K -> exact int8 groups of 16 (``Int8GroupWeight``) when ``grouped_int8`` (the native int8
    kernel serves them); Q5_K / Q6_K are otherwise left out (served dense: requantizing them would
    round them a second time); every other quantized type -> per-row int8 of the dequantized
    tensor. F32 / F16 / BF16 tensors are left out, and so are the ``quant.INT8_DENSE_LINEARS`` when
    not ``prefer_int4`` (the ``int8`` mode)."""
    out: dict[str, QuantWeight] = {}
    permuted = model.architecture == "llama"
    for path, tensor in _linear_sources(model):
        kind = tensor.type_name
        grouped = grouped_int8 and kind in GROUPED_INT8_SERVED
        if (kind in _DENSE_SERVED and not grouped) or (not prefer_int4 and int8_keeps_dense(path)):
            continue
        order = _row_order(path, tensor.shape[0], model.args, permuted)
        weight: QuantWeight
        if prefer_int4 and kind in INT4_TYPES:
            weight = unpack_q4(tensor.data, kind, tensor.shape[-1])
        elif grouped:
            weight = int8_groups(tensor.data, kind, dequantize(tensor))
        else:
            weight = quantize_int8(torch.from_numpy(dequantize(tensor)))
        out[path] = weight if order is None else weight.permute_rows(order)
    return out
