"""Structured output (``response_format`` json_object / json_schema) through llguidance.

Library choice, measured on this project's CPU (one thread) with SmolLM2's 49,152-token vocabulary
and a schema of nested objects, enums and arrays (``bench/micro/grammar_mask_cost.py``, mean / p99 per
token): xgrammar 2.4 / 10 us, llguidance 49 / 509 us (its first masks build the lexer lazily),
outlines-core 71 / 307 us (plus a 233 ms whole-vocabulary index per schema). The engine's own part
(unpacking the bitmask and masking the logits row) costs about 60 us whatever the library, so the
whole per-token cost is ~110 us with llguidance against ~65 us with xgrammar, next to a decode step
of 53 ms at batch 1 and 132 ms at batch 16 (0.2% and, all 16 constrained, 1.3% vs 0.8%).
llguidance is kept: it has no dependencies (xgrammar requires torch, transformers and the triton GPU
compiler as hard dependencies, a heavy addition to a CPU serving image), its compile errors name
the unsupported schema feature (they become the 400's message), and it reads the tokenizer straight
from the ``tokenizers`` JSON the GGUF vocabulary is rebuilt into, so byte-level tokens map to bytes
exactly as the model's decoder does.

JSON is generated compact (no whitespace between tokens, vLLM's ``disable_any_whitespace``): a small
model given free whitespace can loop on newlines until max_tokens and never close the object.

Per sequence the engine keeps one ``GrammarState``; at every sampling step its mask (allowed ids,
EOS once the document is complete) is applied to the logits used to choose the token, and the
chosen token is fed back. Logprobs stay the raw model's. A request cut by ``max_tokens`` ends
with an incomplete document and finish_reason 'length', as with vLLM and OpenAI.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np
import torch
from torch import Tensor

from confkv_engine.cache.staging import send_pinned
from confkv_engine.core.sampling_params import InvalidRequest, StructuredOutput

_COMPILE_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
_BITS = 32  # the bitmask packs 32 token ids per int32 word
_lock = threading.Lock()
_tokenizers: dict[tuple[int, int, tuple[int, ...]], tuple[Any, llguidance.LLTokenizer]] = {}


def _invalid(message: str) -> InvalidRequest:
    return InvalidRequest(message, param="response_format", code="invalid_response_format")


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of a request (raises InvalidRequest for a schema that is not JSON)."""
    schema = spec.schema if spec.kind == "json_schema" else '{"type": "object"}'
    if schema is None:
        raise _invalid("response_format json_schema needs a schema")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPILE_OPTIONS)
    except ValueError as err:
        raise _invalid(f"invalid JSON schema: {err}") from None


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the engine tokenizer (built once per tokenizer: about a second)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise _invalid("structured output needs a model with a tokenizers-backed tokenizer")
    key = (id(backend), vocab_size, tuple(eos_token_ids))
    with _lock:
        cached = _tokenizers.get(key)
        if cached is None or cached[0] is not backend:
            eos = list(eos_token_ids) or None
            try:
                built = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
            except ValueError as err:  # a tokenizer layout llguidance cannot read
                raise _invalid(f"structured output cannot use this model's tokenizer: {err}") from None
            cached = (backend, built)
            _tokenizers[key] = cached
        return cached[1]


def check(spec: StructuredOutput, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
    """Compile the request's grammar once up front; InvalidRequest naming the problem if it fails."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar_text(spec), ll_tokenizer(tokenizer, vocab_size, eos_token_ids))
    if is_error:
        raise _invalid(f"the response_format schema cannot be used: {messages[0] if messages else 'error'}")


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, spec: StructuredOutput, tokenizer: Any, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab_size, eos_token_ids),
                                            grammar_text(spec), log_level=0)
        if self.matcher.is_error():
            raise _invalid(f"the response_format schema cannot be used: {self.matcher.get_error()}")

    def fill_bitmask(self, words: Tensor) -> None:
        """Write the allowed-token bitmask into ``words`` (a contiguous int32 CPU row)."""
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def accept(self, token_id: int) -> bool:
        """Advance by the chosen token; False if the grammar rejected it (it then allows nothing)."""
        return self.matcher.consume_token(token_id)

    @property
    def failed(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


def apply_grammar_masks(logits: Tensor, states: Sequence[GrammarState | None]) -> Tensor:
    """Set to -inf every token a row's grammar forbids (rows with None are untouched). In place.

    A row whose grammar has failed (never expected: the mask forbids what it would reject) is left
    unconstrained rather than all -inf, so sampling stays defined.
    """
    rows = [i for i, st in enumerate(states) if st is not None and st.failed is None]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    words = torch.zeros(len(rows), (vocab + _BITS - 1) // _BITS, dtype=torch.int32)
    for r, i in enumerate(rows):
        states[i].fill_bitmask(words[r])  # type: ignore[union-attr]
    # Bit j of little-endian word w is token 32w + j: unpacking the bytes least-significant bit
    # first yields the tokens in order (numpy's unpackbits is several times faster than shifts).
    bits = np.unpackbits(words.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    forbidden = send_pinned(torch.from_numpy(bits == 0), logits.device)
    idx = send_pinned(rows, logits.device)
    logits[idx] = logits[idx].masked_fill(forbidden, float("-inf"))
    return logits


def spec_from_response_format(response_format: dict[str, Any] | None) -> StructuredOutput | None:
    """OpenAI's ``response_format`` -> StructuredOutput (None for absent / 'text')."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise _invalid(f"response_format type must be 'text', 'json_object' or 'json_schema', not {kind!r}")
    body = response_format.get("json_schema")
    if not isinstance(body, dict):
        raise _invalid("response_format json_schema needs a 'json_schema' object with a 'schema'")
    schema = body.get("schema")
    if not isinstance(schema, dict):
        raise _invalid("response_format json_schema.schema must be a JSON Schema object")
    return StructuredOutput("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))
