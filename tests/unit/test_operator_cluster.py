"""Pure builders of the objects around the pods (claims, NetworkPolicy, autoscaler, InferencePool), the
pod settings and partial pod-template override, and the pods' reading into conditions."""

from __future__ import annotations

from typing import Any

import pytest

from confkv_api.config import ConfigError
from confkv_api.deployment import load_deployment_spec
from confkv_operator import names as n
from confkv_operator.builders import OPTIONAL_KINDS, build_children
from confkv_operator.network import build_network_policy
from confkv_operator.pod import build_deployment, progress_deadline
from confkv_operator.podstatus import pods_report
from confkv_operator.scaling import build_autoscaler, build_inference_pool
from confkv_operator.settings import SettingsError, load_settings
from confkv_operator.status import compute_status
from confkv_operator.storage import build_claims

SETTINGS = load_settings(
    {"CONFKV_ENGINE_IMAGE": "reg/confkv:1", "CONFKV_ENGINE_CUDA_IMAGE": "reg/confkv:1-cuda"}
)


def _pod(spec: dict[str, Any], native: bool = True) -> dict[str, Any]:
    return build_deployment("demo", load_deployment_spec(spec), SETTINGS, native)["spec"]["template"]["spec"]


def _engine(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["containers"] if c["name"] == n.ENGINE_CONTAINER)


