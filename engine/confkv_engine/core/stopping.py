"""Text side of generation: incremental detokenization, stop strings, finish reasons.

Per request, the engine keeps one ``OutputTracker`` and feeds it each sampled token; it returns
the text that is safe to stream now and, once the request is done, the finish reason.

- Byte-level BPE can split one character over several tokens, so the detokenizer only emits text
  once the decoded window no longer ends in U+FFFD (the vLLM / HF TextStreamer prefix-offset scheme).
- A stop string may arrive over several tokens, so while streaming the tracker holds back the
  longest tail of the text that is a prefix of some stop string: a partial stop string is never
  emitted. The stop string itself is never part of the output (OpenAI semantics), nor is the text
  of an EOS / stop token id.
- As in vLLM, no stop condition (EOS, stop ids, stop strings) applies before ``min_tokens``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from confkv_engine.core.outputs import FinishReason
from confkv_engine.core.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# Tokens of context decoded before the new ones: enough for SentencePiece's leading-space rule.
_CONTEXT_TOKENS = 5


def find_stop(text: str, stops: Sequence[str], new_chars: int | None = None) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string in ``text`` -> (index, stop string), or None.

    With ``new_chars`` only matches that end inside the last ``new_chars`` characters are looked
    for (older text was checked before), so per-token cost does not grow with the text.
    """
    if not stops:
        return None
    longest = max(len(s) for s in stops)
    start = 0 if new_chars is None else max(0, len(text) - new_chars - longest + 1)
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        at = text.find(stop, start)
        if at != -1 and (best is None or at < best[0] or (at == best[0] and len(stop) > len(best[1]))):
            best = (at, stop)
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string
    (at most longest stop - 1 characters): the part to hold back while streaming."""
    if not stops or not text:
        return 0
    longest = max(len(s) for s in stops)
    for k in range(min(len(text), longest - 1), 0, -1):
        tail = text[-k:]
        if any(len(s) > k and s.startswith(tail) for s in stops):
            return k
    return 0


class StopChecker:
    """Token-level finish rules for one request: EOS, stop_token_ids, max_tokens."""

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int]) -> None:
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_ids = frozenset(params.stop_token_ids)

    def is_stop_token(self, token_id: int, num_generated: int) -> bool:
        """True if this token (the ``num_generated``-th output token) ends the request as 'stop'."""
        if num_generated < self.params.min_tokens:
            return False
        return token_id in self.stop_ids or token_id in self.eos

    def check_token(self, token_id: int, num_generated: int) -> FinishReason | None:
        if self.is_stop_token(token_id, num_generated):
            return "stop"
        if num_generated >= self.params.max_tokens:
            return "length"
        return None

    def stop_strings_active(self, num_generated: int) -> bool:
        return bool(self.params.stop) and num_generated >= self.params.min_tokens


def _decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` with skip_special_tokens when the tokenizer supports that keyword."""
    decode = tokenizer.decode
    try:
        accepts = "skip_special_tokens" in inspect.signature(decode).parameters
    except (TypeError, ValueError):  # builtins without a signature
        accepts = False
    if accepts:
        return lambda ids: decode(ids, skip_special_tokens=skip_special_tokens)
    return decode


class IncrementalDetokenizer:
    """Decodes a growing token list to text without ever emitting a broken character.

    ``prompt_token_ids`` (optional) seeds the decoding window with the prompt's last tokens so
    tokenizers that drop a leading space at the start of a decode get spacing right.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # window start: context decoded only to measure the new text
        self.read_offset = len(self.ids)  # tokens before this have been emitted
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text (maybe empty)."""
        self.ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Emit whatever is pending, even an incomplete character (the request has ended)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) and not final:
            return ""
        if full.endswith(_REPLACEMENT) and not final:
            return ""  # the last token ends mid-character; wait for the rest of its bytes
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


@dataclass(frozen=True)
class StepText:
    """Result of feeding one token: text to send now, and the finish state."""

    delta: str
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended the request


class OutputTracker:
    """Per-request output text: detokenizer + stop strings + hold-back + finish reason.

    ``text`` is the full output so far (stop string cut off once matched); ``emitted`` is how much
    of it has been handed out via ``StepText.delta``.
    """

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams,
        eos_token_ids: Iterable[int],
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.params = params
        self.checker = StopChecker(params, eos_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.num_generated = 0
        self.text = ""
        self.emitted = 0
        self.finish_reason: FinishReason | None = None

    def append(self, token_id: int) -> StepText:
        """Feed the next generated token (must not be called after the request finished)."""
        if self.finish_reason is not None:
            raise RuntimeError("OutputTracker.append after the request finished")
        self.num_generated += 1
        n = self.num_generated
        stop_token = self.checker.is_stop_token(token_id, n)
        if stop_token:
            new = self.detok.flush()  # pending bytes of earlier tokens; the stop token adds no text
        else:
            new = self.detok.add(token_id)
            if n >= self.params.max_tokens:
                new += self.detok.flush()
        self.text += new
        if new and self.checker.stop_strings_active(n):
            hit = find_stop(self.text, self.params.stop, new_chars=len(new))
            if hit is not None:
                self.text = self.text[:hit[0]]
                return self._finish("stop", hit[1])
        if stop_token:
            return self._finish("stop", token_id)
        if n >= self.params.max_tokens:
            return self._finish("length", None)
        hold = partial_stop_len(self.text, self.params.stop) if self.params.stop else 0
        return StepText(self._take(len(self.text) - hold))

    def finish(self, reason: FinishReason) -> StepText:
        """End the request from outside (abort, error, engine decided): flush everything."""
        if self.finish_reason is not None:
            return StepText("", self.finish_reason)
        self.text += self.detok.flush()
        return self._finish(reason, None)

    def _finish(self, reason: FinishReason, stop_reason: str | int | None) -> StepText:
        self.finish_reason = reason
        return StepText(self._take(len(self.text)), reason, stop_reason)

    def _take(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta
