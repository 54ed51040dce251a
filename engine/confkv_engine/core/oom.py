"""Out-of-memory inside a step: which sequences leave the step, and when a sequence has failed.

The pool is allocated once, so a step's device memory beyond it is activations, and those grow with
the step's sequences (their tokens, the width of their gathers). Dropping the whole step, as a KV
block shortage would, throws away every sequence's work for what one or two of them cost. So the
engine (``LLMEngine._step_scheduled``) retries the step at once without the **most recently
admitted** sequence (the lowest priority, as vLLM preempts), then without the next one, until the
pass fits or one sequence is left: the fewest sequences leave, and the others lose nothing. The
sequences that leave are preempted (their cache freed, requeued first in line in arrival order,
recomputed when they come back).

When the pass reached the model, two kinds of sequence cannot stay for the retry, since it may
have changed them (an OOM raised before the model, such as an injected one, changed nothing):

- a retained sequence (a ``policy_state``): the pass appended its new slots to the scoring state
  and recorded its queries before it failed, and a second pass would record them twice; its replay
  is exact (chunks never cross a decision point), so it is recomputed;
- a sequence whose slots the pass committed already (the failure came after the forward pass, in
  the logits or sampling): its cache holds the step's tokens but it has not sampled.

Other sequences keep their cache: the failed pass wrote their new slots without committing them,
and the retry plans the same slots again and overwrites them. When every sequence of the pass had
to go, nothing is retried; the scheduler then admits one sequence fewer than the pass held until
its queue drains (``Scheduler.limit_running``), lowered again by each such failure, so a group that
fails together is never admitted together forever and a sequence ends up running alone.

Failure: an OOM counts against a sequence only when it ran **alone**, so a request that fits by
itself is never failed for its companions; after ``MAX_OOM_RETRIES`` such OOMs it finishes with
finish_reason 'error' and ``ALONE_ERROR``. A sequence that OOMs alone fewer times is preempted and
tried again later.
"""

from __future__ import annotations

from collections.abc import Sequence as Ordered
from typing import Protocol

from confkv_engine.cache.layout import SeqKV

MAX_OOM_RETRIES = 3
ALONE_ERROR = (f"out of device memory: the request's step did not fit even when it ran alone "
               f"({MAX_OOM_RETRIES} tries); shorten the prompt or max_tokens, lower maxCacheSize "
               f"(more room for activations) or use a larger GPU")


class StepSequence(Protocol):
    """What the choice reads of a sequence (``core.sequence.Sequence``)."""

    kv: SeqKV
    num_computed: int
    policy_state: object | None


def changed_by_failed_pass(seq: StepSequence) -> bool:
    """True when the failed pass may have changed the sequence's state (see the module doc)."""
    return seq.policy_state is not None or seq.kv.num_slots != seq.num_computed


def leavers(step: list[StepSequence], admitted: Ordered[StepSequence],
            ran: bool = True) -> list[StepSequence]:
    """The sequences that leave a step of two or more that ran out of memory: those the failed pass
    changed (only when it ``ran``: reached the model), or, when it changed none, the most recently
    admitted one (``admitted``: the running sequences in admission order), so the retry has at least
    one sequence fewer. Newest first (requeued in this order, each to the front of the queue, they
    wait in arrival order)."""
    rank = {id(s): i for i, s in enumerate(admitted)}
    newest_first = sorted(step, key=lambda s: rank.get(id(s), -1), reverse=True)
    changed = [s for s in newest_first if ran and changed_by_failed_pass(s)]
    return changed or newest_first[:1]
