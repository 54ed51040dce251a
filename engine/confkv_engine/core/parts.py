"""Building the engine's parts from config: model facts, the cache (and its disk store), retention,
the attention backend, the scheduler, compression, and the lock they share.

Every part gets its collaborators through its constructor here, once; nothing is set on a part
afterwards. The one lock (``EngineParts.lock``) is an explicit object: the engine steps under it,
live control changes land under it, and the compression worker picks and swaps blocks under it (it
encodes without it), so each of them is handed the same object rather than reaching into another's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from confkv_api.config import ConfKVConfig, EngineSection
from confkv_api.units import parse_size
from confkv_engine.attention.retention import RetentionAttention
from confkv_engine.cache.disk.sink import DiskSink
from confkv_engine.cache.groups import LayerGroups
from confkv_engine.cache.kv_cache import CacheSpec, KVCache
from confkv_engine.cache.layout import resolve_cache_dtype
from confkv_engine.cache.planner import MemoryPlan
from confkv_engine.cache.streams import CacheStreams
from confkv_engine.core.compression import CompressionControl
from confkv_engine.core.graph_runner import DecodeRunner
from confkv_engine.core.memory_profile import plan_startup_memory
from confkv_engine.core.scheduler import Scheduler
from confkv_engine.model.compiled import compile_elementwise
from confkv_engine.retention.manager import RetentionManager, config_from_section, retained_chunk
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.runtime import HeadShards, decision_interval

log = logging.getLogger(__name__)


class NullTokenizer:
    """For models loaded without a tokenizer (tests): tokens have no text."""

    def decode(self, ids: list[int]) -> str:
        return ""


@dataclass
class EngineParts:
    """What ``LLMEngine`` steps with and ``EngineControlSurface`` controls."""

    model: Any
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype
    cache_dtype: torch.dtype
    compile_seconds: float | None
    cache: KVCache
    disk: DiskSink | None
    retention: RetentionManager
    backend: RetentionAttention
    scheduler: Scheduler
    compression: CompressionControl
    lock: threading.RLock
    max_waiting: int
    memory_plan: MemoryPlan
    decode_runner: DecodeRunner | None = None


def build_parts(loaded: Any, config: ConfKVConfig, retention: RetentionConfig | None = None,
                shards: HeadShards | None = None,
                make_disk: Callable[[str], DiskSink] = DiskSink,
                static_decode: bool | None = None) -> EngineParts:
    """``loaded``: a ``model.loader.LoadedModel`` or anything with its attributes; ``retention``
    overrides the confkv section's retention defaults; ``shards``: this rank's share of the KV heads
    under tensor parallelism (the model is sharded already; its attention layers say how many heads
    this rank computes, which sizes the pool); ``make_disk``: the disk store on ``engine.cacheDir``
    (a tensor-parallel rank's keeps its shard and agrees on read-backs: ``parallel.disk``).
    ``static_decode``: run decode steps over static buffers (``graph_runner``); None: on CUDA when
    ``engine.cudaGraphs`` (captured as graphs), off elsewhere (the gather path measured faster on
    CPU), never under tensor parallelism."""
    eng, model = config.engine, loaded.model
    args = model.args
    attn = model.layers[0].self_attn  # this rank's heads: all of them, or its shard under tensor parallelism
    num_heads, num_kv_heads = int(attn.nq), int(attn.nkv)
    max_model_len = int(getattr(loaded, "max_model_len", 0) or args.max_position_embeddings)
    if config.model.max_model_len:
        max_model_len = min(max_model_len, config.model.max_model_len)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    # The pool stores K/V at confkv.kvCacheDtype (auto: the model's dtype); attention reads them
    # back in the model's dtype.
    cache_dtype = resolve_cache_dtype(config.confkv.kv_cache_dtype, dtype)
    compile_seconds = None  # model.compile: start-up compile time (logged)
    if config.model.compile:
        compile_seconds = compile_elementwise(model, dtype, Path(eng.cache_dir) if eng.cache_dir else None)
    # Global and sliding-window layers mixed: the window layers keep only their window (``groups``).
    groups = LayerGroups.plan(args.layer_windows, args.num_layers)
    spec = CacheSpec(groups.group_size if groups else args.num_layers, num_kv_heads, args.head_dim,
                     eng.block_size, cache_dtype, device, compute_dtype=dtype, layer_groups=groups)
    if groups is not None and config.confkv.prefix_cache.enabled:
        log.info("prefix caching is off for this model: its sliding-window layers keep only their "
                 "window, and a cached prefix would need each window group's last window as well")
    size = parse_size(config.confkv.max_cache_size) if config.confkv.max_cache_size else None
    ev = config.confkv.eviction
    # The salt names what changes the stored K/V besides the tokens (dtypes are added by the cache).
    salt = (f"{getattr(loaded, 'name', '')}|{args}".encode()
            if config.confkv.prefix_cache.enabled and groups is None else None)
    # The disk store (engine.cacheDir, NVMe in pods): evicted prefix blocks spill there and come back.
    disk = make_disk(eng.cache_dir) if eng.cache_dir and salt is not None else None
    # Weights, the profiled activation peak, the decode gather bound and a reserve come off first.
    memory_plan = plan_startup_memory(model, spec, eng, max_model_len, size)
    # engine.cudaStreams side streams for cache work (compression, spills, read-backs); none on CPU.
    cache = KVCache.from_budget(spec, memory_plan.pool_bytes, prefix_salt=salt,
                                eviction_k=ev.k if ev.policy == "LRU-K" else 1, sink=disk,
                                streams=CacheStreams(device, eng.cuda_streams))
    # Token-level retention (conf-kv and its peers). Retained sequences prefill in chunks of at most
    # confkv.decisionInterval tokens.
    chunk = retained_chunk(config.confkv, eng.prefill_chunk)
    interval = decision_interval(spec.block_size, chunk)
    defaults = retention or config_from_section(config.confkv, interval)
    manager = RetentionManager(cache, num_heads, defaults, chunk, shards)
    # Admission reserves a binding budget, not the full length, and chunks of retained sequences
    # never cross a decision point, so replays are exact.
    scheduler = Scheduler(cache, manager, eng.max_batch_size, eng.max_num_batched_tokens, eng.prefill_chunk)
    lock = threading.RLock()
    runner = _decode_runner(model, cache, eng, max_model_len, static_decode, shards is None)
    return EngineParts(
        model=model, tokenizer=getattr(loaded, "tokenizer", None) or NullTokenizer(),
        vocab_size=args.vocab_size, max_model_len=max_model_len,
        eos_token_ids=tuple(getattr(loaded, "eos_token_ids", ()) or ()), device=device, dtype=dtype,
        cache_dtype=cache_dtype, compile_seconds=compile_seconds, cache=cache, disk=disk, retention=manager,
        backend=RetentionAttention(cache, num_heads, memory_plan.gather_bytes), scheduler=scheduler,
        compression=CompressionControl(cache, lock, config.confkv.compression), lock=lock,
        max_waiting=eng.max_waiting, memory_plan=memory_plan, decode_runner=runner)


def _decode_runner(model: Any, cache: KVCache, eng: EngineSection, max_model_len: int,
                   wanted: bool | None, single_rank: bool) -> DecodeRunner | None:
    """The static-buffer decode runner, its graphs captured now (after the memory plan sized the
    pool), or None (see ``build_parts``)."""
    on_cuda = cache.spec.device.type == "cuda"
    if wanted is None:
        wanted = on_cuda and eng.cuda_graphs
    if not (wanted and single_rank and DecodeRunner.supported(cache)):
        return None
    runner = DecodeRunner(model, cache, eng.max_batch_size, max_model_len, graphs=eng.cuda_graphs)
    try:
        runner.capture()
    except torch.OutOfMemoryError:  # the graphs' activations did not fit beside the planned pool
        log.warning("no memory left to capture decode CUDA graphs after the pool was sized: decode "
                    "runs eagerly (lower maxCacheSize or maxBatchSize to get them)")
        torch.cuda.empty_cache()
        return None
    return runner
