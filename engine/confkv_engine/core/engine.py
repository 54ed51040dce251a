"""Synchronous engine: requests in, one batched model step per ``step()``, outputs out.

``LLMEngine(loaded, config)``: ``loaded`` is a ``model.loader.LoadedModel`` (model, tokenizer,
max_model_len, eos_token_ids, ...) or anything with those attributes; ``config`` a
``ConfKVConfig`` (engine and confkv sections are read). This module is the step loop only: the
parts are built from config by ``parts.build_parts``, the control surface (live policy, resize,
stats, compression control: the control plane's ``EngineControlTarget``) is
``engine_control.EngineControlSurface``, its base, and what a step reads out is ``step_io``. Not
thread-safe by itself beyond the parts' lock around public calls: the HTTP layer drives it from one
thread (``async_engine.AsyncEngine``).

Per step: the scheduler picks sequences and chunk sizes; the step's tokens are flattened (decode
rows first) and run once through the model with ``PagedAttention``; logits are computed only for
rows that sample a token or need prompt logprobs; the sampling layer picks tokens; trackers turn
them into text and finish reasons; the retention policy runs; outputs for sequences that
progressed are returned.

CUDA out-of-memory during a step is caught and counted; the step is retried at once without the
fewest sequences (the most recently admitted first, preempted for recompute), and only a sequence
that runs out of memory alone ``MAX_OOM_RETRIES`` times finishes with finish_reason 'error'
(``core.oom``). Tests drive that path on a CPU with ``core.faults`` (off unless one of its
environment variables is set; no config key can switch it on).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from confkv_api.config import ConfKVConfig
from confkv_engine.cache.kv_cache import SeqKV
from confkv_engine.core import sampling
from confkv_engine.core.engine_control import EngineControlSurface
from confkv_engine.core.faults import OomFault
from confkv_engine.core.oom import ALONE_ERROR, MAX_OOM_RETRIES, leavers
from confkv_engine.core.outputs import RequestOutput
from confkv_engine.core.parts import EngineParts, build_parts
from confkv_engine.core.sampling_params import InvalidRequest, SamplingParams
from confkv_engine.core.sequence import SeqStatus, Sequence
from confkv_engine.core.step_io import check_request, request_output, sample_step
from confkv_engine.core.step_signal import StepSignal
from confkv_engine.retention.policies import RetentionConfig

# With nothing to step but requests waiting for disk read-backs, ``step`` waits this long at most
# for one to land (it returns as soon as one does): no busy loop, and no wait on a lost read.
DISK_WAIT_SECONDS = 0.05


class QueueFull(RuntimeError):
    """The waiting queue is at ``maxWaiting`` (the HTTP layer answers 429)."""


class LLMEngine(EngineControlSurface):
    def __init__(self, loaded: Any, config: ConfKVConfig | None = None,
                 retention: RetentionConfig | None = None, parts: EngineParts | None = None) -> None:
        """``parts``: already built ones (else built from ``loaded``, ``config`` and ``retention``)."""
        p = parts or build_parts(loaded, config or ConfKVConfig(), retention)
        self.parts = p
        self.model, self.tokenizer, self.vocab_size = p.model, p.tokenizer, p.vocab_size
        self.max_model_len, self.eos_token_ids = p.max_model_len, p.eos_token_ids
        self.device, self.dtype, self.cache_dtype = p.device, p.dtype, p.cache_dtype
        self.compile_seconds = p.compile_seconds
        self.cache, self.disk, self.retention, self.backend = p.cache, p.disk, p.retention, p.backend
        self.scheduler, self.compression_control, self.lock = p.scheduler, p.compression, p.lock
        self.max_waiting = p.max_waiting
        self.memory_plan = p.memory_plan  # the start-up plan (weights, activations, pool, reserve)
        self.decode_runner = p.decode_runner  # static-buffer decode (CUDA graphs on CUDA), or None
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []  # aborted requests, reported by the next step
        self.signal = StepSignal(self.model, self.retention, self.vocab_size)  # the sampling signal's rows
        self._ids = itertools.count()
        self.num_oom = 0
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.num_finished = 0
        self._oom_fault = OomFault.from_env()  # off unless a CONFKV_FAULT_OOM_* variable is set

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._seqs:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        cfg = check_request(prompt_token_ids, params, self.vocab_size, self.max_model_len, self.retention,
                            self.cache)
        seq = Sequence(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
            tracker=sampling.OutputTracker(self.tokenizer, params, self.eos_token_ids, prompt_token_ids),
            generator=sampling.make_generator(params.seed, self.device), arrival_time=time.time(),
            retention=None if cfg.policy == "full" else cfg)
        with self.lock:
            if len(self.scheduler.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.scheduler.waiting)} requests are already waiting")
            self._seqs[request_id] = seq
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its final output comes with the next step."""
        with self.lock:
            seq = self._seqs.get(request_id)
            if seq is None or seq.finished:
                return
            self._finish(seq, "abort")
            self._pending.append(self._output(seq))

    def has_unfinished(self) -> bool:
        with self.lock:
            return self.scheduler.has_unfinished() or bool(self._pending)

    # ---- stepping --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self.lock, torch.inference_mode():
            outputs, self._pending = self._pending, []
            sched = self.scheduler.schedule()
            load = None if sched.scheduled else self.scheduler.pending_load()
            if sched.scheduled:
                return outputs + self._step_scheduled(sched.scheduled)
        if load is not None:  # only disk read-backs are left to wait for: sleep on one, not the lock
            load.done.wait(DISK_WAIT_SECONDS)
        return outputs

    def _step_scheduled(self, scheduled: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []  # of sequences an OOM failed
        while True:  # out of memory: retry at once with fewer sequences (``core.oom``)
            ran = False  # whether the failed pass got to the model (and the sequences' state)
            try:
                self._oom_fault.before_model(sum(n for _, n in scheduled))
                ran = True
                results = self._run(scheduled)
                break
            except torch.OutOfMemoryError:
                scheduled = self._recover_from_oom(scheduled, ran, outputs)
                if not scheduled:
                    return outputs
        self.signal.record(results)  # the sampling signal of the step's rows, before they advance
        # The step's decision points read the attention signal back with one wait for all sequences.
        self.retention.score_decisions([(s.kv, s.policy_state, s.num_computed + n) for s, n in scheduled])
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
        self.cache.staging.begin_step()
        states = [self.retention.prepare(s) for s, _ in scheduled]
        hidden = self._forward([s.kv for s, _ in scheduled], [n for _, n in scheduled], ids, pos, states)
        self.signal.take(scheduled, hidden)
        return sample_step(self.model, self.tokenizer, self.vocab_size, self.eos_token_ids, scheduled,
                           hidden, self.cache.staging.send, self.signal.sampled_logits)

    def _forward(self, seqs: list[SeqKV], num_new: list[int], ids: list[int], pos: list[int],
                 states: list[Any]) -> torch.Tensor:
        """The model over the step's rows: the static-buffer decode path when the step qualifies
        (``graph_runner``), else the eager backend; the appended slots are committed."""
        runner = self.decode_runner
        if runner is not None and runner.accepts(seqs, num_new, states):
            return runner.run(seqs, ids, pos)
        input_ids, positions = self.cache.staging.send([ids, pos])
        self.backend.begin_step(seqs, num_new, positions, states)
        hidden = self.model(input_ids, positions, self.backend)
        self.backend.end_step()
        return hidden

    def _advance(self, seq: Sequence, n: int, result: tuple[int, Any] | None) -> None:
        was_prefill = seq.num_computed < seq.prompt_len
        seq.num_computed += n
        if seq.retention is None:
            self._register(seq)
        held = self.retention.held_bytes(seq.kv, seq.policy_state) + self.cache.window_bytes(seq.kv)
        seq.peak_kv_bytes = max(seq.peak_kv_bytes, held)
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

    def _recover_from_oom(self, scheduled: list[tuple[Sequence, int]], ran: bool,
                          outputs: list[RequestOutput]) -> list[tuple[Sequence, int]]:
        """Take the fewest sequences out of a step that ran out of memory (preempted, or failed with
        an output in ``outputs`` after repeated OOMs alone); ``ran``: the pass reached the model.
        Returns what the retry runs."""
        self.num_oom += 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if len(scheduled) == 1:
            seq = scheduled[0][0]
            seq.num_oom += 1  # only an OOM alone counts towards failure
            if seq.num_oom >= MAX_OOM_RETRIES:
                self._finish(seq, "error", error=ALONE_ERROR)
                outputs.append(self._output(seq))
            else:
                self.scheduler.preempt(seq)
            return []
        gone = leavers([s for s, _ in scheduled], self.scheduler.running, ran)
        for seq in gone:
            self.scheduler.preempt(seq)
        rest = [(s, n) for s, n in scheduled if not any(s is g for g in gone)]
        if not rest:  # all had to go (retained): they must not come back as the same group
            self.scheduler.limit_running(len(scheduled) - 1)
        return rest

    def _output(self, seq: Sequence) -> RequestOutput:
        return request_output(seq, self.retention.usage(seq))

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
