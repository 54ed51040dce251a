"""vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``: the token ids this server would
feed the model, and the tokenizer facts a client needs to tokenize remotely (lm-eval's ``remote``
tokenizer backend reads exactly these three).

A completion prompt is tokenized as ``/v1/completions`` tokenizes it; a conversation is rendered
with the chat template first, as ``/v1/chat/completions`` does. ``add_special_tokens`` adds BOS
only for models whose tokenizer asks for it (SmolLM2's does not). ``token_strs`` are the
vocabulary's own token strings (byte-level BPE shows a leading space as 'Ġ', as vLLM returns them).
``/detokenize`` keeps special tokens, like vLLM.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from confkv_engine.core.sampling_params import InvalidRequest
from confkv_engine.http.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from confkv_engine.http.serving import OpenAIServing


def _encode(serving: OpenAIServing, text: str, add_special_tokens: bool) -> list[int]:
    tok: Any = serving.tokenizer
    if add_special_tokens and getattr(tok, "add_bos_token", False):
        return tok.encode(text, add_bos=True)
    return tok.encode(text)


def _token_str(serving: OpenAIServing, token_id: int) -> str:
    backend = getattr(serving.tokenizer, "backend", None)
    raw = backend.id_to_token(token_id) if backend is not None else None
    return raw if raw is not None else serving.token_text(token_id)


def tokenize_request(body: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body as vLLM's chat form when it has ``messages``, else the completion form (so a bad
    field is reported under its own name, not under both forms of a union)."""
    form = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    try:
        return form.model_validate(body)
    except ValidationError as err:
        raise RequestValidationError(err.errors()) from None


def tokenize(serving: OpenAIServing, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    if isinstance(req, TokenizeChatRequest):
        text = serving.chat_prompt(req.messages, req.add_generation_prompt)
    else:
        text = req.prompt
    ids = _encode(serving, text, req.add_special_tokens)
    return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids,
            "token_strs": [_token_str(serving, t) for t in ids] if req.return_token_strs else None}


def detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> dict[str, Any]:
    bad = [t for t in req.tokens if not 0 <= t < serving.vocab_size]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {serving.vocab_size})",
                             param="tokens")
    tok: Any = serving.tokenizer
    try:
        text = tok.decode(req.tokens, skip_special_tokens=False)
    except TypeError:  # a tokenizer without the keyword
        text = tok.decode(req.tokens)
    return {"prompt": text}


def tokenizer_info(serving: OpenAIServing) -> dict[str, Any]:
    """vLLM's ``GET /tokenizer_info``: special tokens, chat template and context length."""
    tok: Any = serving.tokenizer
    return {"tokenizer_class": type(tok).__name__, "eos_token": getattr(tok, "eos_token", None),
            "bos_token": getattr(tok, "bos_token", None), "pad_token": None,
            "chat_template": getattr(tok, "chat_template", None), "model_max_length": serving.max_model_len,
            "add_bos_token": bool(getattr(tok, "add_bos_token", False))}
