"""Per-request state kept by the scheduler and the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from confkv_engine.cache.kv_cache import SeqKV
from confkv_engine.cache.readback import ChainLoad
from confkv_engine.core.outputs import FinishReason, TokenLogprob
from confkv_engine.core.sampling import OutputTracker
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.core.structured_output import GrammarState
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.runtime import RetentionState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request. ``num_computed`` counts token positions already run through the model (their
    KV is cached, or was evicted by a retention policy); after a preemption it restarts at 0 and
    prompt + generated tokens are recomputed."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tracker: OutputTracker
    generator: torch.Generator | None
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    kv: SeqKV = field(default_factory=SeqKV)
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    num_oom: int = 0
    prompt_counted: bool = False
    final_slots: int = 0  # cached slots when it finished (the cache is freed then)
    first_token_time: float | None = None
    finish_time: float | None = None
    peak_kv_bytes: int = 0
    reported_tokens: int = 0  # output tokens already handed out in a RequestOutput
    pending_text: str = ""  # text released by the tracker but not handed out yet
    # Resolved once at admission from the engine's defaults and the request's kv_policy/kv_budget;
    # None: the full cache. A live policy change never alters it.
    retention: RetentionConfig | None = None
    policy_state: RetentionState | None = None  # owned by the retention manager (scores, means...)
    admitted: bool = False  # admitted at least once (a replay after preemption keeps its first prefix)
    prefix_len: int = 0  # prompt tokens served by the prefix cache at first admission
    grammar: GrammarState | None = None  # structured output: made on first sampling
    # The disk store's read-back of blocks beyond its in-memory prefix hit, while in flight; the
    # disk is asked once per admission (``disk_asked``), so a failed read is never retried in a loop.
    disk_load: ChainLoad | None = None
    disk_asked: bool = False

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_len(self) -> int:
        """Prompt plus every token it may generate."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def token_slice(self, start: int, stop: int) -> list[int]:
        p = self.prompt_token_ids
        if stop <= len(p):
            return p[start:stop]
        return (p + self.output_token_ids)[start:stop]

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None
