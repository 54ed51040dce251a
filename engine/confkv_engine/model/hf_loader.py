"""Load a Hugging Face model directory: ``config.json`` plus single or sharded safetensors
(``model.safetensors`` or ``model.safetensors.index.json``); ``pytorch_model*.bin`` as a fallback.
The tokenizer side (tokenizer.json, tokenizer_config.json, generation_config.json) is in tokenizer.py.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from confkv_engine.model.arch import SUPPORTED_MODEL_TYPES, ConfigError, args_from_hf_config, norm_offset
from confkv_engine.model.llama import ModelArgs
from confkv_engine.model.weights import ModelLoadError

log = logging.getLogger(__name__)

__all__ = ["SUPPORTED_MODEL_TYPES", "read_config", "weight_files", "iter_tensors"]


def read_config(path: str | Path) -> ModelArgs:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} has no config.json (not a Hugging Face model directory)")
    try:
        cfg: dict[str, Any] = json.loads(cfg_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{cfg_file} is not valid JSON: {exc}") from exc
    try:
        return args_from_hf_config(cfg)
    except KeyError as exc:
        raise ModelLoadError(f"{cfg_file} lacks required key {exc}") from None
    except ConfigError as exc:
        raise ModelLoadError(f"{cfg_file}: {exc}") from None


def weight_files(path: str | Path) -> list[Path]:
    """The checkpoint files of a directory, in a stable order."""
    path = Path(path)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            files = [path / f for f in dict.fromkeys(weight_map.values())]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ModelLoadError(f"{index} names missing shard(s): {', '.join(missing)}")
            return files
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (path / single).is_file():
            return [path / single]
    raise ModelLoadError(f"{path} has no model.safetensors(.index.json) or pytorch_model.bin")


def _param_name(name: str) -> str:
    return name.removeprefix("model.")


def iter_tensors(path: str | Path, args: ModelArgs | None = None) -> Iterator[tuple[str, Tensor]]:
    """(model parameter name, tensor) for every tensor of every shard, one at a time; Gemma's norm
    weights come out as the ``1 + w`` they multiply by (``args`` says which family)."""
    offset = args is not None and norm_offset(args)
    for name, tensor in _raw_tensors(path):
        if args is not None and name.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
            yield from _split_fused(name, tensor, args)
            continue
        yield name, (tensor.float() + 1 if offset and name.endswith("norm.weight") else tensor)


def _split_fused(name: str, tensor: Tensor, args: ModelArgs) -> Iterator[tuple[str, Tensor]]:
    """Phi-3's fused projections -> the separate ones the model loads (it fuses them again itself
    when its weights are quantized)."""
    prefix = name.rsplit(".", 2)[0]
    if name.endswith("qkv_proj.weight"):
        q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        parts = tensor.split([q, kv, kv])
        for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
            yield f"{prefix}.{proj}.weight", part
    else:
        gate, up = tensor.chunk(2)
        yield f"{prefix}.gate_proj.weight", gate
        yield f"{prefix}.up_proj.weight", up


def _raw_tensors(path: str | Path) -> Iterator[tuple[str, Tensor]]:
    from safetensors import safe_open

    for file in weight_files(path):
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield _param_name(name), f.get_tensor(name)
        else:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            for name, tensor in state.items():
                yield _param_name(name), tensor
