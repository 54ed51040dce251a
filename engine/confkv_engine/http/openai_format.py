"""Pure builders of OpenAI response bodies from engine outputs (no I/O, no framework)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from confkv_engine.core.outputs import RequestOutput, TokenLogprob

TokenText = Callable[[int], str]


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


def usage(outs: RequestOutput | Sequence[RequestOutput]) -> dict[str, Any]:
    """OpenAI usage plus the CONF-KV fields: peak pool bytes and tokens per retention tier.

    With several choices (``n``, ``best_of``) the prompt is counted once, completion tokens and the
    KV fields are summed over the choices, and ``prompt_tokens_details.cached_tokens`` is the
    first choice's (the prompt is the same for all). ``effective_kv_budget`` (the largest over the
    choices; null without a budget) is what the budget allowed as a fraction of the full cache: above
    the requested ``kv_budget`` when the floor of sinks + the minimal recent window binds.
    """
    outs = [outs] if isinstance(outs, RequestOutput) else list(outs)
    prompt = len(outs[0].prompt_token_ids)
    completion = sum(len(o.output_token_ids) for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": outs[0].num_cached_tokens},
        "peak_kv_bytes": sum(o.kv_usage.peak_kv_bytes for o in outs),
        "kv_tokens_full": sum(o.kv_usage.tokens_full for o in outs),
        "kv_tokens_key_only": sum(o.kv_usage.tokens_key_only for o in outs),
        "kv_tokens_discarded": sum(o.kv_usage.tokens_discarded for o in outs),
        **{f"kv_tokens_{t}": sum(getattr(o.kv_usage, f"tokens_{t}") for o in outs)
           for t in ("int8", "int4", "k4v2", "int2")},
        "effective_kv_budget": _effective_budget(outs),
    }


def _effective_budget(outs: list[RequestOutput]) -> float | None:
    budgets = [o.kv_usage.effective_kv_budget for o in outs if o.kv_usage.effective_kv_budget is not None]
    return max(budgets) if budgets else None


def finish_reason(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    return "length" if out.finish_reason == "length" else "stop"


@dataclass
class LegacyLogprobs:
    """Accumulates OpenAI legacy ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset).

    ``text_offset`` counts characters from the start of the returned ``text`` (which includes the
    prompt when ``echo`` is set).
    """

    token_text: TokenText
    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> None:
        for i, token_id in enumerate(token_ids):
            entry = entries[i] if i < len(entries) else None
            text = self.token_text(token_id)
            self.tokens.append(text)
            self.text_offset.append(self.offset)
            self.offset += len(text)
            if entry is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(entry.logprob)
            top = {self.token_text(t): lp for t, lp in entry.top}
            top.setdefault(text, entry.logprob)  # OpenAI always lists the chosen token
            self.top_logprobs.append(top)

    def body(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}

    def take(self) -> dict[str, Any]:
        """The entries added since the last take (for a streaming chunk)."""
        body = self.body()
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return body


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprob], token_text: TokenText,
                  top_n: int) -> dict[str, Any]:
    """Chat-format ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = token_text(token_id)
        top = [{"token": token_text(t), "logprob": lp, "bytes": list(token_text(t).encode())}
               for t, lp in entry.top[:top_n]]
        content.append({"token": text, "logprob": entry.logprob, "bytes": list(text.encode()),
                        "top_logprobs": top})
    return {"content": content}


def completion_choice(index: int, text: str, out: RequestOutput,
                      logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(out)}


def completion_body(request_id: str, model: str, choices: list[dict[str, Any]],
                    outs: Sequence[RequestOutput]) -> dict[str, Any]:
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": choices, "usage": usage(outs),
    }


def completion_chunk(request_id: str, model: str, text: str, logprobs: dict[str, Any] | None,
                     reason: str | None, index: int = 0) -> dict[str, Any]:
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}],
    }


def chat_choice(index: int, out: RequestOutput, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": out.text},
            "logprobs": logprobs, "finish_reason": finish_reason(out)}


def chat_body(request_id: str, model: str, choices: list[dict[str, Any]],
              outs: Sequence[RequestOutput]) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": choices, "usage": usage(outs),
    }


def chat_chunk(request_id: str, model: str, delta: dict[str, Any], logprobs: dict[str, Any] | None,
               reason: str | None, index: int = 0) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}],
    }


def usage_chunk(request_id: str, model: str, obj: str, outs: Sequence[RequestOutput]) -> dict[str, Any]:
    """The final chunk of ``stream_options.include_usage``: no choices, only usage."""
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model,
            "choices": [], "usage": usage(outs)}
