"""Continuous batching: which sequences run this step, with how many new tokens.

Each step, running sequences (oldest admission first) get their next chunk: 1 token when
decoding, up to ``prefill_chunk`` while prefilling, all within a per-step token budget
(``max_num_batched_tokens``). When the pool cannot hold a running sequence's next chunk, the most
recently admitted running sequence is preempted by recompute (blocks freed, requeued at the
front of the waiting queue, restarted from position 0 later). Waiting sequences are admitted in
FIFO order while there is room in the batch (``max_batch_size``), the budget and the pool; nothing
is admitted in a step that preempted.

Sequences with a binding retention budget (the admission policy's ``reserved_headroom`` returns a
count for them) are admitted
against their budget, not their full length: a waiting one is admitted only while the free blocks
cover its whole reservation plus what running reserved sequences may still take, so those never
preempt one another. Others keep the greedy rule (first chunk fits, preemption as the fallback),
but never take blocks promised to reserved sequences: they grow only while the free blocks cover
the promised ones too, and when room is short the victims are unreserved sequences first.

At admission a sequence shares the longest cached prefix of its tokens (whole blocks, by reference
count) and starts computing after it; the shared blocks count against the pool only when taking
them removes evictable blocks. When the disk store holds more of the prefix, the sequence first
waits for it to be read back (``cache.readback``: off the engine thread, holding no block) while
the sequences behind it are admitted past it and running ones keep stepping; once the read ends,
its blocks are installed and the sequence is admitted with the longer hit (or, if the read found
nothing usable, with the hit it had: it is never asked twice per admission).

Prefill chunks end at multiples of ``block_size`` (unless they finish the known tokens), so a
replay after preemption runs the same chunk boundaries and a retention policy acting at
block-aligned positions takes the same decisions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from confkv_engine.cache.kv_cache import KVCache
from confkv_engine.cache.readback import ChainLoad, PrefixHit
from confkv_engine.core.sequence import SeqStatus, Sequence


class AdmissionPolicy(Protocol):
    """What the scheduler asks about a sequence beyond its length (retention's reservation)."""

    def reserved_headroom(self, seq: Sequence) -> int | None:
        """Blocks the sequence may still take from its reservation; None: not reserved (greedy)."""
        ...

    def chunk_alignment(self, seq: Sequence) -> int:
        """Prefill chunks of the sequence end at multiples of this (unless they finish its tokens)."""
        ...

    def chunk_limit(self, seq: Sequence) -> int | None:
        """Most tokens one prefill chunk of the sequence may hold (None: the engine's prefill chunk)."""
        ...


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # decodes first
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, cache: KVCache, admission: AdmissionPolicy, max_batch_size: int,
                 max_num_batched_tokens: int, prefill_chunk: int) -> None:
        self.cache = cache
        self.admission = admission
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        # Align chunk ends only when a chunk can hold whole blocks.
        self.aligned = prefill_chunk >= cache.spec.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._oom_limit: int | None = None  # running sequences allowed after an OOM (``limit_running``)

    def set_max_batch_size(self, n: int) -> None:
        """Live change: applies from the next ``schedule``; running sequences over it finish."""
        self.max_batch_size = n

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def requeue_front(self, seq: Sequence) -> None:
        """Free the sequence's cache and put it first in line (recompute from position 0; its
        retention state goes too, so the replay decides everything again)."""
        self._release(seq)
        seq.num_computed = 0
        seq.policy_state = None
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def limit_running(self, n: int) -> None:
        """After a pass that ran out of memory and had to send every sequence back (``core.oom``):
        admit at most ``n`` running sequences until the waiting queue drains, so the same group is
        not admitted together to fail together again; a later failure lowers it further."""
        self._oom_limit = max(1, n)

    def preempt(self, seq: Sequence) -> None:
        """``requeue_front``, counted as a preemption (for want of blocks, or out of device memory)."""
        self.requeue_front(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks at once."""
        self._release(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.cache.free(seq.kv)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def chunk_size(self, seq: Sequence, budget: int, start: int | None = None) -> int:
        """Tokens to run for ``seq`` this step, from ``start`` (default: what it has computed)."""
        start = seq.num_computed if start is None else start
        remaining = seq.num_tokens - start
        n = min(remaining, self.prefill_chunk, budget, self.admission.chunk_limit(seq) or remaining)
        align = self.admission.chunk_alignment(seq) if self.aligned else 1
        if 0 < n < remaining and align > 1:
            end = start + n
            n = end - end % align - start
        return max(n, 0)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self.waiting:
            self._oom_limit = None  # the queue an OOM built up has drained
        budget = self.max_num_batched_tokens
        # Blocks still promised to running reserved sequences (by id): others may not take them.
        promised = {id(s): h for s in self.running if (h := self._headroom(s)) is not None}
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self.chunk_size(seq, budget)
            if n and self._make_room(seq, n, out, promised):
                if id(seq) in promised:
                    promised[id(seq)] = max(0, promised[id(seq)] - self.cache.blocks_needed(seq.kv, n))
                self.cache.reserve(seq.kv, n)
                out.scheduled.append((seq, n))
                budget -= n
            if seq in self.running:  # still there (not preempted itself)
                i += 1
        if not out.preempted:
            budget = self._admit(out, budget, sum(promised.values()))
        out.scheduled.sort(key=lambda item: item[1] != 1)  # stable: decode rows first
        return out

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput, promised: dict[int, int]) -> bool:
        """Preempt until ``seq`` can grow by n; False if seq itself went. A sequence without a
        reservation must also leave the blocks promised to reserved ones, and the victims are the
        most recently admitted sequences without a reservation first, so reserved sequences are
        never preempted to make room for others."""
        while True:
            hold_back = 0 if id(seq) in promised else sum(promised.values())
            if self.cache.can_allocate(self.cache.blocks_needed(seq.kv, n) + hold_back):
                return True
            # Only sequences not yet scheduled this step (seq and those after it) can go.
            later = self.running[self.running.index(seq):]
            unreserved = [s for s in later if id(s) not in promised]
            victim = unreserved[-1] if unreserved else later[-1]
            promised.pop(id(victim), None)
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False

    def _prefix_hits(self, seq: Sequence) -> PrefixHit | None:
        """The cached blocks a waiting sequence may share; None while the disk store reads more of
        them back (asked here, once per admission). Never its last token (its logits are needed),
        never for prompt logprobs (every prompt row is computed; documented in the README), and a
        retained sequence's replay never shares more than it did at first admission (its
        protected prefix, so its decisions replay exactly)."""
        if not self.cache.prefix_enabled or seq.wants_prompt_logprobs:
            return PrefixHit([], 0, 0)
        limit = (seq.num_tokens - 1) // self.cache.spec.block_size
        if seq.retention is not None and seq.admitted:
            limit = min(limit, seq.prefix_len // self.cache.spec.block_size)
        tokens = seq.token_slice(0, seq.num_tokens)
        hit = self.cache.lookup(tokens, limit, read_disk=not seq.disk_asked)
        if not seq.disk_asked:
            seq.disk_asked = True
            seq.disk_load = hit.load
            if seq.disk_load is not None:
                return None
        return hit

    def _loading(self, seq: Sequence) -> bool:
        """True while the sequence's read-back is in flight; once it ended, its blocks are installed."""
        if seq.disk_load is None:
            return False
        if not seq.disk_load.done.is_set():
            return True
        self.cache.install_load(seq.disk_load)
        seq.disk_load = None
        return False

    def pending_load(self) -> ChainLoad | None:
        """A read-back a waiting sequence waits for (the engine, with nothing to step, waits on it)."""
        return next((s.disk_load for s in self.waiting if s.disk_load is not None), None)

    def _sharing_soon(self, seq: Sequence, cached: int) -> bool:
        """True when a running request is still prefilling full blocks of this one's prompt beyond
        the ``cached`` tokens: admitting it after that request's step lets it share those blocks
        (the choices of an ``n`` > 1 request, requests with one system prompt arriving together)."""
        if not self.cache.prefix_enabled or seq.wants_prompt_logprobs:
            return False
        bs, mine = self.cache.spec.block_size, seq.prompt_token_ids
        limit = (len(mine) - 1) // bs * bs
        for other in self.running:
            if other.retention is not None or other.num_computed >= other.prompt_len:
                continue  # retained requests register nothing while running; decoding ones are done
            theirs = other.prompt_token_ids
            common = next((i for i, (a, b) in enumerate(zip(mine[:limit], theirs, strict=False)) if a != b),
                          min(limit, len(theirs)))
            if common // bs * bs > cached:
                return True
        return False

    def _headroom(self, seq: Sequence) -> int | None:
        return self.admission.reserved_headroom(seq)

    def _admit(self, out: SchedulerOutput, budget: int, promised: int) -> int:
        """Admit waiting sequences; ``promised``: blocks running reservations may still take."""
        i = 0
        limit = min(self.max_batch_size, self._oom_limit or self.max_batch_size)
        while i < len(self.waiting) and budget > 0 and len(self.running) < limit:
            seq = self.waiting[i]
            hit = None if self._loading(seq) else self._prefix_hits(seq)
            if hit is None:  # its blocks are on their way from disk: the next ones go first
                i += 1
                continue
            if self._sharing_soon(seq, hit.tokens):
                break  # next step its prefix is cached: share it instead of computing it again
            start = hit.tokens
            n = self.chunk_size(seq, budget, start)
            # The sequence is empty until it attaches the hit (window groups' tables included).
            need = self.cache.blocks_needed(seq.kv, start + n) - 2 * len(hit.blocks)
            reserved = self._headroom(seq)
            # Shared now, the hit's evictable blocks are no longer reclaimable.
            wanted = promised + max(need, reserved or 0) + hit.reclaimable_taken
            if n == 0 or not self.cache.can_allocate(wanted):
                break
            del self.waiting[i]
            seq.disk_asked = False  # a later replay (after a preemption) may read from disk again
            first = not seq.admitted
            seq.num_computed = self.cache.attach(seq.kv, hit.blocks, seq.prompt_len if first else 0,
                                                 spare=self.cache.num_free - wanted)
            if first:
                seq.admitted, seq.prefix_len = True, seq.num_computed
            self.cache.reserve(seq.kv, n)
            promised += max(0, (reserved or 0) - need)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return budget
