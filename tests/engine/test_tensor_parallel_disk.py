"""The disk store under tensor parallel = 2 on CPU (gloo, a tiny random Llama, fp32): each rank
spills its own shard into its own directory (``tp2-rank0``, ``tp2-rank1``: the same blocks, each
record half a TP = 1 block's bytes), and after a restart of both ranks on that directory a
request's prefix comes back from disk on both ranks (agreed read-back) and answers as the cold
cache did.

The ranks are real processes (``torch.multiprocessing`` spawn) in one gloo process group, started
twice: once to fill the disk (a prompt used twice, then a clean shutdown offers its blocks), once to
read it back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from confkv_api.config import ConfKVConfig
from confkv_engine.cache.disk.files import scan_blocks
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model.loader import load_model
from testkit.ranks import spawn_ranks

pytest.importorskip("transformers")

BS = 16
PROMPT = [(i * 37 + 11) % 250 for i in range(70)]  # four full blocks and a partial one
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _config(cache_dir: str) -> ConfKVConfig:
    return ConfKVConfig.model_validate({
        "engine": {"cacheDir": cache_dir, "prefillChunk": 32, "maxNumBatchedTokens": 256, "blockSize": BS},
        "confkv": {"maxCacheSize": "8Mi", "compression": {"enabled": False}}})


def _rank_main(rank: int, world: int, port: int, model_dir: str, cache_dir: str, out: str,
               phase: str) -> None:
    from confkv_engine.parallel.group import destroy_group, init_group
    from confkv_engine.parallel.launch import build_rank

    torch.set_num_threads(1)
    loaded = load_model(model_dir, dtype=torch.float32, device="cpu")
    group = init_group(rank, world, port, "cpu", timeout_s=60)
    engine = build_rank(loaded, _config(cache_dir), group, leader=rank == 0)
    result: dict = {}
    if rank == 0:
        runs = 2 if phase == "fill" else 1  # used twice: the disk store admits the blocks
        outs = [engine.generate([PROMPT], GREEDY)[0] for _ in range(runs)]
        result.update(tokens=outs[0].output_token_ids, cached=outs[0].num_cached_tokens)
        engine.close()
    else:
        engine.serve_forever()  # type: ignore[union-attr]  # closes the engine when rank 0 stops
    assert engine.disk is not None
    result.update(loaded=engine.disk.stats.loaded, spilled=engine.disk.stats.spilled)
    torch.save(result, Path(out) / f"{phase}-rank{rank}.pt")
    destroy_group()


def _run_ranks(model_dir: Path, cache_dir: Path, out: Path, phase: str) -> list[dict]:
    spawn_ranks(_rank_main, 2, str(model_dir), str(cache_dir), str(out), phase)
    return [torch.load(out / f"{phase}-rank{r}.pt", weights_only=False) for r in range(2)]


def test_tensor_parallel_disk_store_keeps_a_shard_per_rank_and_reads_it_back(tmp_path: Path) -> None:
    from tests.engine.tiny_models import make_tiny_hf_model, tiny_config

    model_dir = make_tiny_hf_model("llama", tmp_path)[1]
    cache_dir = tmp_path / "nvme"
    fill = _run_ranks(model_dir, cache_dir, tmp_path, "fill")
    assert fill[0]["spilled"] == fill[1]["spilled"] > 0
    scans = {r: scan_blocks(cache_dir / f"tp2-rank{r}" / "blocks", verify_payloads=True) for r in range(2)}
    assert sorted(p.name for p in cache_dir.iterdir()) == ["tp2-rank0", "tp2-rank1"]  # nothing shared
    keys = [{h.key for h in scans[r].headers} for r in range(2)]
    assert keys[0] == keys[1] and len(keys[0]) == fill[0]["spilled"]
    cfg = tiny_config("llama")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    whole_block = 2 * cfg.num_hidden_layers * BS * cfg.num_key_value_heads * head_dim * 4  # K and V, fp32
    assert {h.payload_len for r in range(2) for h in scans[r].headers} == {whole_block // 2}

    read = _run_ranks(model_dir, cache_dir, tmp_path, "read")  # a restart: memory is empty
    assert read[0]["cached"] == len(PROMPT) // BS * BS and fill[0]["cached"] == 0
    assert read[0]["loaded"] == read[1]["loaded"] == len(PROMPT) // BS  # both ranks read their shard
    assert read[0]["tokens"] == fill[0]["tokens"]  # the disk's blocks answer as the cold cache did
