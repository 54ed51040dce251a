"""``confkv serve --tensor-parallel N`` on CPU (gloo): the embedded SmolLM2 (9 query heads, 3 KV
heads) over real HTTP with the openai client at degree 3, equal to one rank serving the same fp32
weights; /metrics reports each rank's KV pool; a killed rank ends the server with a clear error
(never a hang); a degree that does not divide the heads is refused with the numbers."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.integration.engine_server import EngineServer, running_server

openai = pytest.importorskip("openai")

POOL = ("--max-cache-size", "64Mi")
PROMPT = "The capital of France is"
# The group's collective timeout (parallel.group.DEFAULT_TIMEOUT_SECONDS) plus start-up slack.
EXIT_DEADLINE_S = 90


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _ranks(server_pid: int) -> list[int]:
    """The spawned rank processes (multiprocessing's spawn children, not its resource tracker)."""
    return [c for c in _children(server_pid)
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _complete(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    out = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=12, temperature=0)
    return out.choices[0].text


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc to find the ranks")
def test_tensor_parallel_3_serves_embedded_model_and_a_killed_rank_ends_it(tmp_path: Path) -> None:
    with running_server(tmp_path, "--weights", "fp32", *POOL) as one:
        want = _complete(one.url)
    srv = EngineServer(tmp_path, "--tensor-parallel", "3", *POOL)
    try:
        srv.wait_ready()
        assert _complete(srv.url) == want  # greedy, token for token
        samples = srv.metrics()
        used = {r: samples[f'confkv_tp_rank_kv_used_bytes{{rank="{r}"}}'] for r in "012"}
        total = {r: samples[f'confkv_tp_rank_kv_capacity_bytes{{rank="{r}"}}'] for r in "012"}
        assert len(set(used.values())) == 1 and used["0"] > 0  # every rank holds its third of each token
        assert len(set(total.values())) == 1
        ranks = _ranks(srv.proc.pid)
        assert len(ranks) == 2
        os.kill(ranks[0], signal.SIGKILL)
        code = srv.proc.wait(timeout=EXIT_DEADLINE_S)  # TimeoutExpired (a hang) fails the test
        assert code != 0
        assert "tensor-parallel group lost" in srv.log_tail()
    finally:
        srv.stop()


def test_tensor_parallel_degree_that_does_not_divide_heads_is_refused(tmp_path: Path) -> None:
    srv = EngineServer(tmp_path, "--tensor-parallel", "2", *POOL)
    try:
        code = srv.proc.wait(timeout=EXIT_DEADLINE_S)
    finally:
        srv.stop()
    assert code != 0
    log = srv.log_tail()
    assert re.search(r"tensorParallel 2 does not divide the model's 9 query heads and 3 KV heads", log), log
