"""Pure builders: spec in, Kubernetes objects out."""

from __future__ import annotations

import json
from typing import Any

import pytest

from confkv_api.config import ConfigError, load_config
from confkv_api.deployment import load_deployment_spec
from confkv_operator import names as n
from confkv_operator.builders import build_children, build_config_map, build_role, engine_config
from confkv_operator.pod import build_deployment
from confkv_operator.settings import load_settings

SETTINGS = load_settings({"CONFKV_ENGINE_IMAGE": "registry.local/confkv:1", "CONFKV_AGENT_PORT": "9200",
                          "CONFKV_HOST_PATH_PREFIXES": "/mnt/nvme"})


def _deployment(spec: dict[str, Any]) -> dict[str, Any]:
    return build_deployment("demo", load_deployment_spec(spec), SETTINGS)


def _containers(dep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The long-running containers: regular ones and native sidecars (init, restartPolicy Always)."""
    pod = dep["spec"]["template"]["spec"]
    sidecars = [c for c in pod.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    return {c["name"]: c for c in [*pod["containers"], *sidecars]}


def test_children_kinds_and_names() -> None:
    children = build_children("demo", "ns1", load_deployment_spec({}), SETTINGS)
    assert [(c["kind"], c["metadata"]["name"]) for c in children] == [
        ("ConfigMap", "demo-config"), ("ServiceAccount", "demo-agent"), ("Role", "demo-agent"),
        ("RoleBinding", "demo-agent"), ("Deployment", "demo"), ("Service", "demo"),
        ("Service", "demo-metrics"), ("PodDisruptionBudget", "demo"), ("NetworkPolicy", "demo"),
    ]
    for child in children:
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "confkv-operator"


def test_monitoring_children_only_when_their_crds_exist() -> None:
    spec = load_deployment_spec({"alerts": {"hitRate": {"threshold": 0.5, "enabled": False}}})
    kinds = [c["kind"] for c in build_children("d", "ns", spec, SETTINGS, frozenset({"ServiceMonitor"}))]
    assert "ServiceMonitor" in kinds and "PrometheusRule" not in kinds
    both = build_children("d", "ns", spec, SETTINGS, frozenset({"ServiceMonitor", "PrometheusRule"}))
    rule = next(c for c in both if c["kind"] == "PrometheusRule")
    alerts = [r["alert"] for r in rule["spec"]["groups"][0]["rules"]]
    assert alerts == ["ConfKVHighVRAM", "ConfKVHighLatency", "ConfKVFrequentOOM"]  # hitRate disabled


def test_gpu_limits_only_with_gpus() -> None:
    gpu = _containers(_deployment({"resources": {"gpusPerPod": 1, "limits": {"memory": "96Gi"}}}))
    assert gpu[n.ENGINE_CONTAINER]["resources"]["limits"] == {"memory": "96Gi", "nvidia.com/gpu": "1"}
    cpu = _containers(_deployment({}))
    assert "nvidia.com/gpu" not in json.dumps(cpu[n.ENGINE_CONTAINER].get("resources", {}))
    assert "nvidia.com/gpu" not in json.dumps(cpu[n.AGENT_CONTAINER])


def test_pod_security_probes_and_volumes() -> None:
    dep = _deployment({"engine": {"port": 8100}})
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    containers = _containers(dep)
    assert set(containers) == {n.ENGINE_CONTAINER, n.AGENT_CONTAINER}
    for container in containers.values():
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["allowPrivilegeEscalation"] is False
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["config"]["mountPath"] == n.CONFIG_DIR and "subPath" not in mounts["config"]
        assert mounts["socket"]["mountPath"] == n.SOCKET_DIR and mounts["tmp"]["mountPath"] == "/tmp"
    engine = containers[n.ENGINE_CONTAINER]
    assert engine["ports"][0]["containerPort"] == 8100
    assert engine["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    assert containers[n.AGENT_CONTAINER]["ports"][0]["containerPort"] == 9200
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"] == {"name": "config", "configMap": {"name": "demo-config"}}
    assert "emptyDir" in volumes["socket"] and "emptyDir" in volumes["tmp"] and "emptyDir" in volumes["cache"]
    assert engine["image"] == "registry.local/confkv:1" == containers[n.AGENT_CONTAINER]["image"]


@pytest.mark.parametrize(("storage", "expected"), [
    ({"type": "pvc", "claimName": "nvme"}, {"persistentVolumeClaim": {"claimName": "nvme"}}),
    ({"type": "hostPath", "hostPath": "/mnt/nvme"},
     {"hostPath": {"path": "/mnt/nvme", "type": "Directory"}}),
    ({"size": "20Gi"}, {"emptyDir": {"sizeLimit": "20Gi"}}),
])
def test_cache_volume(storage: dict[str, Any], expected: dict[str, Any]) -> None:
    dep = _deployment({"cacheStorage": {**storage, "mountPath": "/nvme"}})
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["cache"] == {"name": "cache", **expected}
    mounts = {m["name"]: m["mountPath"] for m in _containers(dep)[n.ENGINE_CONTAINER]["volumeMounts"]}
    assert mounts["cache"] == "/nvme"


def test_hf_source_gets_a_fetch_init_container() -> None:
    dep = _deployment({"model": {"source": "/models/qwen", "hfId": "Qwen/Qwen2.5-32B-Instruct",
                                 "tokenSecretRef": "hf"}, "modelStorage": {"claimName": "weights"}})
    pod = dep["spec"]["template"]["spec"]
    init = pod["initContainers"][0]  # the download first, then the agent sidecar
    assert [c["name"] for c in pod["initContainers"]] == [n.FETCH_CONTAINER, n.AGENT_CONTAINER]
    assert init["command"][:3] == ["hf", "download", "Qwen/Qwen2.5-32B-Instruct"]
    assert init["command"][-1] == "/models/qwen"
    token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights"}
    engine_mounts = {m["name"]: m for m in _containers(dep)[n.ENGINE_CONTAINER]["volumeMounts"]}
    assert engine_mounts["model"]["readOnly"] is True
    plain = _deployment({})["spec"]["template"]["spec"]["initContainers"]
    assert [c["name"] for c in plain] == [n.AGENT_CONTAINER]


def test_policy_changes_leave_the_pod_template_alone() -> None:
    base = _deployment({})["spec"]["template"]
    policy = {"confkv": {"kvPolicy": "conf-kv", "confidenceThresholds": {"high": 0.95, "medium": 0.5},
                         "eviction": {"k": 3}, "maxCacheSize": "70%"},
              "alerts": {"vram": {"threshold": 0.9}}, "remediation": {"dryRun": True}}
    assert _deployment(policy)["spec"]["template"] == base
    assert build_config_map("demo", load_deployment_spec(policy)) != build_config_map(
        "demo", load_deployment_spec({}))


@pytest.mark.parametrize("change", [
    {"model": {"dtype": "bfloat16"}}, {"engine": {"maxBatchSize": 8}},
    {"image": {"engine": "other:2"}}, {"resources": {"gpusPerPod": 1}},
])
def test_restart_fields_change_the_pod_template(change: dict[str, Any]) -> None:
    assert _deployment(change)["spec"]["template"] != _deployment({})["spec"]["template"]


def test_config_map_is_the_engine_document_with_pod_owned_fields() -> None:
    spec = load_deployment_spec({"confkv": {"eviction": {"k": 4}},
                                 "cacheStorage": {"mountPath": "/nvme"}})
    doc = json.loads(build_config_map("demo", spec)["data"][n.CONFIG_FILE])
    config = load_config(doc)  # the engine's and agent's own parser accepts it
    assert config.engine.host == "0.0.0.0" and config.engine.cache_dir == "/nvme"
    assert config.engine.grpc_socket.startswith(n.SOCKET_DIR + "/")
    assert config.confkv.eviction.k == 4
    assert engine_config(spec).model == spec.model


def test_agent_role_is_namespaced_and_minimal() -> None:
    role = build_role("demo")
    triples = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    assert triples == {("", "pods", "get"), ("", "pods", "patch"), ("", "events", "create"),
                       ("confkv.io", "confkvdeployments", "get"),
                       ("confkv.io", "confkvdeployments/agent", "get")}  # the admission policy's marker
    cr_rule = next(r for r in role["rules"] if "confkvdeployments" in r["resources"])
    assert cr_rule["resourceNames"] == ["demo"]


def test_gpu_pods_replace_without_surge() -> None:
    assert _deployment({"resources": {"gpusPerPod": 1}})["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    assert _deployment({})["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


@pytest.mark.parametrize(("spec", "fragment"), [
    ({"confkv": {"confidenceThresholds": {"high": 0.5, "medium": 0.7}}}, "must be > medium"),
    ({"confkv": {"eviction": {"k": 0}}}, "confkv.eviction.k"),
    ({"confkv": {"budget": 0.5, "budgetTokens": 128}}, "at most one of budget"),
    ({"engine": {"prefillChunk": 4096}}, "prefillChunk"),
    ({"cacheStorage": {"type": "pvc"}}, "needs claimName"),
    ({"resources": {"limits": {"cpu": "lots"}}}, "resources.limits.cpu"),
    ({"model": {"hfId": "a/b"}}, "model.hfId needs model.source"),
    ({"confkv": {"maxCacheSize": "80 percent"}}, "invalid size"),
    ({"replicas": -1}, "replicas"),
    ({"unknown": 1}, "unknown key 'unknown'"),
    ({"engine": {"host": "10.0.0.1"}}, "host set by the operator"),
    ({"engine": {"apiKey": "s3cret"}}, "apiKey set by the operator, not by the spec; put the API key"),
])
def test_invalid_specs_are_rejected_with_the_key_named(spec: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match="invalid ConfKVDeployment spec") as info:
        load_deployment_spec(spec)
    assert fragment in str(info.value)
