"""Several choices of one request: the seed rule, best_of's ranking, merged streams."""

from __future__ import annotations

import asyncio

from confkv_engine.core.outputs import RequestOutput, TokenLogprob
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.http import choices


def test_choice_i_of_a_seeded_request_uses_seed_plus_i() -> None:
    seeds = [p.seed for p in choices.child_params(SamplingParams(seed=40, temperature=0.7), 3)]
    assert seeds == [40, 41, 42]
    assert [p.seed for p in choices.child_params(SamplingParams(), 2)] == [None, None]
    assert [choices.child_id("r", i, 2) for i in range(2)] == ["r-0", "r-1"]
    assert choices.child_id("r", 0, 1) == "r"


def _out(*logprobs: float) -> RequestOutput:
    return RequestOutput("r", [1], output_token_ids=[5] * len(logprobs), finished=True,
                         logprobs=[TokenLogprob(5, lp) for lp in logprobs])


def test_best_of_ranks_by_mean_logprob_per_token() -> None:
    outs = [_out(-1.0, -1.0), _out(-0.2, -3.0), _out(-0.5), _out()]  # means -1, -1.6, -0.5, -inf
    assert choices.best(outs, 2) == [2, 0]
    assert choices.best([_out(-1.0), _out(-1.0)], 1) == [0]  # ties keep the lower index


class _FakeStream:
    """An async iterator of outputs with a delay per item (stands in for a RequestStream)."""

    def __init__(self, outs: list[RequestOutput], delay: float) -> None:
        self.outs, self.delay, self.closed = list(outs), delay, False

    def __aiter__(self) -> _FakeStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.outs:
            raise StopAsyncIteration
        await asyncio.sleep(self.delay)
        return self.outs.pop(0)

    async def aclose(self) -> None:
        self.closed = True


def test_merged_interleaves_as_outputs_arrive_and_closes_all() -> None:
    def outs(n: int) -> list[RequestOutput]:
        return [RequestOutput("r", [1], finished=i == n - 1) for i in range(n)]
    slow, fast = _FakeStream(outs(2), 0.05), _FakeStream(outs(3), 0.001)

    async def run() -> list[int]:
        return [i async for i, _ in choices.merged([slow, fast])]
    order = asyncio.run(run())
    assert sorted(order) == [0, 0, 1, 1, 1] and order[:3] == [1, 1, 1]
    assert slow.closed and fast.closed
