"""Several choices of one request (``n``, ``best_of``), as vLLM v1 runs them.

A request with n > 1 becomes n engine requests of the same prompt (child ids ``<id>-<i>``); they
share the prompt's KV through the engine's prefix cache, not through anything here. A seeded
request gives choice i the seed ``seed + i``, so each choice is reproducible on its own and the
choices differ from one another. Streams of the children are merged as their outputs arrive;
every chunk names its choice's ``index``.

``best_of`` > n (completions only, never streamed, as OpenAI) generates best_of choices and
returns the n with the highest mean log-probability per generated token (OpenAI's "highest log
probability per token"); ties keep the lower index. The usage counts every generated token,
returned or not, as OpenAI bills them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

from confkv_engine.core.async_engine import AsyncEngine, RequestStream
from confkv_engine.core.outputs import RequestOutput
from confkv_engine.core.sampling_params import SamplingParams


def child_params(params: SamplingParams, count: int) -> list[SamplingParams]:
    """One SamplingParams per choice: choice i of a seeded request uses seed + i."""
    if count == 1 or params.seed is None:
        return [params] * count
    return [dataclasses.replace(params, seed=params.seed + i) for i in range(count)]


def child_id(request_id: str, index: int, count: int) -> str:
    return request_id if count == 1 else f"{request_id}-{index}"


async def submit(engine: AsyncEngine, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, count: int) -> list[RequestStream]:
    """Submit ``count`` choices; if one is refused (queue full...), the others are aborted."""
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(child_params(params, count)):
            streams.append(await engine.add_request(child_id(request_id, i, count), prompt_ids, p))
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    return streams


async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) of all streams as they come; closing the iterator aborts the rest."""
    pending: dict[asyncio.Future[RequestOutput], int] = {}
    try:
        for i, stream in enumerate(streams):
            pending[asyncio.ensure_future(anext(stream))] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=pending.__getitem__):  # same-step outputs in index order
                i = pending.pop(fut)
                try:
                    out = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for fut in pending:
            fut.cancel()
        for stream in streams:
            await stream.aclose()


def mean_logprob(out: RequestOutput) -> float:
    """Mean log-probability per generated token (-inf for an empty completion)."""
    if not out.logprobs:
        return float("-inf")
    return sum(lp.logprob for lp in out.logprobs) / len(out.logprobs)


def best(outs: Sequence[RequestOutput], n: int) -> list[int]:
    """Indices of the n best outputs by mean logprob, best first (stable on ties)."""
    order = sorted(range(len(outs)), key=lambda i: -mean_logprob(outs[i]))
    return order[:n]
