"""Hostile values at the edges that are not HTTP: the config contract (bounds, sizes that overflow,
empty API keys), the command line (exit 2), the live policy's patch parser (strict types, nesting,
NaN, overlong integers), the pool sizing on a machine too small for the request, and a per-request
retention policy that brings its own budget."""

from __future__ import annotations

import logging

import psutil
import pytest
import torch

from confkv_api.config import (
    DEFAULT_MAX_REQUEST_BYTES,
    MAX_SIZE_BYTES,
    ConfigError,
    ConfKVSection,
    load_config,
    parse_size,
)
from confkv_engine.cache.kv_cache import CPU_AVAILABLE_CAP, CacheSpec, KVCache, resolve_cache_bytes
from confkv_engine.cli import main
from confkv_engine.control.policy import MAX_PATCH_DEPTH, PolicyInvalid, PolicyStore, parse_patch
from confkv_engine.retention.manager import RetentionManager
from confkv_engine.retention.policies import RetentionConfig

OVERFLOWING = "1" + "0" * 400  # a float overflows to infinity on this many digits


@pytest.mark.parametrize("size", [OVERFLOWING, OVERFLOWING + "Ti", "1025Ti", f"{MAX_SIZE_BYTES + 1}",
                                  "1e400%", "nan%", float("inf"), float("nan"), 2**60])
def test_sizes_that_overflow_or_exceed_a_petabyte_are_refused(size: object) -> None:
    with pytest.raises(ValueError):
        parse_size(size)  # type: ignore[arg-type]


def test_the_largest_sizes_allowed_still_parse() -> None:
    assert parse_size("1024Ti") == ("bytes", float(MAX_SIZE_BYTES))
    assert parse_size("100Ti") == ("bytes", 100.0 * 2**40)


@pytest.mark.parametrize(("section", "key", "value"), [
    ("confkv", "window", 10**30), ("confkv", "budgetTokens", 10**12),
    ("engine", "maxNumBatchedTokens", 2**40), ("engine", "prefillChunk", 2**40),
    ("engine", "maxWaiting", 10**9), ("engine", "maxRequestBytes", 2**31),
    ("engine", "maxRequestBytes", 10), ("confkv", "maxCacheSize", OVERFLOWING),
])
def test_every_numeric_field_has_an_upper_bound(section: str, key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{section}.{key}"):
        load_config({section: {key: value}})


def test_compression_cold_after_is_bounded() -> None:
    with pytest.raises(ConfigError, match="coldAfterSeconds"):
        load_config({"confkv": {"compression": {"coldAfterSeconds": 1e30}}})


def test_request_body_limit_defaults_to_4_mib() -> None:
    assert load_config({}).engine.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 4 * 2**20
    assert load_config({"engine": {"maxRequestBytes": 2048}}).engine.max_request_bytes == 2048


@pytest.mark.parametrize("key", ["", " ", " key", "key\n"])
def test_an_empty_or_padded_api_key_is_a_config_error(key: str) -> None:
    with pytest.raises(ConfigError, match="apiKey"):
        load_config({"engine": {"apiKey": key}})


@pytest.mark.parametrize("argv", [["--api-key", ""], ["--max-cache-size", OVERFLOWING]])
def test_the_command_line_exits_2_before_anything_loads(argv: list[str],
                                                        capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert "api_key" in err or "max_cache_size" in err, err


def test_a_cache_larger_than_the_machine_is_capped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="confkv.cache"):
        got = resolve_cache_bytes(parse_size("100Ti"), torch.device("cpu"))
    assert 0 < got <= CPU_AVAILABLE_CAP * psutil.virtual_memory().total
    assert got < 100 * 2**40
    assert "capped" in caplog.text
    caplog.clear()
    assert resolve_cache_bytes(("bytes", 12345.0), torch.device("cpu")) == 12345  # fits: as given
    assert "capped" not in caplog.text


@pytest.mark.parametrize("policy", ["h2o", "streaming"])
def test_a_request_brings_the_budget_its_policy_needs(policy: str) -> None:
    cache = KVCache(CacheSpec(2, 2, 16, 16, torch.float32, torch.device("cpu")), 64)
    manager = RetentionManager(cache, 4, RetentionConfig(), prefill_chunk=32)  # started without a budget
    cfg = manager.config_for(policy, 0.5)
    assert (cfg.policy, cfg.budget, cfg.budget_tokens) == (policy, 0.5, None)
    with pytest.raises(ValueError, match="needs a budget"):
        manager.config_for(policy, None)
    assert manager.config_for() is manager.defaults


def _store() -> PolicyStore:
    return PolicyStore(ConfKVSection(), 8, live_fields=["confkv", "engine.maxBatchSize"])


@pytest.mark.parametrize(("patch", "needle"), [
    ({"eviction": {"k": True}}, "confkv.eviction.k"),
    ({"confidenceThresholds": {"high": "0.95"}}, "confkv.confidenceThresholds.high"),
    ({"window": 10**30}, "confkv.window"),
    ({"sinks": 4.0}, "confkv.sinks"),
    ({"maxCacheSize": OVERFLOWING}, "confkv.maxCacheSize"),
])
def test_policy_patches_are_strict_and_bounded(patch: dict, needle: str) -> None:
    store = _store()
    with pytest.raises(PolicyInvalid, match=needle):
        store.update(patch)
    assert store.current.version == 1


def test_strict_patches_still_take_what_json_means() -> None:
    change = _store().update({"budget": 1, "eviction": {"k": 3}, "confidenceThresholds": {"high": 0.95}})
    assert change.snapshot.confkv.budget == 1.0 and change.snapshot.confkv.eviction.k == 3


@pytest.mark.parametrize("text", [
    '{"a":' * 2000 + "1" + "}" * 2000,  # past the JSON parser's recursion limit
    '{"eviction":' * (MAX_PATCH_DEPTH + 1) + "1" + "}" * (MAX_PATCH_DEPTH + 1),
    '{"sinks": NaN}', '{"budget": Infinity}', '{"sinks": ' + "9" * 5000 + "}", "[1]", "{",
])
def test_patch_texts_that_are_not_a_policy_are_invalid(text: str) -> None:
    with pytest.raises(PolicyInvalid):
        parse_patch(text)


def test_a_blank_patch_is_no_patch() -> None:
    assert parse_patch("  ") is None
    assert parse_patch('{"window": 64}') == {"window": 64}
