"""Example CRs and a table of good and bad specs against the CRD's schema and CEL rules (cel-python),
cross-checked with the pydantic models the operator validates with: the API server and the operator
must accept and reject the same specs."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from contract_tools import example_crs, load_crd
from crd_schema import apply_defaults, cel_failures, cel_rules, structural_errors, version_schema

from confkv_api.config import ConfigError
from confkv_api.deployment import load_deployment_spec

CRD = load_crd()
SCHEMA = version_schema(CRD)


def _cr(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "confkv.io/v1alpha1", "kind": "ConfKVDeployment",
            "metadata": {"name": "demo", "namespace": "default"}, "spec": spec}


def _problems(cr: dict[str, Any]) -> list[str]:
    structural = structural_errors(SCHEMA, cr)
    if structural:
        return structural  # the server stops before CEL when the structure is wrong
    return [f.message for f in cel_failures(SCHEMA, cr)]


GOOD: dict[str, dict[str, Any]] = {
    "empty": {},
    "thresholds": {"confkv": {"confidenceThresholds": {"high": 0.95, "medium": 0.5}}},
    "only-high-above-default-medium": {"confkv": {"confidenceThresholds": {"high": 0.8}}},
    "lru-k-3": {"confkv": {"eviction": {"policy": "LRU-K", "k": 3}, "maxCacheSize": "80%"}},
    "budget": {"confkv": {"kvPolicy": "conf-kv", "budget": 0.25}},
    "budget-tokens": {"confkv": {"kvPolicy": "conf-kv", "budgetTokens": 1024}},
    "precision-tiers": {"confkv": {"kvPolicy": "conf-kv", "budget": 0.25, "tiers": ["full", "int4", "int2"]}},
    "key-only-tiers": {"confkv": {"kvPolicy": "conf-kv", "budget": 0.25, "tiers": ["full", "key_only"]}},
    "key-only-on-fp8-cache": {"confkv": {"kvCacheDtype": "fp8", "tiers": ["full", "key_only"]}},
    "pvc-cache": {"cacheStorage": {"type": "pvc", "claimName": "nvme"}},
    "hostpath-cache": {"cacheStorage": {"type": "hostPath", "hostPath": "/mnt/nvme"}},
    "hf": {"model": {"hfId": "Qwen/Qwen2.5-0.5B", "source": "/models/qwen", "tokenSecretRef": "hf"},
           "modelStorage": {"claimName": "models"}},
    "chunk-equals-budget": {"engine": {"prefillChunk": 256, "maxNumBatchedTokens": 256}},
    "gpu": {"resources": {"gpusPerPod": 1}, "engine": {"device": "cuda"}, "model": {"dtype": "bfloat16"}},
    "api-key": {"engine": {"apiKeySecretRef": {"name": "demo-api", "key": "api-key"}}},
    "hostpath-dotted-name": {"cacheStorage": {"type": "hostPath", "hostPath": "/mnt/.nvme/...x"}},
    "tensor-parallel-pod": {"resources": {"gpusPerPod": 4}},
    "tensor-parallel-explicit": {"resources": {"gpusPerPod": 4}, "nodes": 2, "engine": {"tensorParallel": 8}},
    "multinode": {"nodes": 4, "resources": {"gpusPerPod": 8}},
    "cpu-ranks-over-nodes": {"nodes": 2, "engine": {"tensorParallel": 4}},
}

# name -> (spec, a fragment of the expected message: a CEL rule's message or a structural error)
BAD: dict[str, tuple[dict[str, Any], str]] = {
    "high-equals-medium": ({"confkv": {"confidenceThresholds": {"high": 0.7, "medium": 0.7}}},
                           "high must be greater than medium"),
    "high-below-medium": ({"confkv": {"confidenceThresholds": {"high": 0.5, "medium": 0.9}}},
                          "high must be greater than medium"),
    "high-below-default-medium": ({"confkv": {"confidenceThresholds": {"high": 0.6}}},
                                  "high must be greater than medium"),
    "both-budgets": ({"confkv": {"budget": 0.5, "budgetTokens": 512}}, "at most one of budget"),
    "tiers-without-full": ({"confkv": {"tiers": ["int4", "int2"]}}, "tiers must start with full"),
    "precision-tiers-on-int8-cache": ({"confkv": {"kvCacheDtype": "int8", "tiers": ["full", "int4", "int2"]}},
                                      "holds codes already; set tiers [full, key_only]"),
    "chunk-above-budget": ({"engine": {"prefillChunk": 4096}}, "prefillChunk must be <="),
    "token-without-hf": ({"model": {"tokenSecretRef": "hf"}}, "tokenSecretRef is only used with hfId"),
    "pvc-without-claim": ({"cacheStorage": {"type": "pvc"}}, "type pvc needs claimName"),
    "hostpath-without-path": ({"cacheStorage": {"type": "hostPath"}}, "type hostPath needs hostPath"),
    "hostpath-without-type": ({"cacheStorage": {"hostPath": "/mnt/nvme"}}, "hostPath is only used with type"),
    "hf-outside-mount": ({"model": {"hfId": "Qwen/Qwen2.5-0.5B", "source": "/data/qwen"}},
                         "model.source under modelStorage.mountPath"),
    "lru-k-zero": ({"confkv": {"eviction": {"k": 0}}}, "minimum"),
    "threshold-above-one": ({"confkv": {"confidenceThresholds": {"high": 1.5}}}, "maximum"),
    "unknown-field": ({"confkv": {"kvPolicyy": "full"}}, "kvPolicyy"),
    "bad-dtype": ({"model": {"dtype": "int8"}}, "int8"),
    "bad-cache-size": ({"confkv": {"maxCacheSize": "lots"}}, "lots"),
    "negative-replicas": ({"replicas": -1}, "minimum"),
    "budget-zero": ({"confkv": {"budget": 0}}, "minimum"),
    # The node's root and path tricks never pass the schema (the allow-list itself is the operator's).
    **{f"hostpath-{label}": ({"cacheStorage": {"type": "hostPath", "hostPath": path}}, "does not match")
       for label, path in (("root", "/"), ("parent", "/data/../etc"), ("dot", "/data/./x"),
                           ("trailing-slash", "/data/"), ("double-slash", "//etc"), ("relative", "data"))},
    "api-key-without-key": ({"engine": {"apiKeySecretRef": {"name": "demo-api"}}}, "'key' is a required"),
    "api-key-bad-secret-name": ({"engine": {"apiKeySecretRef": {"name": "Demo_API", "key": "k"}}},
                                "does not match"),
    "api-key-as-string": ({"engine": {"apiKeySecretRef": "demo-api"}}, "is not of type"),
    "cache-claim-without-size": ({"cacheStorage": {"type": "pvc", "claimName": "c", "createClaim": {}}},
                                 "createClaim needs type pvc and a size"),
    "model-claim-without-name": ({"modelStorage": {"size": "10Gi", "createClaim": {}}},
                                 "createClaim needs claimName and size"),
    "autoscaling-max-below-min": ({"autoscaling": {"minReplicas": 4, "maxReplicas": 2}},
                                  "maxReplicas must be >= minReplicas"),
    "claim-read-only-many": ({"modelStorage": {"claimName": "m", "size": "1Gi",
                                               "createClaim": {"accessMode": "ReadOnlyMany"}}},
                             "ReadOnlyMany"),
    "pod-bad-runtime-class": ({"pod": {"runtimeClassName": "Nvidia_GPU"}}, "does not match"),
    "api-key-inline": ({"engine": {"apiKey": "s3cret"}}, "apiKey"),
    "tensor-parallel-contradicts-gpus": ({"resources": {"gpusPerPod": 2}, "engine": {"tensorParallel": 4}},
                                         "engine.tensorParallel must be unset (1) or nodes x"),
    "cpu-ranks-not-over-nodes": ({"nodes": 2, "engine": {"tensorParallel": 3}},
                                 "must be a multiple of nodes"),
    "too-many-ranks": ({"nodes": 8, "resources": {"gpusPerPod": 16}}, "must be <= 64"),
    "zero-nodes": ({"nodes": 0}, "minimum"),
}

# Rules that the structural schema already enforces (so the server never reaches them) are checked by
# evaluating CEL alone: the rule must still say no.
CEL_ONLY: dict[str, tuple[dict[str, Any], str]] = {
    "lru-k-zero": ({"confkv": {"eviction": {"k": 0}}}, "LRU-K needs K >= 1"),
}


@pytest.mark.parametrize("name", GOOD)
def test_good_specs_pass_schema_cel_and_models(name: str) -> None:
    spec = GOOD[name]
    assert _problems(_cr(spec)) == []
    load_deployment_spec(spec)


@pytest.mark.parametrize("name", BAD)
def test_bad_specs_are_rejected_by_schema_or_cel_and_by_models(name: str) -> None:
    spec, fragment = BAD[name]
    problems = _problems(_cr(spec))
    assert any(fragment in p for p in problems), f"expected {fragment!r} in {problems}"
    with pytest.raises(ConfigError):
        load_deployment_spec(spec)


@pytest.mark.parametrize("name", CEL_ONLY)
def test_cel_rule_alone_rejects(name: str) -> None:
    spec, fragment = CEL_ONLY[name]
    messages = [f.message for f in cel_failures(SCHEMA, _cr(spec))]
    assert any(fragment in m for m in messages), f"expected {fragment!r} in {messages}"


def test_every_cel_rule_is_exercised_by_the_table() -> None:
    """A new CEL rule needs a row in BAD or CEL_ONLY above; the rule's message identifies it."""
    fragments = [fragment for _, fragment in [*BAD.values(), *CEL_ONLY.values()]]
    untested = [(path, rule["rule"]) for path, rule in cel_rules(SCHEMA)
                if not any(f in rule.get("message", rule["rule"]) for f in fragments)]
    assert not untested, f"CEL rules without a bad case: {untested}"


