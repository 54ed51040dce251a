"""The sampling signal of a step's rows, for the sequences whose retention reads it.

The precision chain's confidence weighs each token's surprise under the model (``retention.scorer``),
so a sequence with it needs the untempered logits of every row it runs: prompt rows in prefill, its
decode row. ``StepSignal`` takes them for the whole step at once:

- ``take`` (after the forward pass): the rows whose successor is already a token of the sequence
  are reduced at once, every sequence's together, ``SIGNAL_BYTES`` of fp32 logits at a time (a
  step's prefill rows in one go would hold rows x vocabulary floats; the start-up profile takes
  logits for one slice, ``slice_rows``, when that is more than the sampled rows; one slice per
  sequence would read the LM head once per sequence). The rows whose successor is about to be
  sampled keep their logits, and the sampler reads them (``sampled_logits``) when its rows are
  exactly those: the step's sampled rows go through the LM head once, not twice.
- ``record`` (after sampling): those rows are reduced against the sampled tokens, and every
  sequence's values are read back to the host once for the step (the decode step's one more wait is
  shared by all its sequences), then recorded through ``RetentionManager.record_values``.

A step the OOM path cuts short never reaches ``record``: ``take`` starts afresh every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from confkv_engine.cache.staging import send_pinned
from confkv_engine.retention.scorer import SamplingSignal, sampling_signal

SIGNAL_BYTES = 64 << 20


def slice_rows(vocab_size: int) -> int:
    """Rows of fp32 logits a signal slice holds (the start-up profile takes at least as many)."""
    return max(1, SIGNAL_BYTES // (4 * vocab_size))


@dataclass(frozen=True)
class _Rows:
    """One sequence's rows in a step: ``known`` rows with a known successor, then the sampled one."""

    seq: Any
    known: int
    sampled: bool


class StepSignal:
    """Owned by the engine; ``model`` computes logits, ``retention`` is the ``RetentionManager``."""

    def __init__(self, model: Any, retention: Any, vocab_size: int) -> None:
        self.model, self.retention, self.vocab_size = model, retention, vocab_size
        self._plan: list[_Rows] = []
        self._known: SamplingSignal | None = None
        self._spread = False
        self._logits: Tensor | None = None  # [sampled rows, V]
        self._last: list[int] = []  # their rows in the step's hidden states

    def take(self, scheduled: list[tuple[Any, int]], hidden: Tensor) -> None:
        """``scheduled``: (sequence, rows) in the order of ``hidden``'s rows [N, H]."""
        self._plan, offset, rows, nxt, last = [], 0, [], [], []
        for seq, n in scheduled:
            if self.retention.wants_logits(seq.policy_state):
                known = max(0, min(n, seq.num_tokens - 1 - seq.num_computed))
                self._plan.append(_Rows(seq, known, known < n))
                rows += range(offset, offset + known)
                nxt += seq.token_slice(seq.num_computed + 1, seq.num_computed + 1 + known)
                last += [offset + n - 1] if known < n else []
            offset += n
        self._spread = any(self.retention.needs_spread(r.seq.policy_state) for r in self._plan)
        self._known = self._reduce(hidden, rows, nxt) if self._plan else None
        index = send_pinned(last, hidden.device, torch.long) if last else None  # never a blocking send
        self._logits = self.model.compute_logits(hidden[index]) if index is not None else None
        self._last = last

    def sampled_logits(self, rows: list[int]) -> Tensor | None:
        """The fp32 logits ``take`` computed for the rows about to be sampled, when the sampler's
        ``rows`` are exactly those (every sampling sequence reads the signal); else None. The same
        rows through the same head give the same values, so the tokens do not depend on who
        computed them; the sampler copies before it processes, so ``record`` still reads them raw."""
        return self._logits if self._logits is not None and rows == self._last else None

    def _reduce(self, hidden: Tensor, rows: list[int], nxt: list[int]) -> SamplingSignal:
        if not rows:
            return self._empty(hidden)
        step = slice_rows(self.vocab_size)
        index = send_pinned(rows, hidden.device, torch.long)
        tokens = send_pinned(nxt, hidden.device, torch.long)
        parts = [sampling_signal(self.model.compute_logits(hidden[index[r:r + step]]), tokens[r:r + step],
                                 self._spread) for r in range(0, len(rows), step)]
        return SamplingSignal.cat(parts)

    def _empty(self, like: Tensor) -> SamplingSignal:
        z = like.new_zeros(0)
        return SamplingSignal(z, z if self._spread else None, z if self._spread else None)

    def record(self, results: dict[Any, tuple[int, Any]]) -> None:
        """``results``: the step's sampled (token, logprob) per sequence; call before the sequences
        advance (a row's position is read from ``num_computed``)."""
        plan, self._plan = self._plan, []
        if not plan or self._known is None:
            return
        sampled = self._sampled(plan, results)
        values, start, k = [], 0, 0
        for r in plan:
            parts = [self._known.rows(start, start + r.known)]
            start += r.known
            if r.sampled and r.seq in results and sampled is not None:
                parts.append(sampled.rows(k, k + 1))
                k += 1
            values.append(self.retention.signal_values(r.seq.policy_state, SamplingSignal.cat(parts)))
        flat = torch.cat([v.flatten() for v in values]).tolist()  # the step's one read-back
        at = 0
        for r, v in zip(plan, values, strict=True):
            width = v.shape[1]
            rows = [flat[at + i * width: at + (i + 1) * width] for i in range(v.shape[0])]
            at += v.numel()
            self.retention.record_values(r.seq.policy_state, r.seq.num_computed + 1, rows)

    def _sampled(self, plan: list[_Rows], results: dict[Any, tuple[int, Any]]) -> SamplingSignal | None:
        """The sampled rows' signal against the tokens just sampled (a row whose sequence sampled
        nothing, a prompt-only request's last, has no successor and is left out)."""
        if self._logits is None:
            return None
        keep = [i for i, r in enumerate(x for x in plan if x.sampled) if r.seq in results]
        if not keep:
            return None
        tokens = [results[r.seq][0] for r in plan if r.sampled and r.seq in results]
        device = self._logits.device
        return sampling_signal(self._logits[send_pinned(keep, device, torch.long)],
                               send_pinned(tokens, device, torch.long), self._spread)
