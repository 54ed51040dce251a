"""AsyncEngine's threading contract, against a small scripted engine (no model).

The fake engine gives each request one token per step and records which thread called it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from confkv_engine.core.async_engine import (
    AsyncEngine,
    EngineUnavailable,
    QueueFull,
    configure_torch_threads,
    default_threads,
    usable_cores,
)
from confkv_engine.core.outputs import RequestOutput
from confkv_engine.core.sampling_params import InvalidRequest, SamplingParams

pytestmark = pytest.mark.timeout(60)


@dataclass
class _Stats:
    num_running: int = 0
    num_waiting: int = 0


class ScriptedEngine:
    def __init__(self, max_waiting: int = 8, stall_after: int | None = None) -> None:
        self.max_waiting = max_waiting
        # A request stops getting tokens after `stall_after` of them and stays in the engine: a test
        # that needs a request still there later must not race the engine thread finishing it.
        self.stall_after = stall_after
        self.seqs: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.aborted: list[str] = []
        self.threads: set[str] = set()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.threads.add(threading.current_thread().name)
        if not prompt_token_ids:
            raise InvalidRequest("empty prompt", param="prompt")
        if len(self.seqs) >= self.max_waiting:
            raise QueueFull("full")
        self.seqs[request_id] = (prompt_token_ids, params, [])

    def abort_request(self, request_id: str) -> None:
        if self.seqs.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.current_thread().name)
        outs = []
        for rid, (prompt, params, output) in list(self.seqs.items()):
            if self.stall_after is not None and len(output) >= self.stall_after:
                continue
            output.append(len(output))
            done = len(output) >= params.max_tokens
            outs.append(RequestOutput(request_id=rid, prompt_token_ids=prompt, output_token_ids=list(output),
                                      new_token_ids=[output[-1]], text="x" * len(output), new_text="x",
                                      finished=done, finish_reason="length" if done else None))
            if done:
                del self.seqs[rid]
        if not outs:
            time.sleep(0.001)  # a step takes time; an idle spin would starve the event loop's thread
        return outs

    def stats(self) -> _Stats:
        return _Stats(num_running=len(self.seqs))


async def _drain(engine: AsyncEngine, rid: str, max_tokens: int) -> list[RequestOutput]:
    return [out async for out in engine.generate(rid, [1, 2], SamplingParams(max_tokens=max_tokens))]


def test_outputs_stream_from_the_engine_thread() -> None:
    fake = ScriptedEngine()
    engine = AsyncEngine(fake)
    engine.start()

    async def main() -> list[list[RequestOutput]]:
        results = await asyncio.gather(_drain(engine, "a", 3), _drain(engine, "b", 5))
        await engine.drain_and_stop(timeout=10)
        return results

    a, b = asyncio.run(main())
    assert [len(o.output_token_ids) for o in a] == [1, 2, 3] and a[-1].finished
    assert [o.new_token_ids for o in b] == [[0], [1], [2], [3], [4]]
    assert fake.threads == {"confkv-engine"}  # the engine is only ever touched by its own thread
    assert not engine.alive


def test_errors_at_submission_reach_the_caller() -> None:
    fake = ScriptedEngine(max_waiting=1, stall_after=0)
    engine = AsyncEngine(fake)
    engine.start()

    async def main() -> None:
        first = await engine.add_request("a", [1], SamplingParams(max_tokens=4))  # stays waiting
        with pytest.raises(InvalidRequest):
            await engine.add_request("empty", [], SamplingParams())
        with pytest.raises(QueueFull):
            await engine.add_request("b", [1], SamplingParams())
        engine.begin_drain()
        with pytest.raises(EngineUnavailable):
            await engine.add_request("late", [1], SamplingParams())
        await first.aclose()
        await engine.drain_and_stop(timeout=10)

    asyncio.run(main())
    assert fake.aborted == ["a"]


def test_abandoned_consumer_aborts_the_request() -> None:
    fake = ScriptedEngine(stall_after=1)
    engine = AsyncEngine(fake)
    engine.start()

    async def main() -> None:
        outputs = await engine.add_request("long", [1], SamplingParams(max_tokens=8))
        async for _ in outputs:
            break
        await outputs.aclose()  # what a client disconnect does to the response iterator
        while fake.has_unfinished() or "long" not in fake.aborted:
            await asyncio.sleep(0.01)
        assert engine.num_in_flight() == 0
        await engine.drain_and_stop(timeout=10)

    asyncio.run(main())
    assert fake.aborted == ["long"]


def test_thread_defaults_leave_a_core_to_the_event_loop_from_four_cores() -> None:
    assert [default_threads(c) for c in (1, 2, 3, 4, 16)] == [1, 2, 3, 3, 15]
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))


def test_configure_threads_sets_intra_op_and_refuses_zero(monkeypatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("CONFKV_THREADS", "1")
        assert configure_torch_threads(None) == 1 and torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="threads must be >= 1"):
            configure_torch_threads(0)
    finally:
        torch.set_num_threads(before)