def test_gpu_pods_get_the_cuda_image_and_cpu_pods_the_cpu_one() -> None:
    assert _engine(_pod({"resources": {"gpusPerPod": 1}}))["image"] == "reg/confkv:1-cuda"
    assert _engine(_pod({}))["image"] == "reg/confkv:1"
    assert _engine(_pod({"resources": {"gpusPerPod": 1}, "image": {"engine": "mine:2"}}))["image"] == "mine:2"
    assert _engine(_pod({}))["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_agent_is_a_native_sidecar_without_readiness_or_a_container_on_old_clusters() -> None:
    native = _pod({})
    (agent,) = native["initContainers"]
    assert agent["name"] == n.AGENT_CONTAINER and agent["restartPolicy"] == "Always"
    assert "readinessProbe" not in agent and "livenessProbe" in agent
    assert [c["name"] for c in native["containers"]] == [n.ENGINE_CONTAINER]
    old = _pod({}, native=False)
    assert "initContainers" not in old
    assert [c["name"] for c in old["containers"]] == [n.ENGINE_CONTAINER, n.AGENT_CONTAINER]
    assert "initContainers" not in _pod({"pod": {"nativeSidecar": False}})


def test_pod_settings_reach_the_pod() -> None:
    pod = _pod(
        {
            "pod": {
                "runtimeClassName": "nvidia",
                "priorityClassName": "serving",
                "imagePullSecrets": ["r"],
                "shmSize": "4Gi",
                "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                "volumes": [{"name": "extra", "secret": {"secretName": "s"}}],
                "volumeMounts": [{"name": "extra", "mountPath": "/etc/extra", "readOnly": True}],
                "affinity": {"podAntiAffinity": {}},
            }
        }
    )
    assert (pod["runtimeClassName"], pod["priorityClassName"]) == ("nvidia", "serving")
    assert pod["imagePullSecrets"] == [{"name": "r"}] and pod["affinity"] == {"podAntiAffinity": {}}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"} and "extra" in volumes
    mounts = {m["name"]: m for m in _engine(pod)["volumeMounts"]}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert mounts["extra"] == {"name": "extra", "mountPath": "/etc/extra", "readOnly": True}
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in _engine(pod)["env"]


def test_partial_pod_template_merges_by_name() -> None:
    template = {
        "metadata": {"labels": {"team": "ml"}},
        "spec": {
            "dnsPolicy": "None",
            "containers": [
                {"name": n.ENGINE_CONTAINER, "env": [{"name": "EXTRA", "value": "1"}]},
                {"name": "proxy", "image": "envoy:1"},
            ],
        },
    }
    dep = build_deployment("demo", load_deployment_spec({"pod": {"template": template}}), SETTINGS)
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["template"]["metadata"]["labels"]["team"] == "ml"
    assert dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] == "demo"
    assert [c["name"] for c in pod["containers"]] == [n.ENGINE_CONTAINER, "proxy"]
    env = {e["name"] for e in _engine(pod)["env"]}
    assert {"EXTRA", "POD_NAME", "CONFKV_DEPLOYMENT"} <= env  # merged, not replaced
    assert _engine(pod)["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["dnsPolicy"] == "None"


@pytest.mark.parametrize(
    ("pod", "fragment"),
    [
        ({"template": {"spec": {"hostNetwork": True}}}, "may not set ['hostNetwork']"),
        ({"template": {"spec": {"securityContext": {"runAsUser": 0}}}}, "may not set ['securityContext']"),
        (
            {"template": {"spec": {"containers": [{"name": n.ENGINE_CONTAINER, "command": ["sh"]}]}}},
            "takes only",
        ),
        (
            {"template": {"spec": {"containers": [{"name": "x", "image": "x", "securityContext": {}}]}}},
            "securityContext is the operator's",
        ),
        ({"template": {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}}, "hostPath"),
        ({"template": {"spec": {"volumes": [{"name": "config", "emptyDir": {}}]}}}, "is the operator's"),
        ({"template": {"metadata": {"labels": {"app.kubernetes.io/instance": "x"}}}}, "may not set"),
        ({"volumes": [{"name": "cache", "emptyDir": {}}]}, "is the operator's"),
        ({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, "not in pod.volumes"),
        ({"env": [{"name": "CONFKV_API_KEY", "value": "x"}]}, "set by the operator"),
    ],
)
def test_pod_overrides_outside_the_allow_list_are_refused(pod: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_deployment_spec({"pod": pod})
    assert fragment in str(info.value)


def test_progress_deadline_covers_download_and_loading() -> None:
    plain = load_deployment_spec({})
    hf = load_deployment_spec({"model": {"source": "/models/q", "hfId": "Qwen/Qwen2.5-32B-Instruct"}})
    assert progress_deadline(plain) >= 1800 and progress_deadline(hf) >= progress_deadline(plain) + 3600
    assert progress_deadline(load_deployment_spec({"progressDeadlineSeconds": 120})) == 120


def test_claims_are_built_only_when_asked_and_retained_by_default() -> None:
    spec = load_deployment_spec(
        {
            "modelStorage": {"claimName": "w", "size": "100Gi", "createClaim": {"storageClassName": "fast"}},
            "cacheStorage": {
                "type": "pvc",
                "claimName": "c",
                "size": "50Gi",
                "createClaim": {"retainOnDelete": False, "accessMode": "ReadWriteOncePod"},
            },
        }
    )
    (model, model_owned), (cache, cache_owned) = build_claims("demo", spec)
    assert model["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "100Gi"}},
        "storageClassName": "fast",
    }
    assert not model_owned and cache_owned and cache["spec"]["accessModes"] == ["ReadWriteOncePod"]
    assert build_claims("demo", load_deployment_spec({"modelStorage": {"claimName": "w"}})) == []


def test_network_policy_admits_api_and_metrics_peers_only() -> None:
    spec = load_deployment_spec(
        {
            "networkPolicy": {
                "apiFrom": [
                    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
                ]
            }
        }
    )
    policy = build_network_policy("demo", spec, SETTINGS)["spec"]
    assert policy["policyTypes"] == ["Ingress"] and policy["podSelector"]["matchLabels"] == n.selector_labels(
        "demo"
    )
    api, agent = policy["ingress"]
    assert api["ports"] == [{"port": 8000, "protocol": "TCP"}] and len(api["from"]) == 2
    assert agent["ports"] == [{"port": 9100, "protocol": "TCP"}]
    assert agent["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    kinds = [
        c["kind"]
        for c in build_children(
            "d", "ns", load_deployment_spec({"networkPolicy": {"enabled": False}}), SETTINGS
        )
    ]
    assert "NetworkPolicy" not in kinds


def test_autoscaler_is_keda_when_served_else_an_hpa_on_queue_and_kv_usage() -> None:
    spec = load_deployment_spec({"autoscaling": {"enabled": True, "maxReplicas": 6, "targetQueueDepth": 2}})
    hpa = build_autoscaler("demo", "ns", spec, frozenset())
    assert hpa["kind"] == "HorizontalPodAutoscaler"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "confkv.io/v1alpha1",
        "kind": "ConfKVDeployment",
        "name": "demo",
    }
    metrics = {
        m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]
    }
    assert metrics == {
        "confkv_requests_waiting": "2000m",
        "confkv_kv_cache_usage_ratio": "800m",
        "confkv_agent_scale_out_recommended": "500m",  # the agent's recommendation feeds the HPA
    }
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 900
    scaled = build_autoscaler("demo", "ns", spec, OPTIONAL_KINDS)
    assert scaled["kind"] == "ScaledObject" and scaled["spec"]["maxReplicaCount"] == 6
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    assert all('namespace="ns", service="demo"' in q for q in queries)
    keda_only = load_deployment_spec({"autoscaling": {"enabled": True, "backend": "keda"}})
    assert build_autoscaler("demo", "ns", keda_only, frozenset()) is None
    assert build_autoscaler("demo", "ns", load_deployment_spec({}), OPTIONAL_KINDS) is None


def test_inference_pool_selects_the_pods_on_the_engine_port() -> None:
    pool = build_inference_pool(
        "demo", load_deployment_spec({"engine": {"port": 8100}, "inferencePool": {"enabled": True}})
    )["spec"]
    assert pool["selector"]["matchLabels"] == n.selector_labels("demo")
    assert pool["targetPorts"] == [{"number": 8100}]
    assert pool["endpointPickerRef"] == {
        "name": "demo-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }


def _status(pods: list[dict[str, Any]], reason: str = "ReplicaSetUpdated") -> dict[str, Any]:
    dep = {
        "metadata": {"generation": 1},
        "status": {
            "observedGeneration": 1,
            "replicas": 1,
            "updatedReplicas": 1,
            "readyReplicas": 0,
            "conditions": [{"type": "Progressing", "status": "True", "reason": reason}],
        },
    }
    status = compute_status("d", "ns", 8000, "m", 1, 1, dep, pods_report(pods))
    return {c["type"]: c for c in status["conditions"]} | {"phase": status["phase"]}


def _pod_status(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "d-1"}, "status": status}


def test_pod_stages_and_failures_become_conditions() -> None:
    unschedulable = _pod_status(
        conditions=[
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes have nvidia.com/gpu",
            }
        ]
    )
    got = _status([unschedulable])
    assert got["phase"] == "Degraded" and got["Degraded"]["reason"] == "Unschedulable"
    assert "nvidia.com/gpu" in got["Degraded"]["message"]
    pulling = _pod_status(
        containerStatuses=[
            {"name": n.ENGINE_CONTAINER, "state": {"waiting": {"reason": "ContainerCreating"}}}
        ]
    )
    got = _status([pulling])
    assert got["phase"] == "Progressing" and got["Progressing"]["reason"] == "PullingImages"
    assert got["Degraded"]["status"] == "False"
    recovered = _pod_status(
        containerStatuses=[
            {
                "name": n.ENGINE_CONTAINER,
                "ready": True,
                "started": True,
                "state": {"running": {}},
                "lastState": {"terminated": {"exitCode": 1, "message": "old"}},
            }
        ]
    )
    assert _status([recovered], "NewReplicaSetAvailable")["Degraded"]["reason"] != "EngineExited"
    stuck = _status([], "ProgressDeadlineExceeded")
    assert stuck["phase"] == "Degraded" and stuck["Degraded"]["reason"] == "ProgressDeadlineExceeded"


def test_monitoring_labels_setting_is_parsed() -> None:
    settings = load_settings({"CONFKV_MONITORING_LABELS": "release=kps, team = ml"})
    assert settings.monitoring_labels == {"release": "kps", "team": "ml"}
    with pytest.raises(SettingsError, match="CONFKV_MONITORING_LABELS"):
        load_settings({"CONFKV_MONITORING_LABELS": "release"})
