"""The operator under Kopf against the API emulator, driven by the kubernetes client."""

from __future__ import annotations

import json
from typing import Any

import kubernetes
import pytest

from confkv_operator import names as n
from testkit.k8s_emulator import KubeEmulator
from testkit.operator_harness import cr

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("operator")]
NS = "default"
GROUP, VERSION, PLURAL = "confkv.io", "v1alpha1", "confkvdeployments"
MERGE = "application/merge-patch+json"
CHILDREN = [("v1", "configmaps", "{}-config"), ("v1", "serviceaccounts", "{}-agent"),
            ("rbac.authorization.k8s.io/v1", "roles", "{}-agent"),
            ("rbac.authorization.k8s.io/v1", "rolebindings", "{}-agent"), ("apps/v1", "deployments", "{}"),
            ("v1", "services", "{}"), ("policy/v1", "poddisruptionbudgets", "{}")]


def wait(condition: Any, message: str, timeout: float = 20.0) -> Any:
    return KubeEmulator.wait_for(condition, timeout=timeout, message=message)


def create(custom: kubernetes.client.CustomObjectsApi, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, cr(name, spec))


def patch_spec(custom: kubernetes.client.CustomObjectsApi, name: str, spec: dict[str, Any]) -> None:
    custom.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name, {"spec": spec},
                                          _content_type=MERGE)


def get_cr(custom: kubernetes.client.CustomObjectsApi, name: str) -> dict[str, Any]:
    return custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)


def children_of(api: KubeEmulator, name: str) -> list[dict[str, Any] | None]:
    return [api.get(version, plural, pattern.format(name), NS) for version, plural, pattern in CHILDREN]


def wait_children(api: KubeEmulator, name: str) -> list[dict[str, Any]]:
    return wait(lambda: (kids := children_of(api, name)) and all(kids) and kids, f"children of {name}")


def deployment(apps: kubernetes.client.AppsV1Api, name: str) -> dict[str, Any]:
    obj = apps.read_namespaced_deployment(name, NS)
    return apps.api_client.sanitize_for_serialization(obj)


def config_doc(core: kubernetes.client.CoreV1Api, name: str) -> dict[str, Any]:
    return json.loads(core.read_namespaced_config_map(n.config_map_name(name), NS).data[n.CONFIG_FILE])


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == ctype), None)


def test_create_makes_owned_children_with_gpu_sidecar_and_security(
        emulator: KubeEmulator, custom: Any, apps: Any, core: Any) -> None:
    owner = create(custom, "gpu", {"resources": {"gpusPerPod": 1}, "confkv": {"eviction": {"k": 3}}})
    for child in wait_children(emulator, "gpu"):
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "ConfKVDeployment", "gpu", owner["metadata"]["uid"], True)
    dep = deployment(apps, "gpu")
    pod = dep["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert containers[n.ENGINE_CONTAINER]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    (agent,) = pod["initContainers"]  # a native sidecar: the emulator reports Kubernetes 1.35
    assert agent["name"] == n.AGENT_CONTAINER and agent["restartPolicy"] == "Always"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert containers[n.ENGINE_CONTAINER]["securityContext"]["readOnlyRootFilesystem"] is True
    assert config_doc(core, "gpu")["confkv"]["eviction"]["k"] == 3
    status = wait(lambda: (s := get_cr(custom, "gpu").get("status", {})).get("endpoint") and s, "status")
    assert status["endpoint"] == "http://gpu.default.svc:8000"
    assert status["selector"] == n.selector_string("gpu")


def test_status_follows_the_deployment(emulator: KubeEmulator, custom: Any) -> None:
    create(custom, "stat", {"replicas": 2})
    wait_children(emulator, "stat")
    emulator.patch_deployment_status("stat", NS, ready=True)
    status = wait(lambda: (s := get_cr(custom, "stat").get("status", {})).get("phase") == "Running" and s,
                  "phase Running")
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)
    assert condition({"status": status}, "Ready")["status"] == "True"
    emulator.patch_deployment_status("stat", NS, ready=False)
    wait(lambda: get_cr(custom, "stat")["status"]["phase"] == "Degraded", "phase Degraded")


