"""The pieces of ``bench.quality.http_quality`` against a real ``confkv serve`` (embedded model, real
socket, the ``openai`` client): a held-out repeating window scored through echo + logprobs under the
precision-tier chain and a budget. No timing is asserted; quality numbers are the benchmark's job."""

from __future__ import annotations

import math

import httpx
import pytest
from engine_server import running_server

from testkit import held_out

pytestmark = pytest.mark.timeout(300)

TEXT = ("The committee met on a grey morning to read the long report aloud, page by page, and every member "
        "wrote down the questions that the authors had left open. ") * 12


def test_echo_perplexity_of_a_repeating_window_under_a_budget(tmp_path) -> None:
    flags = ("--kv-budget", "0.25", "--kv-tiers", "full,int4,int2", "--kv-cache-dtype", "bfloat16",
             "--threads", "1")
    with running_server(tmp_path, *flags) as srv:
        ids = httpx.post(f"{srv.url}/tokenize", json={"prompt": TEXT, "add_special_tokens": False},
                         timeout=60).json()["tokens"]
        window = held_out.repeating_window(ids, size=256, head=128, span=32)
        model = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]["id"]
        res = held_out.echo_perplexity(srv.url, model, [window])
    assert res["tokens_scored"] == 255
    assert 1.0 < res["ppl"] < 1e4 and math.isclose(res["ppl"], res["ppl_per_window"][0])
    # the budget bound the sequence: it reports the fraction it came to (sinks + window floor or 0.25)
    assert res["effective_kv_budget"][0] is not None and res["effective_kv_budget"][0] <= 0.5
    assert res["peak_kv_bytes"] > 0
