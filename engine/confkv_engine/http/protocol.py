"""Request models of the OpenAI-compatible HTTP API (pydantic) and the OpenAI error body.

Unknown request fields are rejected with a 400 naming the field, as OpenAI's own API does
("Unrecognized request argument"), so a typo such as ``top_K`` never silently changes nothing.
Fields OpenAI defines that this server cannot honour are accepted only at their no-op values
(no ``suffix``/tools) and are a 400 otherwise. Engine-specific sampling controls (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``kv_policy``, ``kv_budget``, ``kv_tiers``) are accepted as extra body fields, the way the ``openai`` client's
``extra_body`` sends them (vLLM's names). ``response_format`` is accepted on both endpoints, as vLLM
does. The ``/tokenize`` and ``/detokenize`` bodies are vLLM's.

Text that cannot be tokenized is refused here, not deep in the tokenizer: a prompt or message with
a lone surrogate (``"\ud800"``, which JSON can carry but Unicode text cannot) is a 400 naming the
field. ``seed`` is a signed 64-bit integer, as in OpenAI's API and as torch's generators take it.

Types are strict, as OpenAI's API is: an integer field (``max_tokens``, ``n``, ``seed``, token ids...)
takes only a JSON integer (not ``"7"``, ``true`` or ``7.0``), a boolean only ``true``/``false``, a
number field a JSON number (an integer is a number), and numbers must be finite (JSON has no NaN,
but Python's parser reads ``NaN``/``Infinity``; they are refused as "must be a finite number", never
as out of range). Nothing stays lenient except ``null``, which means "the default" for any optional
parameter, as in OpenAI's API.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from confkv_engine.core.sampling_params import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_METADATA_PAIRS = 16  # OpenAI's limit on ``metadata``
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def check_unicode(text: str) -> str:
    """``text`` if it is valid Unicode; a lone surrogate (only ever non-ASCII) is a ValueError."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"contains a lone surrogate (U+{ord(text[err.start]):04X} at character "
                             f"{err.start}); text must be valid Unicode") from None
    return text


MAX_CHOICES = 64  # n / best_of: each choice is a sequence in the batch

# Every list field stops at its first bad item. By default pydantic builds an error per item, and
# a union tries each member: 2.1M ids ending in one bad item took 26 s to refuse (4.2M errors), on
# the event loop (health probes time out), where the answer names only the first error anyway.
# Dict fields check their values the same way in a before-validator (no fail-fast for mappings).
FAIL_FAST = Field(fail_fast=True)
TierName = Literal["full", "key_only", "int8", "int4", "k4v2", "int2"]
# Strict JSON types and finite numbers on every request model (see the module docstring).
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
_BIAS = TypeAdapter(float, config=ConfigDict(strict=True, allow_inf_nan=False))


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code)).model_dump()


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


