"""Hostile values at the edges that are not HTTP: the config contract (bounds, sizes that overflow,
empty API keys), the command line (exit 2), the live policy's patch parser (strict types, nesting,
NaN, overlong integers), the pool sizing on a machine too small for the request, and a per-request
retention policy that brings its own budget."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from confkv_api.config import DEFAULT_MAX_REQUEST_BYTES, ConfigError, ConfKVSection, load_config
from confkv_api.units import MAX_SIZE_BYTES, parse_size
from confkv_engine.cache import layout
from confkv_engine.cache.kv_cache import CacheSpec, KVCache
from confkv_engine.cache.layout import CPU_AVAILABLE_CAP
from confkv_engine.cache.memory import device_figures
from confkv_engine.cache.planner import plan_memory
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


@pytest.mark.parametrize(("argv", "needle"), [(["--api-key", ""], "api_key"),
                                               (["--max-cache-size", OVERFLOWING], "max_cache_size")])
def test_the_command_line_exits_2_before_anything_loads(argv: list[str], needle: str, tmp_path: Path) -> None:
    # A model that cannot load: if the flag were accepted, the server would exit 1, not 2 (and never
    # serve from inside the test process).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "confkv_engine.cli", "serve", "--model",
                          str(tmp_path / "none.gguf"), "--port", str(port), "--grpc-socket",
                          str(tmp_path / "c.sock"), *argv],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert needle in out.stderr


def test_a_cache_larger_than_the_machine_is_capped_and_the_plan_says_so() -> None:
    figures = device_figures("cpu", 0)  # this machine's RAM, read now
    plan = plan_memory(parse_size("100Ti"), figures, 0, 0)
    assert 0 < plan.pool_bytes <= CPU_AVAILABLE_CAP * psutil.virtual_memory().total
    assert plan.capped_by and "capped" in "\n".join(plan.lines())
    small = plan_memory(("bytes", 12345.0), figures, 0, 0)
    assert small.pool_bytes == 12345 and small.capped_by is None  # fits: as given


def test_in_a_container_the_cap_is_of_what_its_memory_cgroup_allows(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "memory.max").write_text(f"{2 * 2**30}\n")
    (tmp_path / "memory.current").write_text(f"{2**30}\n")
    monkeypatch.setattr(layout, "_CGROUP_MEMORY_FILES",
                        ((str(tmp_path / "memory.max"), str(tmp_path / "memory.current")),))
    assert device_figures("cpu", 0).free_bytes <= CPU_AVAILABLE_CAP * 2**30
    assert layout._cgroup_headroom() == 2**30
    (tmp_path / "memory.max").write_text("max\n")  # an unlimited cgroup leaves the RAM cap alone
    assert layout._cgroup_headroom() is None


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
