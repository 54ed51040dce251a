"""The confkv.json contract: defaults, camelCase keys, unknown keys named, values validated once."""

import json

import pytest

from confkv_api.config import (
    ConfigError,
    ConfKVConfig,
    dump_config,
    load_config,
    load_config_file,
    parse_duration,
    parse_size,
    with_overrides,
)


def test_empty_document_gets_guide_defaults() -> None:
    config = load_config({})
    assert config.engine.max_batch_size == 64
    assert config.confkv.confidence_thresholds.high == 0.9
    assert config.confkv.confidence_thresholds.medium == 0.7
    assert config.confkv.eviction.policy == "LRU-K" and config.confkv.eviction.k == 2
    assert config.alerts.vram.threshold == 0.85 and config.alerts.vram.for_ == "5m"
    assert config.alerts.latency_ms.threshold == 500.0
    assert config.alerts.hit_rate.threshold == 0.70
    assert config.alerts.oom_per_hour.threshold == 3.0


def test_default_tiers_are_the_precision_chain_unless_the_pool_holds_codes() -> None:
    assert load_config({}).confkv.tiers == ["full", "int4", "k4v2", "int2"]
    assert load_config({"confkv": {"tiers": ["full", "key_only"]}}).confkv.tiers == ["full", "key_only"]
    for dtype in ("int8", "fp8"):  # codes cannot be re-encoded: the default chain keeps K or drops
        assert load_config({"confkv": {"kvCacheDtype": dtype}}).confkv.tiers == ["full", "key_only"]
    bf16 = load_config({"confkv": {"kvCacheDtype": "bfloat16"}})
    assert bf16.confkv.tiers == ["full", "int4", "k4v2", "int2"]


def test_keys_are_camel_case_and_round_trip() -> None:
    data = {"engine": {"maxBatchSize": 8, "prefillChunk": 64}, "confkv": {"kvPolicy": "conf-kv"}}
    config = load_config(data)
    assert config.engine.max_batch_size == 8
    dumped = dump_config(config)
    assert dumped["engine"]["maxBatchSize"] == 8
    assert dumped["alerts"]["vram"]["for"] == "5m"
    assert load_config(dumped) == config


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"engine": {"maxBatchSizes": 8}}, "unknown key 'engine.maxBatchSizes'"),
        ({"bogus": 1}, "unknown key 'bogus'"),
        ({"confkv": {"confidenceThresholds": {"high": 0.5, "medium": 0.7}}}, "must be > medium"),
        ({"engine": {"maxBatchSize": 0}}, "engine.maxBatchSize"),
        ({"confkv": {"maxCacheSize": "lots"}}, "invalid size"),
        ({"alerts": {"vram": {"threshold": 0.9, "for": "five minutes"}}}, "invalid duration"),
        ({"confkv": {"budget": 0.5, "budgetTokens": 512}}, "at most one"),
        ({"engine": {"prefillChunk": 4096, "maxNumBatchedTokens": 2048}}, "prefillChunk"),
        ({"confkv": {"kvCacheDtype": "int4"}}, "confkv.kvCacheDtype"),
        ({"confkv": {"kvCacheDtype": "fp8", "tiers": ["full", "int4"]}}, "holds codes already"),
    ],
)
def test_bad_documents_name_the_problem(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        load_config(data)


def test_load_config_file_accepts_a_mounted_directory(tmp_path) -> None:
    (tmp_path / "confkv.json").write_text(json.dumps({"engine": {"port": 9000}}))
    assert load_config_file(tmp_path).engine.port == 9000
    with pytest.raises(ConfigError, match="not found"):
        load_config_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config_file(tmp_path / "bad.json")


def test_overrides_are_validated() -> None:
    config = with_overrides(ConfKVConfig(), "engine", max_batch_size=4, port=None)
    assert config.engine.max_batch_size == 4 and config.engine.port == 8000
    with pytest.raises(ConfigError):
        with_overrides(config, "engine", max_batch_size=-1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80%", ("fraction", 0.8)), ("512Mi", ("bytes", 512 * 2**20)), ("2G", ("bytes", 2e9)),
     (1024, ("bytes", 1024.0)), (0.5, ("fraction", 0.5))],
)
def test_parse_size(text, expected) -> None:
    assert parse_size(text) == expected


def test_parse_duration() -> None:
    assert parse_duration("5m") == 300 and parse_duration("1h") == 3600
    assert parse_duration("500ms") == pytest.approx(0.5)
    with pytest.raises(ValueError):
        parse_duration("5 minutes")


def test_a_prefill_chunk_that_is_not_whole_blocks_is_refused() -> None:
    # 40 tokens with 16-token blocks: chunks end on block boundaries under retention, so such a chunk
    # could never be scheduled; refused with a message instead of a request that waits forever.
    with pytest.raises(ConfigError, match="prefillChunk \\(40\\) must be a multiple of blockSize \\(16\\)"):
        load_config({"engine": {"prefillChunk": 40}})
    assert load_config({"engine": {"prefillChunk": 48}}).engine.prefill_chunk == 48
