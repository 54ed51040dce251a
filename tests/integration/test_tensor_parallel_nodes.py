"""A tensor-parallel group across two "nodes" on localhost over gloo: two ``confkv serve`` processes
started as a LeaderWorkerSet starts them (``--nnodes 2 --node-rank R --master-addr A --master-port
P``), one rank each; node 0 serves HTTP, node 1 serves nothing and follows. The greedy completion
over real HTTP (the openai client) equals one process serving the same tiny random Llama (4 query
heads, 2 KV heads, fp32) alone; stopping the leader stops node 1 cleanly, and a node whose leader
is gone leaves with an error instead of waiting forever."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.engine_server import EngineServer, _confkv_command, free_port, running_server

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

NAME = "tiny-llama"
FLAGS = ("--served-name", NAME, "--max-cache-size", "16Mi")
# The group's collective timeout (parallel.group.DEFAULT_TIMEOUT_SECONDS) plus start-up slack.
EXIT_DEADLINE_S = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engine.tiny_models import make_tiny_hf_model

    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("tp-nodes"))[1]


def _complete(url: str) -> tuple[str, list[str]]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    out = client.completions.create(model=NAME, prompt="Tensor parallel across nodes", max_tokens=16,
                                    temperature=0, logprobs=1)
    return out.choices[0].text, list(out.choices[0].logprobs.tokens)


def _node(model_dir: Path, log: Path, port: int, rank: int, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [*_confkv_command(), "serve", "--model", str(model_dir), *FLAGS, "--tensor-parallel", "2",
           "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
           "--master-port", str(port), *extra]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "CONFKV_THREADS": "1", "OMP_NUM_THREADS": "1"})


def test_tensor_parallel_two_nodes_equal_one_process(model_dir: Path, tmp_path: Path) -> None:
    with running_server(tmp_path, "--model", str(model_dir), *FLAGS) as one:
        want = _complete(one.url)
    rendezvous = free_port()
    worker_log = tmp_path / "node1.log"
    worker = _node(model_dir, worker_log, rendezvous, 1)
    leader = EngineServer(tmp_path, "--model", str(model_dir), *FLAGS, "--tensor-parallel", "2",
                          "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                          "--master-port", str(rendezvous))
    try:
        leader.wait_ready()
        assert _complete(leader.url) == want  # greedy, token for token
        samples = leader.metrics()
        used = [samples[f'confkv_tp_rank_kv_used_bytes{{rank="{r}"}}'] for r in "01"]
        assert used[0] == used[1] > 0  # node 1's rank reported its half of the pool over the group
        assert leader.stop() == 0
        assert worker.wait(timeout=EXIT_DEADLINE_S) == 0, worker_log.read_text()[-3000:]
        assert "joined the group of 2" in worker_log.read_text()
    finally:
        leader.stop()
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_node_without_its_leader_exits_with_an_error(model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "orphan.log"
    orphan = _node(model_dir, log, free_port(), 1, "--join-timeout", "20")  # nobody at the rendezvous
    try:
        code = orphan.wait(timeout=EXIT_DEADLINE_S + 60)  # TimeoutExpired (a hang) fails the test
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
    assert code != 0
    assert "node 1 could not join the group" in log.read_text()