def _null_is_default(schema: dict[str, Any]) -> None:
    """The published schema says what ``_Request._null_means_default`` does: every optional field
    also takes ``null`` (its default), so a schema-driven client or fuzzer sees the real contract."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required:
            continue
        if "anyOf" not in prop:
            shape = {k: v for k, v in prop.items() if k not in ("title", "default", "description")}
            for k in shape:
                del prop[k]
            prop["anyOf"] = [shape]
        if {"type": "null"} not in prop["anyOf"]:
            prop["anyOf"].append({"type": "null"})


class _Request(BaseModel):
    """Fields common to both endpoints (OpenAI's plus this engine's sampling extras)."""

    model_config = ConfigDict(**STRICT, json_schema_extra=_null_is_default)
    # Fields whose validation of a list of JSON integers (or of a list of such lists) depends only
    # on the items being integers, not on their number or values: a large body's lists there are
    # type-checked a slice at a time off the event loop (``http.body``), not by pydantic in one call.
    TOKEN_ID_FIELDS: ClassVar[tuple[str, ...]] = ("stop_token_ids",)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], FAIL_FAST] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    response_format: dict[str, Any] | None = None
    # Engine extras (``extra_body`` in the openai client).
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[int], FAIL_FAST] = Field(default_factory=list)
    kv_policy: Literal["full", "streaming", "h2o", "conf-kv"] | None = None
    kv_budget: float | None = Field(default=None, gt=0.0, le=1.0)
    # The kept tiers, highest first (confkv.tiers): ["full", "int4", "int2"], ["full", "key_only"]...
    kv_tiers: Annotated[list[TierName], FAIL_FAST] | None = Field(default=None, max_length=5)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI accepts ``null`` for any optional parameter; here it means the default."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _numeric_biases(cls, value: Any) -> Any:
        if isinstance(value, dict):  # fail fast on the first bad value (see FAIL_FAST)
            for bias in value.values():
                if not isinstance(bias, int | float) or isinstance(bias, bool):
                    _BIAS.validate_python(bias)  # raises: a number is the only bias
        return value

    @field_validator("stop")
    @classmethod
    def _valid_stop(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are supported")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    def check_supported(self) -> None:
        """Refuse OpenAI parameters this server accepts only at their no-op values."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream=true", param="stream_options")

    def logit_bias_pairs(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; keys must be token ids of the vocabulary."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}",
                                     param="logit_bias") from None
            if not 0 <= token_id < vocab_size:
                raise InvalidRequest(f"logit_bias token id {token_id} is outside the vocabulary "
                                     f"[0, {vocab_size})", param="logit_bias")
            pairs.append((token_id, bias))
        return tuple(sorted(pairs))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    """``POST /v1/completions`` (OpenAI's legacy completions)."""

    TOKEN_ID_FIELDS: ClassVar[tuple[str, ...]] = ("prompt", "stop_token_ids")
    # Left to right, not pydantic's "smart" union, which also tries a list of ids as list[str] and
    # builds an error per id (0.5 s holding the GIL for 2M ids): ids first, then the other forms.
    prompt: (str | Annotated[list[StrictInt], FAIL_FAST] | Annotated[list[str], FAIL_FAST]
             | Annotated[list[Annotated[list[StrictInt], FAIL_FAST]], FAIL_FAST]) = Field(
        union_mode="left_to_right")
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _bad_id_named(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """A list of ids with one bad item is refused naming that item, not with the union's first
        error ("should be a valid string", for a list of integers)."""
        try:
            return handler(value)
        except ValidationError:
            bad = _first_non_id(value)
            if bad is None:
                raise
            kind = _JSON_KINDS.get(type(value[bad]), type(value[bad]).__name__)
            raise ValueError(f"a prompt of token ids holds only integers; item {bad} is {kind}") from None

    @field_validator("prompt")
    @classmethod
    def _valid_text(cls, value: Any) -> Any:
        # Each form of the union is one type throughout, so the first item tells texts from ids
        # (a Python loop over two million ids took 60 ms of the event loop).
        texts = [value] if isinstance(value, str) else value if value and isinstance(value[0], str) else []
        for text in texts:
            check_unicode(text)
        return value

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequest(f"best_of ({self.best_of}) must be >= n ({self.n})", param="best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise InvalidRequest("best_of > n cannot be streamed (the best choices are known only at "
                                 "the end)", param="best_of")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix", code="unsupported_parameter")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request: a string or token ids. Batched prompts are refused."""
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequest("only one prompt per request is supported", param="prompt",
                                     code="unsupported_parameter")
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        return prompt


_JSON_KINDS = {type(None): "null", bool: "a boolean", str: "a string", float: "a number", list: "an array",
               dict: "an object"}


SCAN_SLICE = 8192  # list items looked at per C call when scanning a long list (well under a ms)


def first_not_of_types(items: list[Any], kinds: set[type], start: int = 0) -> int | None:
    """Index of the first item from ``start`` whose type is not in ``kinds``, else None: one short C
    call per slice finds the slice (between them the GIL may pass to the event loop)."""
    for lo in range(start, len(items), SCAN_SLICE):
        chunk = items[lo:lo + SCAN_SLICE]
        if not set(map(type, chunk)) <= kinds:
            return lo + next(i for i, x in enumerate(chunk) if type(x) not in kinds)
    return None


def _first_non_id(value: Any) -> int | None:
    """Index of the first item that is not an id in a list that starts with an integer, else None."""
    if not isinstance(value, list) or not value or type(value[0]) is not int:
        return None
    return first_not_of_types(value, {int})


class ChatMessage(BaseModel):
    """One chat message. Content may be a string or OpenAI's list of text parts."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[dict[str, Any]], FAIL_FAST] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _valid_text(cls, value: Any) -> Any:
        for part in [value] if isinstance(value, str) else value or ():
            text = part if isinstance(part, str) else part.get("text")
            if isinstance(text, str):
                check_unicode(text)
        return value

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest("only text content parts are supported", param="messages",
                                     code="unsupported_parameter")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], FAIL_FAST] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: Annotated[list[dict[str, Any]], FAIL_FAST] | None = None
    tool_choice: Any = None
    functions: Annotated[list[dict[str, Any]], FAIL_FAST] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @field_validator("metadata", mode="before")
    @classmethod
    def _few_metadata_pairs(cls, value: Any) -> Any:
        if isinstance(value, dict) and len(value) > MAX_METADATA_PAIRS:  # before its values are checked
            raise ValueError(f"at most {MAX_METADATA_PAIRS} metadata key-value pairs are allowed")
        return value

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise InvalidRequest(f"{name} (function calling) is not supported", param=name,
                                     code="unsupported_parameter")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise InvalidRequest(f"{name} is not supported", param=name, code="unsupported_parameter")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(BaseModel):
    """vLLM's ``POST /tokenize`` for a completion prompt."""

    model_config = STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """vLLM's ``POST /tokenize`` for a conversation (rendered with the chat template)."""

    model_config = STRICT
    model: str | None = None
    messages: Annotated[list[ChatMessage], FAIL_FAST] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``."""

    model_config = STRICT
    TOKEN_ID_FIELDS: ClassVar[tuple[str, ...]] = ("tokens",)  # as on the generation requests
    model: str | None = None
    tokens: Annotated[list[int], FAIL_FAST]
