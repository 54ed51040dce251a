"""Shared pieces of the model loaders: the load error and turning a name->tensor mapping into a model.

Both loaders (GGUF, Hugging Face) produce tensors named like ``LlamaForCausalLM``'s parameters; this
module checks the set is complete and assigns them without ever materialising random init weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from confkv_engine.model.llama import LlamaForCausalLM, ModelArgs, rope_inv_freq
from confkv_engine.model.rope import base_inv_freq

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ModelLoadError(RuntimeError):
    """A model source that cannot be loaded: missing files, unsupported architecture or tensor types."""


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype}; use one of float32, bfloat16, float16")


def expected_names(args: ModelArgs) -> set[str]:
    """Parameter names the model needs (``lm_head.weight`` omitted when tied)."""
    names = {"embed_tokens.weight", "norm.weight"}
    if not args.tie_word_embeddings:
        names.add("lm_head.weight")
    proj = ["q_proj", "k_proj", "v_proj", "o_proj"]
    for i in range(args.num_layers):
        p = f"layers.{i}."
        names.update(f"{p}self_attn.{n}.weight" for n in proj)
        if args.attention_bias:
            names.update(f"{p}self_attn.{n}.bias" for n in proj[:3])
        names.update(f"{p}mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj"))
        names.update(f"{p}{n}.weight" for n in ("input_layernorm", "post_attention_layernorm"))
        if args.qk_norm:
            names.update(f"{p}self_attn.{n}.weight" for n in ("q_norm", "k_norm"))
        if args.sandwich_norms:
            names.update(f"{p}{n}_layernorm.weight" for n in ("pre_feedforward", "post_feedforward"))
    return names


@contextmanager
def _meta_construction() -> Iterator[None]:
    """Build modules on the meta device, skipping the embedding's random init: ``normal_`` on a meta
    tensor goes through Python reference kernels whose first use imports torch._dynamo and sympy
    (~2.5 s of CPU), for values that are discarded anyway. (Linear's init on meta is cheap.)"""
    saved = nn.Embedding.reset_parameters
    nn.Embedding.reset_parameters = lambda self: None  # type: ignore[method-assign]
    try:
        with torch.device("meta"):
            yield
    finally:
        nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]


def build_model(
    args: ModelArgs,
    tensors: Iterable[tuple[str, Tensor]],
    dtype: torch.dtype,
    device: str,
    inv_freq: Tensor | None = None,
) -> LlamaForCausalLM:
    """Assemble an eval-mode model from (name, tensor) pairs (consumed lazily, one at a time, so
    only one source tensor is held in fp32 at once). ``inv_freq`` overrides the RoPE frequencies
    (GGUF files may carry per-dimension frequency factors instead of scaling metadata)."""
    check_dtype(dtype)
    with _meta_construction():
        model = LlamaForCausalLM(args)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    needed = expected_names(args)
    state: dict[str, Tensor] = {}
    for name, tensor in tensors:
        if name not in needed:
            continue  # e.g. a tied lm_head stored anyway, or rotary buffers in old checkpoints
        if tuple(tensor.shape) != tuple(shapes[name]):
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shapes[name])}"
            )
        state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(needed - state.keys())
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"missing {len(missing)} weight tensor(s): {shown}")
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # Buffers are not in the state dict (non-persistent); RoPE frequencies stay fp32 whatever the dtype.
    freqs = rope_inv_freq(args) if inv_freq is None else inv_freq.float()
    model.inv_freq = freqs.to(device)
    if args.local_rope_theta is not None:
        model.local_inv_freq = base_inv_freq(args.head_dim, args.local_rope_theta).float().to(device)
    model.eval()
    model.requires_grad_(False)
    return model
