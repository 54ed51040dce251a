"""Per-architecture reading of a Hugging Face ``config.json`` into ``ModelArgs``.

Llama, Mistral and Qwen2 share the base fields; Qwen3 adds per-head q/k norms; Gemma 3 (text,
``gemma3_text``) adds everything ``llama.py``'s docstring lists. Sliding windows come from
``layer_types`` when the config has it (transformers >= 4.53 writes it), else from each family's
own rule: Mistral's ``sliding_window`` on every layer, Qwen2/3's from ``max_window_layers`` on when
``use_sliding_window``, Gemma 3's every layer but each ``sliding_window_pattern``-th.
A RoPE scaling outside ``rope.SUPPORTED_ROPE_TYPES`` is refused here, when the config is read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from confkv_engine.model.llama import ModelArgs
from confkv_engine.model.rope import RopeScalingError, check_rope_scaling, rope_kind

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")
_SLIDING = "sliding_attention"


class ConfigError(ValueError):
    """A config this engine cannot serve (the loader reports it as ``ModelLoadError``)."""


def args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = (" (a multimodal Gemma 3 checkpoint: serve its text model, gemma3_text)"
                if model_type == "gemma3" else "")
        raise ConfigError(f"unsupported model_type {model_type!r}{hint} "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if model_type == "gemma3_text":
        args = _gemma3_args(cfg)
    elif model_type == "phi3":
        args = _phi3_args(cfg)
    else:
        args = ModelArgs.from_hf_config(cfg)
        args = dataclasses.replace(args, qk_norm=model_type == "qwen3",
                                   layer_windows=_layer_windows(cfg, model_type, args.num_layers))
    try:
        check_rope_scaling(args.rope_scaling)
    except RopeScalingError as exc:
        raise ConfigError(str(exc)) from None
    if rope_kind(args.rope_scaling) == "dynamic":  # the base is stretched for factor x the context
        longer = int(args.max_position_embeddings * float(args.rope_scaling["factor"]))  # type: ignore[index]
        args = dataclasses.replace(args, max_position_embeddings=longer)
    return dataclasses.replace(args, extra={**args.extra, "architecture": model_type})


def _layer_windows(cfg: dict[str, Any], model_type: str, layers: int) -> tuple[int, ...]:
    window = cfg.get("sliding_window")
    if not window:
        return ()
    types = cfg.get("layer_types")
    if types is None:
        if model_type in ("mistral", "phi3"):
            types = [_SLIDING] * layers
        elif model_type == "gemma3_text":
            pattern = int(cfg.get("sliding_window_pattern", 6))
            types = [_SLIDING if (i + 1) % pattern else "full_attention" for i in range(layers)]
        elif cfg.get("use_sliding_window"):
            first = int(cfg.get("max_window_layers", layers))
            types = [_SLIDING if i >= first else "full_attention" for i in range(layers)]
        else:
            return ()
    if len(types) != layers:
        raise ConfigError(f"layer_types has {len(types)} entries for {layers} layers")
    windows = tuple(int(window) if t == _SLIDING else 0 for t in types)
    return windows if any(windows) else ()


def _gemma3_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(global theta, global scaling, local theta) from transformers 5's per-layer-type
    ``rope_parameters`` or the older ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    params = cfg.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    local = dict(params.get(_SLIDING) or {})
    if rope_kind(local) != "default":
        raise ConfigError(
            f"a scaled RoPE on the sliding-window layers ({rope_kind(local)!r}) is not supported")
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    theta = float(full.pop("rope_theta", None) or cfg.get("rope_theta") or 1_000_000.0)
    local_theta = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0)
    scaling = full if rope_kind(full) != "default" else None
    return theta, scaling, local_theta


def _gemma3_args(cfg: dict[str, Any]) -> ModelArgs:
    if cfg.get("attn_logit_softcapping"):
        raise ConfigError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"unsupported Gemma 3 activation {act!r} (supported: gelu_pytorch_tanh)")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    layers = cfg["num_hidden_layers"]
    theta, scaling, local_theta = _gemma3_rope(cfg)
    return ModelArgs(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or 256,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=True,
        sandwich_norms=True,
        hidden_act="gelu_pytorch_tanh",
        embed_scale=math.sqrt(hidden),
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        layer_windows=_layer_windows(cfg, "gemma3_text", layers),
        local_rope_theta=local_theta,
    )


def _phi3_args(cfg: dict[str, Any]) -> ModelArgs:
    """Phi-3: Llama's layer with fused qkv and gate_up projections (split at load, ``hf_loader``)."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ConfigError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported Phi-3 activation {cfg['hidden_act']!r} (supported: silu)")
    args = ModelArgs.from_hf_config(cfg)
    scaling = args.rope_scaling
    if scaling and rope_kind(scaling) == "longrope" and "original_max_position_embeddings" not in scaling:
        scaling = {**scaling, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    return dataclasses.replace(args, rope_scaling=scaling, attention_bias=False,
                               layer_windows=_layer_windows(cfg, "phi3", args.num_layers))


def norm_offset(args: ModelArgs) -> bool:
    """Whether the checkpoint's RMSNorm weights are stored as ``w`` for a ``1 + w`` multiplier
    (Gemma's HF checkpoints; llama.cpp's converter already adds the 1)."""
    return args.extra.get("architecture") == "gemma3_text"
