"""Every permission the operator's requests use, from the emulator's request log, against the RBAC data
(``confkv_operator.rbac``) and the chart's copy of it: exactly, no more, no less, in each install mode
(cluster-wide; cluster scope with a namespace list; the namespaced install, which must make no
cluster-scoped request at all).

The scenario walks every code path that talks to the API: start-up (Kopf's CRD and CR watches), create
with the monitoring CRDs installed, status updates, a policy update, an invalid spec (Kopf posts an Event),
pod listing for the last remediation, drift restoration, the workload switching between a Deployment
and a LeaderWorkerSet with ``spec.nodes``, and deletion (finalizer removal).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from confkv_operator.rbac import (
    AGENT_RULES,
    NAMESPACE_SCAN_RULES,
    OPERATOR_API_RULES,
    OPERATOR_NAMESPACE_RULES,
    OPERATOR_RULES,
    expand,
    namespaced_only,
)
from testkit.k8s_emulator import KubeEmulator
from testkit.operator_harness import API_VERSION, ROOT, OperatorThread, cr, install_crds

CHART_RULES = ROOT / "helm" / "confkv-operator" / "files" / "rbac" / "operator-rules.yaml"
NS = "default"
CHILDREN = [("v1", "configmaps", "audit-config"), ("v1", "serviceaccounts", "audit-agent"),
            ("rbac.authorization.k8s.io/v1", "roles", "audit-agent"),
            ("rbac.authorization.k8s.io/v1", "rolebindings", "audit-agent"),
            ("apps/v1", "deployments", "audit"),
            ("v1", "services", "audit"), ("policy/v1", "poddisruptionbudgets", "audit"),
            ("monitoring.coreos.com/v1", "servicemonitors", "audit"),
            ("monitoring.coreos.com/v1", "prometheusrules", "audit"),
            ("networking.k8s.io/v1", "networkpolicies", "audit"),
            ("autoscaling/v2", "horizontalpodautoscalers", "audit"),
            ("inference.networking.k8s.io/v1", "inferencepools", "audit")]
SWITCHABLE = {"servicemonitors", "prometheusrules", "networkpolicies", "horizontalpodautoscalers",
              "inferencepools"}
AUDIT = {"resources": {"gpusPerPod": 1}, "autoscaling": {"enabled": True, "backend": "hpa"},
         "inferencePool": {"enabled": True},
         "modelStorage": {"claimName": "audit-weights", "size": "100Gi", "createClaim": {}}}


def _scenario(api: KubeEmulator) -> None:
    wait = KubeEmulator.wait_for
    api.create(cr("audit", AUDIT))
    api.create(cr("scaled", {"autoscaling": {"enabled": True}}))  # KEDA's CRD is served: a ScaledObject
    wait(lambda: api.get("monitoring.coreos.com/v1", "prometheusrules", "audit", NS), 20, message="rule")
    wait(lambda: api.get("keda.sh/v1alpha1", "scaledobjects", "scaled", NS), 20, message="ScaledObject")
    wait(lambda: api.get("v1", "persistentvolumeclaims", "audit-weights", NS), 20, message="claim")
    api.patch_deployment_status("audit", NS, ready=True)
    wait(lambda: (api.get(API_VERSION, "ckv", "audit", NS).get("status") or {}).get("phase") == "Running",
         20, message="Running")
    api.patch(API_VERSION, "ckv", "audit", {"spec": {"confkv": {"eviction": {"k": 5}}}}, NS)
    wait(lambda: '"k": 5' in api.get("v1", "configmaps", "audit-config", NS)["data"]["confkv.json"], 20,
         message="policy update")
    api.delete("v1", "services", "audit", NS)
    wait(lambda: api.get("v1", "services", "audit", NS), 20, message="service restored")
    label = "app.kubernetes.io/managed-by"
    for version, plural, name in CHILDREN:  # drift every child: each is patched back
        api.patch(version, plural, name, {"metadata": {"labels": {label: "someone-else"}}}, NS)
    for version, plural, name in CHILDREN:
        wait(lambda v=version, p=plural, n=name: api.get(v, p, n, NS)["metadata"]["labels"][label]
             == "confkv-operator", 20, message=f"{plural} restored")
    off = {"monitoring": {"enabled": False}, "networkPolicy": {"enabled": False},
           "autoscaling": {"enabled": False}, "inferencePool": {"enabled": False}}
    api.patch(API_VERSION, "ckv", "audit", {"spec": off}, NS)
    api.patch(API_VERSION, "ckv", "scaled", {"spec": {"autoscaling": {"enabled": False}}}, NS)
    switchable = [*(c for c in CHILDREN if c[1] in SWITCHABLE),
                  ("keda.sh/v1alpha1", "scaledobjects", "scaled")]
    for version, plural, name in switchable:
        wait(lambda v=version, p=plural, n=name: api.get(v, p, n, NS) is None, 20,
             message=f"{plural} deleted")
    _switch_workload(api)
    api.create(cr("broken", {"confkv": {"eviction": {"k": 0}}}))
    wait(lambda: any(e.get("reason") == "InvalidSpec" for e in api.list("v1", "events", NS)), 20,
         message="an Event about the invalid spec")
    for name in ("audit", "broken", "scaled", "group"):
        api.delete(API_VERSION, "ckv", name, NS)
        wait(lambda name=name: api.get(API_VERSION, "ckv", name, NS) is None, 20, message=f"{name} deleted")


def _switch_workload(api: KubeEmulator) -> None:
    """nodes 1 -> 2 -> 1: the Deployment gives way to a LeaderWorkerSet (drifted and restored) and back."""
    wait = KubeEmulator.wait_for
    lws = "leaderworkerset.x-k8s.io/v1"
    api.create(cr("group", {"resources": {"gpusPerPod": 1}}))
    wait(lambda: api.get("apps/v1", "deployments", "group", NS), 20, message="group's Deployment")
    api.patch(API_VERSION, "ckv", "group", {"spec": {"nodes": 2}}, NS)
    wait(lambda: api.get(lws, "leaderworkersets", "group", NS), 20, message="LeaderWorkerSet")
    wait(lambda: api.get("apps/v1", "deployments", "group", NS) is None, 20, message="Deployment deleted")
    label = "app.kubernetes.io/managed-by"
    api.patch(lws, "leaderworkersets", "group", {"metadata": {"labels": {label: "someone-else"}}}, NS)
    wait(lambda: api.get(lws, "leaderworkersets", "group", NS)["metadata"]["labels"][label]
         == "confkv-operator", 20, message="LeaderWorkerSet restored")
    api.patch(API_VERSION, "ckv", "group", {"spec": {"nodes": 1}}, NS)
    wait(lambda: api.get(lws, "leaderworkersets", "group", NS) is None, 20, message="LeaderWorkerSet deleted")
    wait(lambda: api.get("apps/v1", "deployments", "group", NS), 20, message="Deployment back")


MODES = {
    "clusterwide": ({}, expand(OPERATOR_API_RULES)),
    "namespace-list": ({"CONFKV_NAMESPACES": NS}, expand(OPERATOR_API_RULES) | expand(NAMESPACE_SCAN_RULES)),
    "namespace-scope": ({"CONFKV_NAMESPACES": NS, "CONFKV_WATCH_SCOPE": "namespace"},
                        expand(namespaced_only(OPERATOR_API_RULES))),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_request_log_matches_the_rbac_rules_exactly(mode: str) -> None:
    env, declared = MODES[mode]
    with KubeEmulator() as api:
        api.activate()
        try:
            install_crds(api, monitoring=True, keda=True, inference=True, lws=True)
            with OperatorThread(api, resync_seconds=0.5, **env):
                _scenario(api)
            used = set(api.rbac_usage())
            outside = sorted({(r.verb, r.path) for r in api.request_log if r.namespace != NS})
        finally:
            api.deactivate()
    assert sorted(used - declared) == [], "requests the operator's role would forbid"
    assert sorted(declared - used) == [], "permissions granted but never used"
    if mode == "namespace-scope":
        assert outside == [], "a namespaced install must not read or write outside its namespace"


def test_chart_rules_are_the_rbac_data() -> None:
    chart = yaml.safe_load(CHART_RULES.read_text())
    assert expand(chart["cluster"]) == expand(OPERATOR_RULES) == (
        expand(OPERATOR_API_RULES) | expand(AGENT_RULES))
    assert expand(chart["namespace"]) == expand(OPERATOR_NAMESPACE_RULES) == (
        expand(namespaced_only(OPERATOR_API_RULES)) | expand(AGENT_RULES))
    assert expand(chart["namespaceScan"]) == expand(NAMESPACE_SCAN_RULES)


def test_rbac_module_is_plain_data() -> None:
    # The chart renders the rules from this data: only apiGroups/resources/verbs keys, sorted verbs.
    for rule in [*OPERATOR_RULES, *OPERATOR_NAMESPACE_RULES]:
        assert set(rule) == {"apiGroups", "resources", "verbs"} and rule["verbs"] == sorted(rule["verbs"])
    assert Path(__file__).exists()
