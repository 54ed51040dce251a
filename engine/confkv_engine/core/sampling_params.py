"""Per-request sampling parameters (the contract between the HTTP layer and the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequest(ValueError):
    """A request the engine refuses (bad parameter value, prompt too long, can never fit).

    The HTTP layer turns it into a 400 in the OpenAI error format; ``param`` names the field.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI-style sampling controls.

    temperature 0 means greedy. top_k <= 0 disables top-k. logprobs = number of top alternatives to
    return per generated token (None: no logprobs). prompt_logprobs = same for prompt tokens
    (None: none; used with ``echo``). kv_policy/kv_budget override the cache policy per request.
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
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(message, param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
