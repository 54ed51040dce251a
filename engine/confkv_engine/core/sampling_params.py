"""Per-request sampling parameters (the contract between the HTTP layer and the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value (vLLM clamps to it as well)


class InvalidRequest(ValueError):
    """A request the engine refuses (bad parameter value, prompt too long, can never fit).

    The HTTP layer turns it into a 400 in the OpenAI error format; ``param`` names the field.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class StructuredOutput:
    """Constrained decoding request: ``kind`` 'json_object' (any JSON object) or 'json_schema'
    (``schema`` is the JSON Schema as canonical JSON text, so the params stay hashable data)."""

    kind: Literal["json_object", "json_schema"]
    schema: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI-style sampling controls.

    temperature 0 means greedy. top_k <= 0 disables top-k. logprobs = number of top alternatives to
    return per generated token (None: no logprobs). prompt_logprobs = same for prompt tokens
    (None: none; used with ``echo``). kv_policy/kv_budget/kv_tiers override the cache policy per request.

    Logit processing follows vLLM's order and semantics: ``logit_bias`` (token id, bias) pairs are
    added to the raw logits; then ``repetition_penalty`` (over prompt and output tokens: positive
    logits divided by it, negative ones multiplied), then ``frequency_penalty`` * count and
    ``presence_penalty`` * [count > 0] subtracted over output tokens only; then temperature,
    ``min_p`` (drop tokens whose tempered probability is below min_p times the top one), top-k,
    top-p. Greedy rows take the argmax after bias and penalties. ``structured`` restricts every
    step to the tokens its grammar allows.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    kv_policy: str | None = None
    kv_budget: float | None = None
    kv_tiers: tuple[str, ...] | None = None  # confkv.tiers for this request (validated at admission)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "temperature", "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= 0 or self.top_k == -1, "top_k", "top_k must be >= 0 (or -1 to disable)"),
            (self.max_tokens >= 0, "max_tokens", "max_tokens must be >= 0"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be >= 0"),
            (self.min_tokens <= max(self.max_tokens, 0) or self.max_tokens == 0, "min_tokens",
             "min_tokens must be <= max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             "prompt_logprobs must be in [0, 20]"),
            (self.kv_budget is None or 0 < self.kv_budget <= 1, "kv_budget", "kv_budget must be in (0, 1]"),
            (self.kv_policy in (None, "full", "streaming", "h2o", "conf-kv"), "kv_policy",
             "kv_policy must be one of full, streaming, h2o, conf-kv"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", "repetition_penalty must be > 0"),
            (0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1]"),
            (all(t >= 0 and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in self.logit_bias),
             "logit_bias", f"logit_bias maps token ids >= 0 to values in [-{MAX_LOGIT_BIAS:g}, "
             f"{MAX_LOGIT_BIAS:g}]"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(message, param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
