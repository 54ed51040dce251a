"""The Gateway API Inference Extension's model-server protocol on a real engine under load: the gauges
its endpoint picker reads (``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info``) with their semantics, and the OpenAI
completions and chat APIs it routes to.

The engine runs one request at a time (``--max-batch-size 1``), so concurrent requests must queue:
while they run, the running gauge is exactly 1, the waiting gauge counts the rest, and the KV usage is
above zero; when they have finished, both counts are 0. The values are compared with the engine's own
``confkv_`` gauges from the same scrape.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from confkv_api import metrics as names
from confkv_engine.http.metrics import (
    PROTOCOL_CACHE_INFO,
    PROTOCOL_KV_USAGE,
    PROTOCOL_KV_USAGE_LEGACY,
    PROTOCOL_RUNNING,
    PROTOCOL_WAITING,
)
from tests.integration.engine_server import EngineServer, running_server, wait_for

pytestmark = pytest.mark.timeout(600)
CONCURRENT = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    log_dir: Path = tmp_path_factory.mktemp("protocol")
    with running_server(log_dir, "--max-batch-size", "1", "--max-model-len", "512") as srv:
        yield srv


def _protocol(server: EngineServer) -> dict[str, float]:
    samples = server.metrics()
    return {key: value for key, value in samples.items()
            if key.split("{")[0] in (PROTOCOL_WAITING, PROTOCOL_RUNNING, PROTOCOL_KV_USAGE,
                                     PROTOCOL_KV_USAGE_LEGACY, names.REQUESTS_WAITING,
                                     names.REQUESTS_RUNNING, names.KV_CACHE_USAGE_RATIO)
            or key.startswith(PROTOCOL_CACHE_INFO)}


def test_gauges_under_load_have_the_protocols_semantics(server: EngineServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300.0)
    model = client.models.list().data[0].id
    idle = _protocol(server)
    assert idle[PROTOCOL_WAITING] == idle[PROTOCOL_RUNNING] == 0.0
    info = next(k for k in idle if k.startswith(PROTOCOL_CACHE_INFO))
    assert 'block_size="16"' in info and "num_gpu_blocks=" in info and idle[info] == 1.0

    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            if i % 2:
                client.chat.completions.create(model=model, max_tokens=48, temperature=0.0, extra_body={
                    "ignore_eos": True}, messages=[{"role": "user", "content": f"Count to fifty, run {i}."}])
            else:
                client.completions.create(model=model, prompt=f"Run {i}: the numbers from one to fifty are",
                                          max_tokens=48, temperature=0.0, extra_body={"ignore_eos": True})
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(CONCURRENT)]
    for thread in threads:
        thread.start()

    def queued() -> dict[str, float] | None:
        sample = _protocol(server)
        return sample if sample[PROTOCOL_WAITING] >= 1 and sample[PROTOCOL_RUNNING] == 1 else None

    busy = wait_for(queued, "a running request with others queued", deadline_s=120.0, log=server.log_tail,
                    errors=(httpx.TransportError,))
    assert busy[PROTOCOL_WAITING] <= CONCURRENT - 1
    assert busy[PROTOCOL_WAITING] == busy[names.REQUESTS_WAITING]
    assert busy[PROTOCOL_RUNNING] == busy[names.REQUESTS_RUNNING] == 1
    assert 0.0 < busy[PROTOCOL_KV_USAGE] <= 1.0
    assert busy[PROTOCOL_KV_USAGE] == busy[PROTOCOL_KV_USAGE_LEGACY] == busy[names.KV_CACHE_USAGE_RATIO]
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    done = wait_for(lambda: (s := _protocol(server))[PROTOCOL_RUNNING] == 0 and s, "idle again",
                    deadline_s=60.0, log=server.log_tail)
    assert done[PROTOCOL_WAITING] == 0.0