def test_defaults_fill_nested_groups() -> None:
    """The API server applies defaults inside defaulted objects; CEL rules see the defaulted values."""
    defaulted = apply_defaults(SCHEMA, _cr({}))
    thresholds = defaulted["spec"]["confkv"]["confidenceThresholds"]
    assert (thresholds["high"], thresholds["medium"]) == (0.9, 0.7)
    assert defaulted["spec"]["confkv"]["eviction"] == {"policy": "LRU-K", "k": 2}


def test_crd_shape() -> None:
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "confkvdeployments.confkv.io"
    names = (spec["group"], spec["scope"], spec["names"]["kind"])
    assert names == ("confkv.io", "Namespaced", "ConfKVDeployment")
    assert "ckv" in spec["names"]["shortNames"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    columns = {c["name"].lower() for c in version["additionalPrinterColumns"]}
    assert {"model", "replicas", "ready", "phase", "age"} <= columns


def test_examples_exist_for_cpu_and_gpu() -> None:
    crs = dict(example_crs())
    assert crs, "examples/ holds no ConfKVDeployment"
    gpus = [cr["spec"].get("resources", {}).get("gpusPerPod", 0) for cr in crs.values()]
    assert 0 in gpus, "no CPU example (gpusPerPod 0)"
    assert any(g >= 1 for g in gpus), "no GPU example"


EXAMPLES = example_crs()


@pytest.mark.parametrize("cr", [c for _, c in EXAMPLES], ids=[label for label, _ in EXAMPLES])
def test_example_cr_is_valid(cr: dict[str, Any]) -> None:
    assert cr["apiVersion"] == f"{CRD['spec']['group']}/v1alpha1"
    assert _problems(copy.deepcopy(cr)) == []
    load_deployment_spec(cr.get("spec", {}))


def test_default_tiers_on_a_coded_cache_ask_for_the_key_only_chain() -> None:
    """The CRD defaults ``tiers`` to the precision chain, which an int8 / fp8 pool cannot hold, so an
    fp8 CR without ``tiers`` is refused with what to set; a config file or the CLI (no defaulting
    server in between) gets [full, key_only] there instead."""
    spec = {"confkv": {"kvPolicy": "conf-kv", "kvCacheDtype": "fp8"}}
    assert any("set tiers [full, key_only]" in p for p in _problems(_cr(spec)))
    assert load_deployment_spec(spec).confkv.tiers == ["full", "key_only"]
    assert load_deployment_spec({}).confkv.tiers == ["full", "int4", "k4v2", "int2"]
