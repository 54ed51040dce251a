"""Result objects the engine hands to its callers (HTTP layer, benchmarks, tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from confkv_engine.cache.usage import KVUsage

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability (untempered log-softmax, fp32) of one token plus the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass
class RequestOutput:
    """State of one request after an engine step.

    ``new_token_ids``/``new_text`` are the delta since the previous output for this request;
    ``output_token_ids``/``text`` are cumulative. ``prompt_logprobs`` is filled once, when the
    prompt has been fully processed (first entry None, as in OpenAI's echo).
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    new_text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage.prompt_tokens_details)
    kv_usage: KVUsage = field(default_factory=KVUsage)
