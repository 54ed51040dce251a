"""Disk read-back through LLMEngine on the embedded SmolLM2-135M (fp32), after a restart on the
cache directory a first engine filled: a request whose prefix is on disk waits, holding no block,
while the disk store's reader thread reads it (made slow here by a gate in front of the real store's
``get``), and a running request keeps producing one token every step meanwhile; then the request is
admitted with the whole hit and answers as a cold cache does. A corrupt record is counted and the
chain stops before it; a read that fails outright admits the request without a hit. Every answer
equals the cold one."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from confkv_api.config import ConfKVConfig
from confkv_engine.cache.disk.files import record_path
from confkv_engine.cache.prefix import chain_keys
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.outputs import RequestOutput
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.core.sequence import SeqStatus
from confkv_engine.model.loader import LoadedModel, load_model

torch.set_num_threads(1)

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
STEPS_WHILE_READING = 6
DISK_TEXT = ("The cache manager keeps hot prefixes in memory and spills cold ones to the local NVMe "
             "drive; after a restart it rebuilds its index from the record files and serves hits from "
             "disk. Question: what happens to a block whose checksum does not match?")
RUNNING_TEXT = "Write a short poem about a lighthouse keeper who counts the ships at night."


@dataclass(frozen=True)
class FilledDisk:
    directory: Path
    disk_prompt: list[int]
    running_prompt: list[int]
    cold: RequestOutput  # the disk prompt's answer from a cold cache
    running_alone: RequestOutput


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("builtin:smollm2-135m", dtype=torch.float32, device="cpu")


def make_engine(loaded: LoadedModel, cache_dir: Path) -> LLMEngine:
    cfg = ConfKVConfig.model_validate({
        "engine": {"cacheDir": str(cache_dir), "blockSize": BS, "prefillChunk": 64,
                   "maxNumBatchedTokens": 128},
        "confkv": {"maxCacheSize": "64Mi"}})
    return LLMEngine(loaded, cfg)


@pytest.fixture(scope="module")
def filled(loaded: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> FilledDisk:
    directory = tmp_path_factory.mktemp("filled") / "nvme"
    disk_prompt = loaded.tokenizer.encode(DISK_TEXT)
    running_prompt = loaded.tokenizer.encode(RUNNING_TEXT)
    assert len(disk_prompt) > 3 * BS
    eng = make_engine(loaded, directory)
    try:
        cold = eng.generate([disk_prompt], GREEDY)[0]
        eng.generate([disk_prompt], GREEDY)  # used twice: the disk admits its blocks
        running_alone = eng.generate([running_prompt], LONG)[0]
    finally:
        eng.close()  # a clean shutdown offers every cached block to the disk store
    return FilledDisk(directory, disk_prompt, running_prompt, cold, running_alone)


@pytest.fixture
def engine(loaded: LoadedModel, filled: FilledDisk, tmp_path: Path) -> Iterator[LLMEngine]:
    """A restarted engine on a copy of the filled directory (each test may damage its own)."""
    shutil.copytree(filled.directory, tmp_path / "nvme")
    eng = make_engine(loaded, tmp_path / "nvme")
    try:
        yield eng
    finally:
        eng.close()


def gate_reads(eng: LLMEngine, before: Callable[[], None]) -> None:
    """Run ``before`` (on the reader thread) ahead of every read of the engine's disk store."""
    real_get = eng.disk.store.get

    def get(key: bytes, **kw: bool):
        before()
        return real_get(key, **kw)

    eng.disk.store.get = get  # type: ignore[method-assign]


def drain(eng: LLMEngine) -> dict[str, RequestOutput]:
    final = {}
    while eng.has_unfinished():
        final.update((o.request_id, o) for o in eng.step() if o.finished)
    return final


def hit_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BS  # never the last prompt token


def test_a_disk_hit_is_read_while_a_running_request_keeps_stepping(engine: LLMEngine,
                                                                   filled: FilledDisk) -> None:
    gate = threading.Event()
    gate_reads(engine, lambda: gate.wait(120))
    engine.add_request("run", filled.running_prompt, LONG)
    running = engine._seqs["run"]
    while not running.output_token_ids:
        engine.step()
    engine.add_request("disk", filled.disk_prompt, GREEDY)
    waiting = engine._seqs["disk"]
    before = len(running.output_token_ids)
    for _ in range(STEPS_WHILE_READING):
        engine.step()
    # One token every step for the running request while the read is held at the gate.
    assert len(running.output_token_ids) == before + STEPS_WHILE_READING
    assert waiting.status is SeqStatus.WAITING and waiting.disk_load is not None
    assert not waiting.disk_load.done.is_set() and engine.cache.held_blocks(waiting.kv) == 0
    assert engine.stats().disk_loaded == 0
    gate.set()
    final = drain(engine)
    assert final["disk"].num_cached_tokens == BS * hit_blocks(filled.disk_prompt)  # all from disk
    assert final["disk"].output_token_ids == filled.cold.output_token_ids
    assert final["run"].output_token_ids == filled.running_alone.output_token_ids
    assert engine.stats().disk_loaded == hit_blocks(filled.disk_prompt)


def test_a_corrupt_record_is_counted_and_the_chain_stops_before_it(engine: LLMEngine,
                                                                   filled: FilledDisk) -> None:
    second = chain_keys(filled.disk_prompt, BS, engine.cache.prefix.salt)[1]
    path = record_path(engine.disk.store.blocks_dir, second)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # inside the payload: the header still parses, the checksum does not match
    path.write_bytes(bytes(data))
    out = engine.generate([filled.disk_prompt], GREEDY)[0]
    assert out.num_cached_tokens == BS  # the first block came back, the corrupt one was recomputed
    assert out.output_token_ids == filled.cold.output_token_ids
    assert engine.disk.store.stats().corrupt_reads == 1 and engine.stats().disk_loaded == 1


def test_a_failing_read_admits_the_request_without_a_hit(engine: LLMEngine, filled: FilledDisk) -> None:
    def fail() -> None:
        raise OSError("the disk went away")

    gate_reads(engine, fail)
    out = engine.generate([filled.disk_prompt], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.output_token_ids == filled.cold.output_token_ids
    assert engine.stats().disk_loaded == 0
