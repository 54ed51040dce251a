"""JSON merge patch (RFC 7396): the examples of the RFC's appendix A, and that the engine's policy
store and the agent's reconciliation use this one implementation (``null`` removes a key in both)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from confkv_api.config import ConfKVSection
from confkv_api.merge import merge_patch

RFC_EXAMPLES: list[tuple[Any, Any, Any]] = [
    ({"a": "b"}, {"a": "c"}, {"a": "c"}),
    ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
    ({"a": "b"}, {"a": None}, {}),
    ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
    ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
    ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
    ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
    ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
    (["a", "b"], ["c", "d"], ["c", "d"]),
    ({"a": "b"}, ["c"], ["c"]),
    ({"a": "foo"}, None, None),
    ({"a": "foo"}, "bar", "bar"),
    ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
    ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
    ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
]


@pytest.mark.parametrize(("target", "patch", "expected"), RFC_EXAMPLES)
def test_rfc7396_examples(target: Any, patch: Any, expected: Any) -> None:
    before = json.dumps(target)
    assert merge_patch(target, patch) == expected
    assert json.dumps(target) == before  # the target is not modified


def test_engine_policy_store_and_agent_share_the_implementation() -> None:
    from confkv_agent import loop
    from confkv_engine.control import policy

    assert policy.merge_patch is merge_patch and loop.merge_patch is merge_patch


def test_null_restores_the_default_in_the_engine_and_in_the_agent() -> None:
    from confkv_engine.control.policy import PolicyStore

    store = PolicyStore(ConfKVSection(maxCacheSize="1Gi"), 8, live_fields=[])
    store.update({"maxCacheSize": None, "eviction": {"k": 3}})
    assert store.current.confkv.max_cache_size is None and store.current.confkv.eviction.k == 3
    # The agent's side: the configured section with a revert-to-unset override on top.
    base = ConfKVSection(maxCacheSize="1Gi").model_dump(mode="json", by_alias=True)
    merged = ConfKVSection.model_validate(merge_patch(base, {"maxCacheSize": None}))
    assert merged.max_cache_size is None and merged.eviction.k == 2
