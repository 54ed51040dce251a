"""Synchronous engine: requests in, one batched model step per ``step()``, outputs out.

``LLMEngine(loaded, config)``: ``loaded`` is a ``model.loader.LoadedModel`` (model, tokenizer,
max_model_len, eos_token_ids, ...) or anything with those attributes; ``config`` a
``ConfKVConfig`` (engine and confkv sections are read). Not thread-safe by itself beyond a lock
around public calls: the HTTP layer drives it from one thread (``async_engine.AsyncEngine``). It
is also the control plane's ``EngineControlTarget`` (live batch size and retention defaults).

Per step: the scheduler picks sequences and chunk sizes; the step's tokens are flattened (decode
rows first) and run once through the model with ``PagedAttention``; logits are computed only for
rows that sample a token or need prompt logprobs; the sampling layer picks tokens; trackers turn
them into text and finish reasons; the retention policy runs; outputs for sequences that
progressed are returned.

CUDA out-of-memory during a step is caught and counted; the step's sequences lose their cache
and are requeued for recompute, and a sequence hit ``MAX_OOM_RETRIES`` times finishes with
finish_reason 'error'. Tests drive that path on a CPU with ``core.faults`` (off unless the
environment variable ``CONFKV_FAULT_OOM_EVERY`` is set; no config key can switch it on).
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

import torch

from confkv_api.config import CompressionSection, ConfKVConfig, ConfKVSection, parse_size
from confkv_engine.attention.retention import RetentionAttention
from confkv_engine.cache.kv_cache import CacheSpec, CompressResult, KVCache
from confkv_engine.cache.layout import resolve_cache_dtype
from confkv_engine.cache.offload import DiskTier
from confkv_engine.cache.planner import requested_pool_bytes
from confkv_engine.core import sampling
from confkv_engine.core.compression import CompressionControl
from confkv_engine.core.control_api import (
    BATCH_FIELD,
    COMPRESSION_FIELD,
    EVICTION_FIELD,
    RETENTION_FIELDS,
    SIZE_FIELD,
    CapacityInUse,
    EngineStats,
    PolicyRejected,
)
from confkv_engine.core.faults import OomFault
from confkv_engine.core.memory_profile import plan_startup_memory
from confkv_engine.core.outputs import RequestOutput
from confkv_engine.core.sampling_params import InvalidRequest, SamplingParams
from confkv_engine.core.scheduler import Scheduler
from confkv_engine.core.sequence import SeqStatus, Sequence
from confkv_engine.model.compiled import compile_elementwise
from confkv_engine.retention.manager import RetentionManager, config_from_section, retained_chunk
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.runtime import decision_interval

MAX_OOM_RETRIES = 3
# With nothing to step but requests waiting for disk read-backs, ``step`` waits this long at most
# for one to land (it returns as soon as one does): no busy loop, and no wait on a lost read.
DISK_WAIT_SECONDS = 0.05


class QueueFull(RuntimeError):
    """The waiting queue is at ``maxWaiting`` (the HTTP layer answers 429)."""


class _NullTokenizer:
    """For models loaded without a tokenizer (tests): tokens have no text."""

    def decode(self, ids: list[int]) -> str:
        return ""


class LLMEngine:
    def __init__(self, loaded: Any, config: ConfKVConfig | None = None,
                 retention: RetentionConfig | None = None) -> None:
        config = config or ConfKVConfig()
        eng = config.engine
        self.model = loaded.model
        self.tokenizer = getattr(loaded, "tokenizer", None) or _NullTokenizer()
        args = self.model.args
        self.vocab_size = args.vocab_size
        self.max_model_len = int(getattr(loaded, "max_model_len", 0) or args.max_position_embeddings)
        if config.model.max_model_len:
            self.max_model_len = min(self.max_model_len, config.model.max_model_len)
        self.eos_token_ids = tuple(getattr(loaded, "eos_token_ids", ()) or ())
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # The pool stores K/V at confkv.kvCacheDtype (auto: the model's dtype); attention reads them
        # back in the model's dtype.
        self.cache_dtype = resolve_cache_dtype(config.confkv.kv_cache_dtype, self.dtype)
        self.compile_seconds: float | None = None  # model.compile: start-up compile time (logged)
        if config.model.compile:
            self.compile_seconds = compile_elementwise(
                self.model, self.dtype, Path(eng.cache_dir) if eng.cache_dir else None)
        spec = CacheSpec(args.num_layers, args.num_kv_heads, args.head_dim, eng.block_size,
                         self.cache_dtype, self.device, compute_dtype=self.dtype)
        size = parse_size(config.confkv.max_cache_size) if config.confkv.max_cache_size else None
        ev = config.confkv.eviction
        # The salt names what changes the stored K/V besides the tokens (dtypes are added by the cache).
        salt = f"{getattr(loaded, 'name', '')}|{args}".encode()
        salt = salt if config.confkv.prefix_cache.enabled else None
        # Weights, the profiled activation peak, the decode gather bound and a reserve come off first.
        self.memory_plan = plan_startup_memory(self.model, spec, eng, self.max_model_len, size)
        self.cache = KVCache.from_budget(spec, self.memory_plan.pool_bytes, prefix_salt=salt,
                                         eviction_k=ev.k if ev.policy == "LRU-K" else 1)
        # The disk tier (engine.cacheDir, NVMe in pods): evicted prefix blocks spill there and come back.
        self.disk: DiskTier | None = None
        if eng.cache_dir and salt is not None:
            self.disk = DiskTier(eng.cache_dir)
            self.cache.sink = self.disk
        # Token-level retention (conf-kv and its peers); ``retention`` overrides the confkv section.
        # Retained sequences prefill in chunks of at most confkv.decisionInterval tokens.
        chunk = retained_chunk(config.confkv, eng.prefill_chunk)
        interval = decision_interval(spec.block_size, chunk)
        self.retention = RetentionManager(self.cache, args.num_heads,
                                          retention or config_from_section(config.confkv, interval), chunk)
        self.backend = RetentionAttention(self.cache, args.num_heads, self.memory_plan.gather_bytes)
        # Admission reserves a binding budget, not the full length, and chunks of retained sequences
        # never cross a decision point, so replays are exact.
        self.scheduler = Scheduler(self.cache, self.retention, eng.max_batch_size,
                                   eng.max_num_batched_tokens, eng.prefill_chunk)
        self.max_waiting = eng.max_waiting
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []  # aborted requests, reported by the next step
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self.num_oom = 0
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.num_finished = 0
        self.compression_control = CompressionControl(self.cache, self._lock, self.device,
                                                      config.confkv.compression)  # live: apply_policy
        self._oom_fault = OomFault.from_env()  # off unless CONFKV_FAULT_OOM_EVERY is set

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        cfg = self._validate(request_id, prompt_token_ids, params)
        seq = Sequence(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
            tracker=sampling.OutputTracker(self.tokenizer, params, self.eos_token_ids, prompt_token_ids),
            generator=sampling.make_generator(params.seed, self.device), arrival_time=time.time(),
            retention=None if cfg.policy == "full" else cfg)
        with self._lock:
            if len(self.scheduler.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.scheduler.waiting)} requests are already waiting")
            self._seqs[request_id] = seq
            self.scheduler.add(seq)

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> RetentionConfig:
        """Check a request; returns the retention config it keeps for its whole life."""
        if request_id in self._seqs:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        if len(prompt) > self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(prompt)} tokens; this model's maximum context length is "
                f"{self.max_model_len}", param="prompt", code="context_length_exceeded")
        try:
            cfg = self.retention.config_for(params.kv_policy, params.kv_budget, params.kv_tiers)
        except ValueError as err:
            param = "kv_tiers" if params.kv_tiers is not None and "tier" in str(err) else "kv_policy"
            raise InvalidRequest(str(err), param=param) from None
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequest(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"({len(prompt)}) plus max_tokens ({params.max_tokens}) needs {total}",
                param="max_tokens", code="context_length_exceeded")
        # A binding retention budget is what the request can ever hold, not its full length.
        needed = self.retention.reserve_blocks(cfg, total) or self.cache.blocks_for_tokens(total)
        if needed > self.cache.num_blocks:
            raise InvalidRequest(
                f"the KV cache holds {self.cache.num_blocks // 2 * self.cache.spec.block_size} tokens; "
                f"prompt plus max_tokens ({total}) needs {needed} blocks under its kv policy and "
                f"can never fit (raise maxCacheSize or lower kv_budget)",
                param="max_tokens", code="kv_cache_too_small")
        return cfg

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its final output comes with the next step."""
        with self._lock:
            seq = self._seqs.get(request_id)
            if seq is None or seq.finished:
                return
            self._finish(seq, "abort")
            self._pending.append(self._output(seq))

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished() or bool(self._pending)

    # ---- stepping --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self._lock, torch.inference_mode():
            outputs, self._pending = self._pending, []
            sched = self.scheduler.schedule()
            load = None if sched.scheduled else self.scheduler.pending_load()
            if sched.scheduled:
                return outputs + self._step_scheduled(sched.scheduled)
        if load is not None:  # only disk read-backs are left to wait for: sleep on one, not the lock
            load.done.wait(DISK_WAIT_SECONDS)
        return outputs

    def _step_scheduled(self, scheduled: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        try:
            self._oom_fault.before_model()
            results = self._run(scheduled)
        except torch.OutOfMemoryError:
            return self._recover_from_oom(scheduled)
        for seq, n in scheduled:
            self._advance(seq, n, results.get(seq))
            if seq.finished or seq.reported_tokens < len(seq.output_token_ids):
                outputs.append(self._output(seq))
        return outputs

    def _run(self, scheduled: list[tuple[Sequence, int]]) -> dict[Sequence, Any]:
        """One forward pass; returns per sequence (token id, logprob entry) when it sampled."""
        ids: list[int] = []
        pos: list[int] = []
        for seq, n in scheduled:
            ids.extend(seq.token_slice(seq.num_computed, seq.num_computed + n))
            pos.extend(range(seq.num_computed, seq.num_computed + n))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        states = [self.retention.prepare(s) for s, _ in scheduled]
        self.backend.begin_step([s.kv for s, _ in scheduled], [n for _, n in scheduled], positions, states)
        hidden = self.model(input_ids, positions, self.backend)
        self.backend.end_step()
        self._retention_logits(scheduled, hidden)
        return self._sample(scheduled, hidden)

    def _retention_logits(self, scheduled: list[tuple[Sequence, int]], hidden: torch.Tensor) -> None:
        """Untempered logits of every row for sequences whose retention uses the sampling signal."""
        self._ret_logits: dict[Sequence, torch.Tensor] = {}
        offset = 0
        for seq, n in scheduled:
            if self.retention.wants_logits(seq.policy_state):
                self._ret_logits[seq] = self.model.compute_logits(hidden[offset:offset + n])
            offset += n

    def _sample(self, scheduled: list[tuple[Sequence, int]], hidden: torch.Tensor) -> dict[Sequence, Any]:
        rows: list[int] = []
        samplers: list[Sequence] = []
        offset = 0
        for seq, n in scheduled:
            end = seq.num_computed + n
            if seq.wants_prompt_logprobs and len(seq.prompt_logprobs) < min(end + 1, seq.prompt_len):
                self._prompt_logprobs(seq, hidden[offset:offset + n])
            if end == seq.num_tokens and len(seq.output_token_ids) < seq.params.max_tokens:
                rows.append(offset + n - 1)
                samplers.append(seq)
            offset += n
        if not samplers:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        params = [s.params for s in samplers]
        for s in samplers:  # the grammar is compiled on the sequence's first sampling step
            if s.params.structured is not None and s.grammar is None:
                s.grammar = sampling.GrammarState(s.params.structured, self.tokenizer, self.vocab_size,
                                                  self.eos_token_ids)
        masked = sampling.processed_logits(
            logits, params, [s.prompt_token_ids for s in samplers], [s.output_token_ids for s in samplers],
            self.eos_token_ids, [s.grammar for s in samplers])
        chosen = sampling.sample(masked, params, [s.generator for s in samplers])
        lps = sampling.token_logprobs(logits, chosen, [p.logprobs for p in params])  # raw: unprocessed
        tokens = chosen.tolist()
        for s, t in zip(samplers, tokens, strict=True):
            if s.grammar is not None:
                s.grammar.accept(t)
        return {s: (t, lp) for s, t, lp in zip(samplers, tokens, lps, strict=True)}

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Entries for the prompt tokens this chunk's rows predict (row r scores token start+r+1)."""
        start, n, plen = seq.num_computed, hidden.shape[0], seq.prompt_len
        logits = self.model.compute_logits(hidden[: max(0, min(n, plen - 1 - start))])
        entries = sampling.prompt_logprobs(logits, seq.prompt_token_ids, seq.params.prompt_logprobs or 0,
                                           first_position=start)
        first = 0 if start == 0 else start + 1  # prompt index of entries[0]
        have, upto = len(seq.prompt_logprobs), min(start + n + 1, plen)
        seq.prompt_logprobs.extend(entries[have - first:upto - first])

    def _advance(self, seq: Sequence, n: int, result: tuple[int, Any] | None) -> None:
        was_prefill = seq.num_computed < seq.prompt_len
        seq.num_computed += n
        if seq.retention is None:
            self._register(seq)
        seq.peak_kv_bytes = max(seq.peak_kv_bytes, self.retention.held_bytes(seq.kv, seq.policy_state))
        if was_prefill and seq.num_computed >= seq.prompt_len and not seq.prompt_counted:
            seq.prompt_counted = True
            self.prompt_tokens_total += seq.prompt_len
        if seq.num_computed == seq.num_tokens and seq.params.max_tokens == 0:
            self._finish(seq, "length")
            return
        if result is not None:
            token, lp = result
            seq.output_token_ids.append(token)
            if lp is not None:
                seq.logprobs.append(lp)
            self.generated_tokens_total += 1
            if seq.first_token_time is None:
                seq.first_token_time = time.time()
            text = seq.tracker.append(token)
            seq.pending_text += text.delta
            if text.finish_reason is not None:
                self._finish(seq, text.finish_reason)
                return
        logits = self._ret_logits.pop(seq, None)
        if logits is not None:  # row r predicted position start + 1 + r (the sampled token included)
            start = seq.num_computed - n
            self.retention.observe_logits(seq.policy_state, logits, start + 1,
                                          seq.token_slice(start + 1, seq.num_computed + 1))
        self.retention.after_step(seq.kv, seq.policy_state, seq.num_computed)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.tracker.finish_reason is None:
            seq.pending_text += seq.tracker.finish(reason).delta  # type: ignore[arg-type]
        seq.finish_reason = reason  # type: ignore[assignment]
        seq.error = error
        seq.status = SeqStatus.FINISHED
        seq.finish_time = time.time()
        seq.final_slots = seq.kv.num_slots
        if seq.policy_state is not None and seq.policy_state.may_register_hash():
            self._register(seq)  # a retained request whose tiers never changed: its blocks are exact
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)
        self.num_finished += 1

    def _register(self, seq: Sequence) -> None:
        """Offer the sequence's newly filled blocks to the prefix cache (its slots hold positions
        0..num_slots-1 unchanged)."""
        if seq.kv.num_slots // self.cache.spec.block_size > len(seq.kv.block_keys):
            self.cache.register(seq.kv, seq.token_slice(0, seq.kv.num_slots))

    def _recover_from_oom(self, scheduled: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        """Drop the step's caches and recompute later; fail a sequence after repeated OOMs."""
        self.num_oom += 1
        outputs = []
        for seq, _ in reversed(scheduled):  # requeue_front reverses: keep the original order
            seq.num_oom += 1
            if seq.num_oom >= MAX_OOM_RETRIES:
                self._finish(seq, "error", error="out of device memory")
                outputs.append(self._output(seq))
            else:
                self.scheduler.requeue_front(seq)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput:
        new_ids = seq.output_token_ids[seq.reported_tokens:]
        seq.reported_tokens = len(seq.output_token_ids)
        new_text, seq.pending_text = seq.pending_text, ""
        prompt_done = seq.num_computed >= seq.prompt_len or seq.finished
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=list(seq.output_token_ids), new_token_ids=new_ids,
            text=seq.tracker.text[:seq.tracker.emitted], new_text=new_text,
            logprobs=list(seq.logprobs),
            prompt_logprobs=list(seq.prompt_logprobs) if seq.wants_prompt_logprobs and prompt_done else None,
            finished=seq.finished, finish_reason=seq.finish_reason, error=seq.error,
            arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
            finish_time=seq.finish_time, num_preemptions=seq.num_preemptions,
            num_cached_tokens=seq.prefix_len, kv_usage=self.retention.usage(seq))

    # ---- control (``core.control_api.EngineControlTarget``) ---------------------------------
    @property
    def max_batch_size(self) -> int:
        return self.scheduler.max_batch_size

    def set_max_batch_size(self, n: int) -> None:
        """Live change (remediation): applies from the next step; running sequences over the new
        limit finish normally, nothing new is admitted until the batch is below it."""
        if n < 1:
            raise InvalidRequest(f"max batch size must be >= 1, got {n}", param="maxBatchSize")
        with self._lock:
            self.scheduler.max_batch_size = n

    def live_fields(self) -> list[str]:
        return [BATCH_FIELD, *RETENTION_FIELDS, EVICTION_FIELD, SIZE_FIELD, COMPRESSION_FIELD]

    def capabilities(self) -> list[str]:
        caps = ["compress"] + (["prefix-cache", "warmup"] if self.cache.prefix is not None else [])
        return caps + (["rebuild-index"] if self.disk is not None else [])

    def _resize(self, max_cache_size: str | None) -> None:
        """Live ``maxCacheSize``: the same bytes mean the same pool as at start-up (the null block is
        inside it). A size the machine cannot hold is refused here, not capped as at start-up: the
        caller asked for a pool it would not get."""
        size = parse_size(max_cache_size) if max_cache_size else None
        try:  # a fraction is of total memory less the start-up plan's weights, activations and reserve
            wanted = requested_pool_bytes(self.memory_plan, size)
        except ValueError as err:
            raise CapacityInUse(f"maxCacheSize {max_cache_size!r} refused: {err}") from None
        try:
            self.cache.resize(wanted // self.cache.spec.block_bytes - 1)  # less the null block
        except ValueError as err:
            raise CapacityInUse(f"maxCacheSize {max_cache_size!r} ({wanted} bytes) refused: {err}") from None

    def rebuild_index(self) -> str:
        """Rebuild the disk tier's index from its record files (torn or corrupt ones are skipped)."""
        if self.disk is None:
            raise PolicyRejected("this engine has no cache directory (engine.cacheDir): nothing to rebuild")
        report = self.disk.rebuild()
        return (f"rebuilt the disk index: {report.records} records ({report.bytes} bytes), "
                f"{report.skipped} torn or corrupt skipped, {report.orphans} unfinished writes removed")

    def hot_prefixes(self, n: int) -> list[list[int]]:
        """Token ids of the most-hit prefixes the disk tier remembers (for a warm-up with no prompts)."""
        return self.disk.hot_prefixes(n) if self.disk is not None else []

    def close(self) -> None:
        """Release what outlives requests (the compression worker, the disk tier's writer and index)."""
        self.stop_compression()
        if self.disk is not None:
            with self._lock:
                self.cache.offer_all()
            self.disk.flush()
            self.disk.close()

    def apply_policy(self, confkv: ConfKVSection, max_batch_size: int, changed: list[str]) -> None:
        """Everything is computed and checked first, then set between two steps (all or nothing).
        Retention settings apply to requests admitted from now on."""
        retention = None
        if any(p.startswith(RETENTION_FIELDS) for p in changed):
            try:
                retention = config_from_section(confkv, self.retention.interval,
                                                self.retention.defaults.scorer)
                self.retention.check(retention)
            except ValueError as err:
                raise PolicyRejected(f"invalid policy: {err}") from None
        compression = None
        if any(p.startswith(COMPRESSION_FIELD) for p in changed):
            compression = self.compression_control.checked(confkv.compression)
        if max_batch_size < 1:
            raise PolicyRejected(f"invalid policy: maxBatchSize must be >= 1, got {max_batch_size}")
        with self._lock:  # the engine steps under this lock: the change lands between two steps
            if SIZE_FIELD in changed:  # first: it is the one change that can still be refused here
                self._resize(confkv.max_cache_size)
            if BATCH_FIELD in changed:
                self.scheduler.max_batch_size = max_batch_size
            if retention is not None:
                self.retention.set_defaults(retention)
            if any(p.startswith(EVICTION_FIELD) for p in changed):
                ev = confkv.eviction
                self.cache.set_eviction_k(ev.k if ev.policy == "LRU-K" else 1)
        if compression is not None:  # outside the lock: stopping the worker waits for its pass
            self.compression_control.set(compression)

    # ---- conveniences ----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Submit all prompts, step until they finish; outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def stats(self) -> EngineStats:
        with self._lock:
            used = self.cache.used_bytes
            tiers = self.retention.tier_bytes([(s.kv, s.policy_state) for s in self.scheduler.running])
            return EngineStats(
                num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                num_total_blocks=self.cache.num_blocks, num_free_blocks=self.cache.num_free,
                block_size=self.cache.spec.block_size, kv_bytes_used=used,
                kv_bytes_total=self.cache.total_bytes, kv_bytes_full=used - tiers["key_only"],
                kv_bytes_key_only=tiers["key_only"],
                num_preemptions=self.scheduler.num_preemptions, num_oom=self.num_oom,
                prompt_tokens_total=self.prompt_tokens_total,
                generated_tokens_total=self.generated_tokens_total,
                num_requests_finished=self.num_finished,
                prefix_cache_enabled=self.cache.prefix is not None,
                prefix_queried_tokens=self.cache.hits.queried, prefix_hit_tokens=self.cache.hits.hit,
                prefix_hit_ratio_window=self.cache.hits.window_ratio(),
                kv_bytes_evictable=2 * len(self.cache.eviction) * self.cache.spec.block_bytes,
                kv_bytes_reserved=self.cache.reserved_bytes,
                kv_bytes_reclaimable=self.cache.reclaimable_bytes,
                eviction_k=self.cache.eviction.k, **self._disk_stats(),
                kv_blocks_compressed=len(self.cache.store),
                kv_bytes_compressed=self.cache.store.stored_bytes)

    def _disk_stats(self) -> dict[str, int]:
        if self.disk is None:
            return {}
        store, tier = self.disk.store.stats(), self.disk.stats
        return {"disk_records": store.records, "disk_bytes": store.bytes_used, "disk_spilled": tier.spilled,
                "disk_loaded": tier.loaded, "rebuild_records_skipped": store.rebuild_skipped}

    # ---- compression (``core.compression``) -------------------------------------------------
    @property
    def compression(self) -> CompressionSection:
        """The live compression settings."""
        return self.compression_control.config

    def compress(self, bits: int | None = None, force: bool = False) -> CompressResult:
        """Compress KV blocks now with ``bits`` (default: the config's). Not forced: evictable cached
        blocks unused for coldAfterSeconds. Forced: every evictable cached block, then running
        requests' blocks outside the recent window. Pool blocks it frees are usable at once."""
        return self.compression_control.compress(list(self.scheduler.running), bits, force)

    def start_compression(self) -> None:
        """Start the background worker (compresses cold cached blocks); a no-op when compression is
        disabled in the config, and it starts later if a live change enables it."""
        self.compression_control.start()

    def stop_compression(self) -> None:
        """Stop the background worker and wait for it (a pass in progress completes first)."""
        self.compression_control.stop()
