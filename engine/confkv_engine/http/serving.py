"""The two generation endpoints: request -> prompt ids + SamplingParams -> engine -> OpenAI body.

The FastAPI routes in ``app.py`` only parse and dispatch; everything that knows the OpenAI
formats and the engine's contract lives here. Several choices (``n``, ``best_of``) are run as
child requests (``choices``); a ``response_format`` schema is compiled before the request is
submitted, so a schema the grammar library cannot use is a 400, not a failed generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from confkv_engine.core import structured_output
from confkv_engine.core.async_engine import AsyncEngine, RequestStream
from confkv_engine.core.outputs import RequestOutput
from confkv_engine.core.sampling_params import InvalidRequest, SamplingParams, StructuredOutput
from confkv_engine.http import choices
from confkv_engine.http import openai_format as fmt
from confkv_engine.http.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    _Request,
    error_body,
)


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def encode_within(self, text: str, limit: int) -> tuple[int, list[int] | None]: ...
    def fewest_tokens(self, text: str) -> int: ...
    def decode(self, ids: list[int]) -> str: ...
    def id_to_token(self, token_id: int) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str: ...


ChunkRenderer = Callable[[int, RequestOutput], list[dict[str, Any]]]  # (choice, output) -> chunks


class GenerationFailed(Exception):
    """The engine finished a request with an error (reported as a 500)."""


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 vocab_size: int, aliases: Sequence[str] = (), default_max_tokens: int | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        # Every name clients may send (vLLM's --served-model-name list); responses use the first.
        self.served_names: tuple[str, ...] = tuple(dict.fromkeys([model_name, *aliases]))
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # A chat request without max_tokens: the rest of the context, capped by engine.maxTokensDefault.
        self.default_max_tokens = default_max_tokens

    def token_text(self, token_id: int) -> str:
        """A token's own text (special tokens included) for logprob entries."""
        return self.tokenizer.id_to_token(token_id)

    # ---- shared ----------------------------------------------------------------------------
    def _check_length(self, prompt_len: int, max_tokens: int, param: str = "prompt") -> None:
        if prompt_len + max_tokens > self.max_model_len:
            raise self._too_long(prompt_len, max_tokens, param)

    def _too_long(self, prompt_len: int, max_tokens: int, param: str) -> InvalidRequest:
        return InvalidRequest(
            f"This model's maximum context length is {self.max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for "
            f"the completion). Please reduce the length of the prompt or the completion.",
            param=param, code="context_length_exceeded")

    def _encode_within(self, text: str, max_tokens: int, param: str) -> list[int]:
        """The ids of a prompt that leaves room for ``max_tokens``; one that cannot is refused first
        from its length alone (``Tokenizer.fewest_tokens``), else from its exact token count before
        its id list is built, so no per-token Python work is spent on it."""
        room = self.max_model_len - max_tokens
        fewest = self.tokenizer.fewest_tokens(text)
        if room >= 0 and fewest > room:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt of {len(text)} characters is at least {fewest} tokens long (no token of this "
                f"vocabulary stands for more characters than its longest), and {max_tokens} more are "
                f"requested for the completion. Please reduce the length of the prompt or the "
                f"completion.", param=param, code="context_length_exceeded")
        count, ids = self.tokenizer.encode_within(text, max(room, 0))
        if ids is None:
            raise self._too_long(count, max_tokens, param)
        return ids

    def _params(self, req: _Request, max_tokens: int, logprobs: int | None,
                prompt_logprobs: int | None, structured: StructuredOutput | None) -> SamplingParams:
        return SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
            max_tokens=max_tokens, min_tokens=req.min_tokens, stop=tuple(req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids), ignore_eos=req.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, kv_policy=req.kv_policy, kv_budget=req.kv_budget,
            kv_tiers=tuple(req.kv_tiers) if req.kv_tiers is not None else None,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, min_p=req.min_p,
            logit_bias=req.logit_bias_pairs(self.vocab_size), structured=structured)

    async def _structured(self, req: _Request) -> StructuredOutput | None:
        """The request's grammar, compiled once here (off the event loop: the first one also builds
        the library's view of the vocabulary) so an unusable schema is a 400 naming the problem."""
        spec = structured_output.spec_from_response_format(req.response_format)
        if spec is not None:
            eos = tuple(getattr(self.tokenizer, "eos_token_ids", ()) or ())
            await asyncio.to_thread(structured_output.check, spec, self.tokenizer, self.vocab_size, eos)
        return spec

    async def _collect(self, streams: Sequence[RequestStream], http: Request) -> list[RequestOutput]:
        """Run every choice to the end; a client that hangs up aborts them (their blocks are freed)."""
        finals: list[RequestOutput | None] = [None] * len(streams)
        outputs = choices.merged(streams)
        async with contextlib.aclosing(outputs):
            async for i, out in outputs:
                finals[i] = out
                if not out.finished and await http.is_disconnected():
                    break
        for final in finals:
            if final is None or not final.finished:
                raise GenerationFailed("request aborted")
            if final.finish_reason == "error":
                raise GenerationFailed(final.error or "generation failed")
        return finals  # type: ignore[return-value]

    # ---- /v1/completions -------------------------------------------------------------------
    def _completion_prompt(self, req: CompletionRequest, max_tokens: int) -> tuple[list[int], str]:
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            ids, text = self._encode_within(prompt, max_tokens, "prompt"), prompt
        else:
            self._check_length(len(prompt), max_tokens)  # before any per-token work
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
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        if max_tokens == 0 and not req.echo:
            raise InvalidRequest("max_tokens must be >= 1 unless echo is set", param="max_tokens")
        ids, prompt_text = await run_in_threadpool(self._completion_prompt, req, max_tokens)
        count = max(req.n, req.best_of or 1)
        # best_of ranks choices by their logprobs: ask for them even when the client did not.
        logprobs = req.logprobs if count == req.n or req.logprobs is not None else 0
        prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
        params = self._params(req, max_tokens, logprobs, prompt_lp, await self._structured(req))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await choices.submit(self.engine, request_id, ids, params, count)
        if req.stream:
            render = self._completion_renderer(request_id, req, ids, prompt_text, count)
            body = self._stream(request_id, req, streams, "text_completion", render)
            return StreamingResponse(body, media_type="text/event-stream")
        finals = await self._collect(streams, http)
        kept = choices.best(finals, req.n) if count > req.n else list(range(count))
        body = [self._completion_choice(index, req, ids, prompt_text, finals[i])
                for index, i in enumerate(kept)]
        return JSONResponse(fmt.completion_body(request_id, self.model_name, body, finals))

    def _completion_choice(self, index: int, req: CompletionRequest, ids: list[int], prompt_text: str,
                           final: RequestOutput) -> dict[str, Any]:
        text = (prompt_text if req.echo else "") + final.text
        logprobs = None
        if req.logprobs is not None:
            acc = fmt.LegacyLogprobs(self.token_text)
            if req.echo:
                acc.add(ids, final.prompt_logprobs or [])
            acc.add(final.output_token_ids, final.logprobs)
            logprobs = acc.body()
        return fmt.completion_choice(index, text, final, logprobs)

    async def _stream(self, request_id: str, req: _Request, streams: Sequence[RequestStream], obj: str,
                      render: ChunkRenderer, head: Sequence[dict[str, Any]] = ()) -> AsyncIterator[str]:
        """SSE body of a streamed request: ``head`` chunks, then ``render``'s chunks for every output
        of every choice as it arrives, the usage chunk if asked for, and [DONE]."""
        finals: list[RequestOutput | None] = [None] * len(streams)
        for chunk in head:
            yield fmt.sse(chunk)
        try:
            async with contextlib.aclosing(choices.merged(streams)) as outputs:
                async for i, out in outputs:
                    finals[i] = out
                    if out.finish_reason == "error":
                        yield fmt.sse(error_body(out.error or "generation failed", "server_error"))
                        break
                    for chunk in render(i, out):
                        yield fmt.sse(chunk)
        except Exception as err:  # engine gone mid-stream: tell the client in-band
            yield fmt.sse(error_body(str(err), "server_error"))
        if all(f is not None and f.finished for f in finals) and req.include_usage:
            yield fmt.sse(fmt.usage_chunk(request_id, self.model_name, obj, finals))  # type: ignore[arg-type]
        yield fmt.SSE_DONE

    def _completion_renderer(self, request_id: str, req: CompletionRequest, ids: list[int],
                             prompt_text: str, n: int) -> ChunkRenderer:
        """Per-choice chunk builder: echo first, then new text with its legacy logprobs."""
        accs = [fmt.LegacyLogprobs(self.token_text) if req.logprobs is not None else None for _ in range(n)]
        echo_pending = [req.echo] * n
        prompt_lp_pending = [req.echo and req.logprobs is not None] * n
        seen_lp = [0] * n

        def render(i: int, out: RequestOutput) -> list[dict[str, Any]]:
            text = out.new_text
            if echo_pending[i]:
                text, echo_pending[i] = prompt_text + text, False
            acc = accs[i]
            if acc is not None:
                if prompt_lp_pending[i] and out.prompt_logprobs is not None:
                    acc.add(ids, out.prompt_logprobs)
                    prompt_lp_pending[i] = False
                acc.add(out.new_token_ids, out.logprobs[seen_lp[i]:seen_lp[i] + len(out.new_token_ids)])
                seen_lp[i] += len(out.new_token_ids)
            if not text and not out.new_token_ids and not out.finished:
                return []
            lp = acc.take() if acc is not None else None
            reason = fmt.finish_reason(out)
            return [fmt.completion_chunk(request_id, self.model_name, text, lp, reason, index=i)]
        return render

    # ---- /v1/chat/completions --------------------------------------------------------------
    def chat_prompt(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the model's chat template."""
        rendered = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt)
        except ValueError as err:  # the template refused the conversation (e.g. roles out of order)
            raise InvalidRequest(str(err), param="messages") from None

    def _chat_prompt(self, req: ChatCompletionRequest, max_tokens: int) -> list[int]:
        return self._encode_within(self.chat_prompt(req.messages), max_tokens, "messages")

    def _chat_default(self, prompt_len: int) -> int:
        rest = self.max_model_len - prompt_len
        return rest if self.default_max_tokens is None else min(rest, self.default_max_tokens)

    async def chat(self, req: ChatCompletionRequest, http: Request) -> Any:
        req.check_supported()
        requested = req.requested_max_tokens
        if requested == 0:
            raise InvalidRequest("max_tokens must be >= 1", param="max_tokens")
        # Without max_tokens the completion may fill the context, but needs room for one token.
        ids = await run_in_threadpool(self._chat_prompt, req, 1 if requested is None else requested)
        max_tokens = self._chat_default(len(ids)) if requested is None else requested
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        params = self._params(req, max_tokens, top_n, None, await self._structured(req))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await choices.submit(self.engine, request_id, ids, params, req.n)
        if req.stream:
            role = {"role": "assistant", "content": ""}
            head = [fmt.chat_chunk(request_id, self.model_name, role, None, None, index=i)
                    for i in range(req.n)]
            body = self._stream(request_id, req, streams, "chat.completion.chunk",
                                self._chat_renderer(request_id, top_n, req.n), head)
            return StreamingResponse(body, media_type="text/event-stream")
        finals = await self._collect(streams, http)
        body = []
        for i, final in enumerate(finals):
            logprobs = None
            if top_n is not None:
                logprobs = fmt.chat_logprobs(final.output_token_ids, final.logprobs, self.token_text, top_n)
            body.append(fmt.chat_choice(i, final, logprobs))
        return JSONResponse(fmt.chat_body(request_id, self.model_name, body, finals))

    def _chat_renderer(self, request_id: str, top_n: int | None, n: int) -> ChunkRenderer:
        """Per-choice chunk builder: content deltas with their logprobs, then the finish chunk."""
        seen_lp = [0] * n

        def render(i: int, out: RequestOutput) -> list[dict[str, Any]]:
            chunks = []
            lp = None
            if top_n is not None and out.new_token_ids:
                new = out.logprobs[seen_lp[i]:seen_lp[i] + len(out.new_token_ids)]
                lp = fmt.chat_logprobs(out.new_token_ids, new, self.token_text, top_n)
                seen_lp[i] += len(out.new_token_ids)
            delta = {"content": out.new_text} if out.new_text else {}
            if delta or lp:
                chunks.append(fmt.chat_chunk(request_id, self.model_name, delta, lp, None, index=i))
            if out.finished:
                chunks.append(fmt.chat_chunk(request_id, self.model_name, {}, None, fmt.finish_reason(out),
                                             index=i))
            return chunks
        return render
