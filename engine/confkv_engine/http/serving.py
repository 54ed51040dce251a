"""The two generation endpoints: request -> prompt ids + SamplingParams -> engine -> OpenAI body.

The FastAPI routes in ``server.py`` only parse and dispatch; everything that knows the OpenAI
formats and the engine's contract lives here.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from confkv_engine.core.async_engine import AsyncEngine
from confkv_engine.core.outputs import RequestOutput
from confkv_engine.core.sampling_params import InvalidRequest, SamplingParams
from confkv_engine.http import openai_format as fmt
from confkv_engine.http.protocol import ChatCompletionRequest, CompletionRequest, _Request, error_body


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def id_to_token(self, token_id: int) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str: ...


class GenerationFailed(Exception):
    """The engine finished a request with an error (reported as a 500)."""


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 vocab_size: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def token_text(self, token_id: int) -> str:
        """A token's own text (special tokens included) for logprob entries."""
        return self.tokenizer.id_to_token(token_id)

    # ---- shared ----------------------------------------------------------------------------
    def _check_length(self, prompt_len: int, max_tokens: int, param: str = "prompt") -> None:
        if prompt_len + max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for "
                f"the completion). Please reduce the length of the prompt or the completion.",
                param=param, code="context_length_exceeded")

    def _params(self, req: _Request, max_tokens: int, logprobs: int | None,
                prompt_logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
            max_tokens=max_tokens, min_tokens=req.min_tokens, stop=tuple(req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids), ignore_eos=req.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, kv_policy=req.kv_policy, kv_budget=req.kv_budget)

    async def _collect(self, outputs: AsyncIterator[RequestOutput], http: Request) -> RequestOutput:
        """Run a request to the end; a client that hangs up aborts it (its blocks are freed)."""
        final: RequestOutput | None = None
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                final = out
                if not out.finished and await http.is_disconnected():
                    break
        if final is None or not final.finished:
            raise GenerationFailed("request aborted")
        if final.finish_reason == "error":
            raise GenerationFailed(final.error or "generation failed")
        return final

    # ---- /v1/completions -------------------------------------------------------------------
    def _completion_prompt(self, req: CompletionRequest) -> tuple[list[int], str]:
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                     param="prompt")
            # Text only for echo, and only of a prompt that can fit (decoding holds the GIL).
            ids = list(prompt)
            text = self.tokenizer.decode(ids) if len(ids) <= self.max_model_len else ""
        if not ids:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        return ids, text

    async def completions(self, req: CompletionRequest, http: Request) -> Any:
        req.check_supported()
        # Tokenizing (and the chat template below) runs on a worker thread: a megabyte prompt takes
        # seconds, and the event loop must keep answering /health meanwhile.
        ids, prompt_text = await run_in_threadpool(self._completion_prompt, req)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        if max_tokens == 0 and not req.echo:
            raise InvalidRequest("max_tokens must be >= 1 unless echo is set", param="max_tokens")
        self._check_length(len(ids), max_tokens)
        prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
        params = self._params(req, max_tokens, req.logprobs, prompt_lp)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        outputs = await self.engine.add_request(request_id, ids, params)
        if req.stream:
            body = self._stream_completion(request_id, req, ids, prompt_text, outputs)
            return StreamingResponse(body, media_type="text/event-stream")
        final = await self._collect(outputs, http)
        text = (prompt_text if req.echo else "") + final.text
        logprobs = None
        if req.logprobs is not None:
            acc = fmt.LegacyLogprobs(self.token_text)
            if req.echo:
                acc.add(ids, final.prompt_logprobs or [])
            acc.add(final.output_token_ids, final.logprobs)
            logprobs = acc.body()
        return JSONResponse(fmt.completion_body(request_id, self.model_name, text, final, logprobs))

    async def _stream_completion(self, request_id: str, req: CompletionRequest, ids: list[int],
                                 prompt_text: str,
                                 outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        acc = fmt.LegacyLogprobs(self.token_text) if req.logprobs is not None else None
        echo_pending, prompt_lp_pending = req.echo, req.echo and acc is not None
        seen_lp, final = 0, None
        try:
            async for out in outputs:
                final = out
                if out.finish_reason == "error":
                    yield fmt.sse(error_body(out.error or "generation failed", "server_error"))
                    break
                text = out.new_text
                if echo_pending:
                    text, echo_pending = prompt_text + text, False
                if acc is not None:
                    if prompt_lp_pending and out.prompt_logprobs is not None:
                        acc.add(ids, out.prompt_logprobs)
                        prompt_lp_pending = False
                    acc.add(out.new_token_ids, out.logprobs[seen_lp:seen_lp + len(out.new_token_ids)])
                    seen_lp += len(out.new_token_ids)
                if not text and not out.new_token_ids and not out.finished:
                    continue
                lp = acc.take() if acc is not None else None
                yield fmt.sse(fmt.completion_chunk(request_id, self.model_name, text, lp,
                                                   fmt.finish_reason(out)))
        except Exception as err:  # engine gone mid-stream: tell the client in-band
            yield fmt.sse(error_body(str(err), "server_error"))
        if final is not None and final.finished and req.include_usage:
            yield fmt.sse(fmt.usage_chunk(request_id, self.model_name, "text_completion", final))
        yield fmt.SSE_DONE

    # ---- /v1/chat/completions --------------------------------------------------------------
    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as err:  # the template refused the conversation (e.g. roles out of order)
            raise InvalidRequest(str(err), param="messages") from None
        return self.tokenizer.encode(prompt)

    async def chat(self, req: ChatCompletionRequest, http: Request) -> Any:
        req.check_supported()
        ids = await run_in_threadpool(self._chat_prompt, req)
        requested = req.requested_max_tokens
        if requested == 0:
            raise InvalidRequest("max_tokens must be >= 1", param="max_tokens")
        if requested is None:
            if len(ids) >= self.max_model_len:
                self._check_length(len(ids), 1, "messages")
            max_tokens = self.max_model_len - len(ids)
        else:
            max_tokens = requested
            self._check_length(len(ids), max_tokens, "messages")
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        params = self._params(req, max_tokens, top_n, None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = await self.engine.add_request(request_id, ids, params)
        if req.stream:
            body = self._stream_chat(request_id, req, outputs)
            return StreamingResponse(body, media_type="text/event-stream")
        final = await self._collect(outputs, http)
        logprobs = None
        if top_n is not None:
            logprobs = fmt.chat_logprobs(final.output_token_ids, final.logprobs, self.token_text, top_n)
        return JSONResponse(fmt.chat_body(request_id, self.model_name, final, logprobs))

    async def _stream_chat(self, request_id: str, req: ChatCompletionRequest,
                           outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        yield fmt.sse(fmt.chat_chunk(request_id, self.model_name, {"role": "assistant", "content": ""},
                                     None, None))
        seen_lp, final = 0, None
        try:
            async for out in outputs:
                final = out
                if out.finish_reason == "error":
                    yield fmt.sse(error_body(out.error or "generation failed", "server_error"))
                    break
                if out.new_text or out.new_token_ids:
                    lp = None
                    if top_n is not None:
                        new = out.logprobs[seen_lp:seen_lp + len(out.new_token_ids)]
                        lp = fmt.chat_logprobs(out.new_token_ids, new, self.token_text, top_n)
                        seen_lp += len(out.new_token_ids)
                    delta = {"content": out.new_text} if out.new_text else {}
                    if delta or lp:
                        yield fmt.sse(fmt.chat_chunk(request_id, self.model_name, delta, lp, None))
                if out.finished:
                    reason = fmt.finish_reason(out)
                    yield fmt.sse(fmt.chat_chunk(request_id, self.model_name, {}, None, reason))
        except Exception as err:
            yield fmt.sse(error_body(str(err), "server_error"))
        if final is not None and final.finished and req.include_usage:
            yield fmt.sse(fmt.usage_chunk(request_id, self.model_name, "chat.completion.chunk", final))
        yield fmt.SSE_DONE
