"""The engine on each tensor-parallel rank: rank 0 leads, the others follow its step plan.

Rank 0 (``LeaderEngine``) takes requests, runs the scheduler, the prefix index and the sampling, as
a single-GPU engine does. Every step it broadcasts (``TPGroup.broadcast_object``, rank 0's objects
over ``torch.distributed``):

1. the requests added and aborted since the last step (``StepOrder``),
2. the step's plan: per scheduled sequence its request id, its tokens and positions this step, its
   block tables (``StepPlan``),
3. after the forward pass, the sampled token ids.

Every other rank (``WorkerEngine``) applies 1 to an identical scheduler and cache manager (same
config, same pool size in blocks, same admission), so it schedules the same sequences into the
same blocks; it checks its own plan against 2 before the forward pass and stops with a clear error
if it ever differs, runs the forward on its shard (the model's all-reduces and the LM head's gather
keep the ranks in lock step), and appends 3 instead of sampling. Retention decisions need no
message: the policy runs on every rank over the units gathered from all of them
(``retention.runtime.RetentionState.decide``), so every rank evicts, freezes and compresses the
same tokens and keeps its own heads' part. At the end of each step the ranks exchange their KV
usage (``rank_usage``; /metrics reports it per rank).

While idle, rank 0 sends a heartbeat (``heartbeat``) more often than the group's collective
timeout, so a worker waiting for the next step never times out; a rank that stops answering makes
the next collective raise after the timeout, and the launcher turns that into the server's exit.

Not replicated yet, so refused under tensor parallelism: live policy changes (gRPC UpdatePolicy)
and background compression. The disk store keeps a shard per rank (``parallel.disk``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.engine_control import PolicyRejected
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.core.sequence import Sequence
from confkv_engine.parallel.group import TensorParallelError, TPGroup


@dataclass(frozen=True)
class StepOrder:
    """What rank 0 sends before each step (or as a heartbeat, ``run`` False)."""

    added: list[tuple[str, list[int], SamplingParams]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    run: bool = True
    stop: bool = False


@dataclass(frozen=True)
class RankUsage:
    rank: int
    kv_bytes_used: int
    kv_bytes_total: int
    free_blocks: int
    total_blocks: int


def step_plan(scheduled: list[tuple[Sequence, int]]) -> list[tuple[str, int, int, list[int], list[int]]]:
    """(request id, first position, tokens, K block table, V block table) per scheduled sequence."""
    return [(s.request_id, s.num_computed, n, list(s.kv.k_blocks), list(s.kv.v_blocks)) for s, n in scheduled]


class _RankEngine(LLMEngine):
    def __init__(self, group: TPGroup, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.rank_usage: list[RankUsage] = []

    def _usage(self) -> RankUsage:
        c = self.cache
        return RankUsage(self.group.rank, c.used_bytes, c.total_bytes, c.num_free, c.num_blocks)

    def _exchange_usage(self) -> None:
        import torch.distributed as dist

        everyone: list[Any] = [None] * self.group.world
        dist.all_gather_object(everyone, self._usage())
        self.rank_usage = everyone

    def usage_by_rank(self) -> list[RankUsage]:
        """Every rank's pool as of the last step (before the first: this rank's, then the others'
        as unknown until they report)."""
        with self.lock:
            return list(self.rank_usage) or [self._usage()]

    def apply_policy(self, *args: Any, **kwargs: Any) -> None:
        raise PolicyRejected("live policy changes are not replicated to tensor-parallel ranks; "
                             "change the config and restart")


class LeaderEngine(_RankEngine):
    """Rank 0: an ``LLMEngine`` that tells the other ranks what each step does."""

    def __init__(self, group: TPGroup, *args: Any, **kwargs: Any) -> None:
        super().__init__(group, *args, **kwargs)
        self._order = StepOrder()
        self._last_sent = time.monotonic()
        self.stopped = False  # set by ``close``: the workers leave their loop and exit 0
        # Called with the reason when a step fails: the ranks can no longer be in step, so the
        # launcher ends the server (parallel.launch.rank_lost) instead of serving errors.
        self.on_group_lost: Callable[[str], None] | None = None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        with self.lock:
            super().add_request(request_id, prompt_token_ids, params)
            self._order.added.append((request_id, list(prompt_token_ids), params))

    def abort_request(self, request_id: str) -> None:
        with self.lock:
            super().abort_request(request_id)
            self._order.aborted.append(request_id)

    def _send(self, order: StepOrder) -> None:
        self.group.broadcast_object(order)
        self._last_sent = time.monotonic()

    def step(self) -> list[Any]:
        with self.lock:
            order, self._order = self._order, StepOrder()
            try:
                self._send(order)
                return super().step()
            except Exception as err:
                if self.on_group_lost is not None:
                    self.on_group_lost(f"a step failed: {type(err).__name__}: {err}")
                raise

    def heartbeat(self, every_s: float) -> None:
        """Tell idle workers rank 0 is alive when nothing was sent for ``every_s`` seconds."""
        with self.lock:
            if time.monotonic() - self._last_sent >= every_s:
                self._send(StepOrder(run=False))

    def _run(self, scheduled: list[tuple[Sequence, int]]) -> dict[Sequence, Any]:
        self.group.broadcast_object(step_plan(scheduled))
        results = super()._run(scheduled)
        self.group.broadcast_object({s.request_id: token for s, (token, _) in results.items()})
        self._exchange_usage()
        return results

    def close(self) -> None:
        """Stop the workers (they leave their loop), then release what the engine holds."""
        with self.lock:
            self.stopped = True
            self._send(StepOrder(run=False, stop=True))
        super().close()


class WorkerEngine(_RankEngine):
    """Ranks 1..N-1: replay rank 0's orders on an identical scheduler; no sampling of their own."""

    def serve_forever(self) -> None:
        """Follow rank 0 until it says stop (a collective error propagates: the rank exits)."""
        while True:
            order: StepOrder = self.group.broadcast_object()
            for request_id, prompt, params in order.added:
                self.add_request(request_id, prompt, params)
            for request_id in order.aborted:
                self.abort_request(request_id)
            if order.stop:
                self.close()  # as rank 0 does: this rank's cached blocks are offered to its disk shard
                return
            if order.run:
                self.step()

    def _run(self, scheduled: list[tuple[Sequence, int]]) -> dict[Sequence, Any]:
        leader_plan = self.group.broadcast_object()
        mine = step_plan(scheduled)
        if leader_plan != mine:
            raise TensorParallelError(
                f"rank {self.group.rank} diverged from rank 0: it scheduled {[p[:3] for p in mine]}, "
                f"rank 0 {[p[:3] for p in leader_plan]}")
        results = super()._run(scheduled)
        tokens: dict[str, int] = self.group.broadcast_object()
        self._exchange_usage()
        return {s: (tokens[s.request_id], lp) for s, (_, lp) in results.items()}