def test_policy_update_changes_only_the_config_map(emulator: KubeEmulator, custom: Any, apps: Any,
                                                   core: Any) -> None:
    create(custom, "pol", {})
    wait_children(emulator, "pol")
    before = deployment(apps, "pol")
    patch_spec(custom, "pol", {"confkv": {"eviction": {"k": 4}, "confidenceThresholds": {"high": 0.95}},
                               "alerts": {"vram": {"threshold": 0.9, "for": "1m"}}})
    wait(lambda: config_doc(core, "pol")["confkv"]["eviction"]["k"] == 4, "ConfigMap update")
    doc = config_doc(core, "pol")
    assert doc["confkv"]["confidenceThresholds"]["high"] == 0.95 and doc["alerts"]["vram"]["for"] == "1m"
    after = deployment(apps, "pol")
    assert after["spec"]["template"] == before["spec"]["template"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"]


def test_model_change_rolls_the_pod_template(emulator: KubeEmulator, custom: Any, apps: Any) -> None:
    create(custom, "roll", {})
    wait_children(emulator, "roll")
    before = deployment(apps, "roll")["spec"]["template"]["metadata"]["annotations"]
    patch_spec(custom, "roll", {"model": {"dtype": "bfloat16"}})
    after = wait(lambda: (a := deployment(apps, "roll")["spec"]["template"]["metadata"]["annotations"])
                 != before and a, "template change")
    assert after[n.RESTART_CHECKSUM_ANNOTATION] != before[n.RESTART_CHECKSUM_ANNOTATION]
    patch_spec(custom, "roll", {"image": {"engine": "registry.local/confkv:2"}})
    wait(lambda: deployment(apps, "roll")["spec"]["template"]["spec"]["containers"][0]["image"]
         == "registry.local/confkv:2", "image change")


def test_deleted_and_edited_children_are_restored(emulator: KubeEmulator, custom: Any, apps: Any,
                                                  core: Any) -> None:
    create(custom, "drift", {})
    wait_children(emulator, "drift")
    core.delete_namespaced_service("drift", NS)
    core.delete_namespaced_config_map("drift-config", NS)
    wait(lambda: all(children_of(emulator, "drift")), "re-created children")
    apps.patch_namespaced_deployment("drift", NS, {"spec": {"template": {"spec": {"containers": [
        {"name": n.ENGINE_CONTAINER, "image": "evil:1"}]}}}},
        _content_type="application/strategic-merge-patch+json")
    wait(lambda: deployment(apps, "drift")["spec"]["template"]["spec"]["containers"][0]["image"] != "evil:1",
         "restored image")
    core.patch_namespaced_config_map("drift-config", NS, {"data": {n.CONFIG_FILE: "{}"}}, _content_type=MERGE)
    wait(lambda: config_doc(core, "drift") != {}, "restored config")


def test_server_defaults_are_not_drift(emulator: KubeEmulator, custom: Any) -> None:
    create(custom, "quiet", {})
    wait_children(emulator, "quiet")
    emulator.patch("apps/v1", "deployments", "quiet", {"spec": {"revisionHistoryLimit": 10, "template": {
        "spec": {"dnsPolicy": "ClusterFirst", "schedulerName": "default-scheduler"}}}}, NS)
    version = emulator.get("apps/v1", "deployments", "quiet", NS)["metadata"]["resourceVersion"]

    def reads() -> int:
        log = emulator.request_log
        return len([r for r in log if r.path.endswith("/deployments/quiet") and r.verb == "get"])

    before = reads()
    # Three more resync reads of the Deployment, then check nothing was written in between.
    wait(lambda: reads() >= before + 3, "resyncs")
    assert emulator.get("apps/v1", "deployments", "quiet", NS)["metadata"]["resourceVersion"] == version


def test_invalid_spec_sets_a_condition_and_recovers(emulator: KubeEmulator, custom: Any) -> None:
    create(custom, "bad", {"confkv": {"confidenceThresholds": {"high": 0.5, "medium": 0.7}}})
    status = wait(lambda: (s := get_cr(custom, "bad").get("status", {})).get("phase") == "Invalid" and s,
                  "phase Invalid")
    invalid = condition({"status": status}, "InvalidSpec")
    assert invalid["status"] == "True" and "medium" in invalid["message"]
    assert emulator.get("apps/v1", "deployments", "bad", NS) is None
    patch_spec(custom, "bad", {"confkv": {"confidenceThresholds": {"high": 0.8}}})
    wait_children(emulator, "bad")
    wait(lambda: condition(get_cr(custom, "bad"), "InvalidSpec")["status"] == "False", "InvalidSpec False")


def test_last_remediation_comes_from_pod_annotations(emulator: KubeEmulator, custom: Any, core: Any) -> None:
    create(custom, "rem", {})
    wait_children(emulator, "rem")
    record = {"time": "2026-11-30T12:00:00Z", "alert": "hitRate", "action": "raiseLruK", "result": "applied"}
    core.create_namespaced_pod(NS, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "rem-abc", "labels": n.selector_labels("rem"),
                     "annotations": {n.LAST_REMEDIATION_ANNOTATION: json.dumps(record)}},
        "spec": {"containers": [{"name": "x", "image": "x"}]}})
    last = wait(lambda: get_cr(custom, "rem").get("status", {}).get("lastRemediation"), "lastRemediation")
    assert last == {**record, "pod": "rem-abc"}


def test_delete_removes_the_children(emulator: KubeEmulator, custom: Any) -> None:
    create(custom, "gone", {})
    wait_children(emulator, "gone")
    custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "gone")
    wait(lambda: emulator.get(GROUP + "/" + VERSION, PLURAL, "gone", NS) is None, "CR gone")
    wait(lambda: not any(children_of(emulator, "gone")), "children gone")
