"""Rendered chart manifests and the operator's builder output through kubernetes-validate --strict (1.35).

kubernetes-validate ships the upstream OpenAPI schemas of built-in kinds only (v1.25 .. v1.37 in 1.37.0).
The optional kinds the operator renders (ServiceMonitor, PrometheusRule, ScaledObject, InferencePool,
LeaderWorkerSet) are validated against their upstream CRDs, vendored under data/crds/ (see its README):
strict structural validation, defaulting and CEL rules, as the API server would; a LeaderWorkerSet's pod
templates also go through kubernetes-validate as PodTemplates. Other custom kinds are skipped one by one
with the reason and covered elsewhere (ConfKVDeployment by the CRD schema tests).
"""

from __future__ import annotations

import sys
from typing import Any

import kubernetes_validate
import pytest
import yaml
from contract_tools import (
    CI_VALUES,
    KUBERNETES_VERSION,
    REPO,
    example_crs,
    find_tool,
    render,
    require_tool,
)

sys.path.insert(0, str(REPO / "operator"))

from crd_schema import cel_failures, structural_errors, version_schema  # noqa: E402

from confkv_api.deployment import DeploymentSpec, load_deployment_spec  # noqa: E402
from confkv_operator.builders import OPTIONAL_KINDS, build_children  # noqa: E402
from confkv_operator.settings import OperatorSettings  # noqa: E402
from confkv_operator.storage import build_claims  # noqa: E402

OTHER_CHECKS = {
    "ClusterKopfPeering": "Kopf's own kind with no upstream schema; its CRD is validated instead",
    "ConfKVDeployment": "custom kind; validated against the CRD schema in test_crd_schema.py",
}
VENDORED_DIR = REPO / "tests" / "contracts" / "data" / "crds"
VENDORED = {crd["spec"]["names"]["kind"]: crd
            for crd in (yaml.safe_load(path.read_text()) for path in sorted(VENDORED_DIR.glob("*.yaml")))}
SETTINGS = OperatorSettings(host_path_prefixes=("/mnt/nvme",))  # GPU_SPEC caches on a node NVMe

GPU_SPEC = {
    "model": {"source": "/models/qwen2.5-32b", "hfId": "Qwen/Qwen2.5-32B-Instruct", "dtype": "bfloat16",
              "tokenSecretRef": "hf-token", "maxModelLen": 32768},
    "replicas": 2,
    "resources": {"gpusPerPod": 1, "requests": {"cpu": "8", "memory": "96Gi"}, "limits": {"memory": "120Gi"},
                  "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
                  "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    "cacheStorage": {"type": "hostPath", "hostPath": "/mnt/nvme/confkv"},
    "modelStorage": {"claimName": "models", "size": "200Gi"},
}


EVERYTHING_ON = {
    **GPU_SPEC,
    "modelStorage": {"claimName": "models", "size": "200Gi", "createClaim": {"storageClassName": "fast"}},
    "pod": {"runtimeClassName": "nvidia", "priorityClassName": "llm-serving", "imagePullSecrets": ["ghcr"],
            "shmSize": "2Gi", "labels": {"team": "ml"}, "annotations": {"owner": "ml"},
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["79000"]}]}]}}},
            "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
            "volumes": [{"name": "extra", "configMap": {"name": "extra"}}],
            "volumeMounts": [{"name": "extra", "mountPath": "/etc/extra", "readOnly": True}],
            "template": {"spec": {"topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
                 "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "demo"}}}],
                "containers": [{"name": "confkv-engine", "env": [{"name": "EXTRA", "value": "1"}]}]}}},
    "monitoring": {"labels": {"release": "kube-prometheus-stack"}},
    "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 8},
    "inferencePool": {"enabled": True},
}


#: Tensor parallelism: a pod of 4 GPUs (a Deployment), and groups of 2 such nodes (a LeaderWorkerSet).
TP_POD = {**GPU_SPEC, "resources": {**GPU_SPEC["resources"], "gpusPerPod": 4}}
MULTINODE = {**EVERYTHING_ON, "nodes": 2, "resources": {**GPU_SPEC["resources"], "gpusPerPod": 8}}


def _pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A LeaderWorkerSet's two pod templates as core/v1 PodTemplates, for kubernetes-validate's strict
    pod schema on top of the LWS CRD's own."""
    group = obj["spec"]["leaderWorkerTemplate"]
    return [(f"-{key}", {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": key.lower()},
                         "template": group[key]}) for key in ("leaderTemplate", "workerTemplate")]


def _builder_cases() -> list[tuple[str, dict[str, Any]]]:
    specs = {"default": DeploymentSpec(), "gpu-hf": load_deployment_spec(GPU_SPEC),
             "everything": load_deployment_spec(EVERYTHING_ON), "tp-pod": load_deployment_spec(TP_POD),
             "multinode": load_deployment_spec(MULTINODE)}
    for label, cr in example_crs():
        specs[f"example-{label}"] = load_deployment_spec(cr.get("spec", {}))
    cases = []
    for label, spec in specs.items():
        # With and without KEDA served: the autoscaler is a ScaledObject or an HPA.
        for served, tag in ((OPTIONAL_KINDS, ""), (OPTIONAL_KINDS - {"ScaledObject"}, "-nokeda")):
            for obj in build_children("demo", "serving", spec, SETTINGS, served):
                case = f"builder-{label}{tag}-{obj['kind']}-{obj['metadata']['name']}"
                cases.append((case, obj))
                if obj["kind"] == "LeaderWorkerSet":
                    cases += [(case + suffix, template) for suffix, template in _pod_templates(obj)]
        for claim, _owned in build_claims("demo", spec):
            cases.append((f"builder-{label}-claim-{claim['metadata']['name']}", claim))
    return sorted(dict(cases).items())


def _chart_cases() -> list[tuple[str, dict[str, Any] | None]]:
    helm = find_tool("helm")
    if helm is None:
        return [("chart-helm-missing", None)]
    cases: list[tuple[str, dict[str, Any] | None]] = []
    value_sets = (("default", ()), ("ci", ("-f", str(CI_VALUES))),
                  ("namespace", ("--set", "scope=namespace")))
    for label, extra in value_sets:
        for obj in render(helm, *extra):
            cases.append((f"chart-{label}-{obj['kind']}-{obj['metadata']['name']}", obj))
    return cases


CASES = _chart_cases() + _builder_cases()


@pytest.mark.parametrize("obj", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_kubernetes_validate_strict(obj: dict[str, Any] | None) -> None:
    if obj is None:
        require_tool("helm")  # skips, or fails under CI
        return
    if obj["kind"] in VENDORED:
        crd = VENDORED[obj["kind"]]
        schema = version_schema(crd, obj["apiVersion"].split("/")[-1])
        assert structural_errors(schema, obj) == []
        assert cel_failures(schema, obj) == []
        return
    if obj["kind"] in OTHER_CHECKS:
        pytest.skip(f"{obj['kind']}: {OTHER_CHECKS[obj['kind']]}")
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_vendored_schemas_reject_a_wrong_object() -> None:
    """The vendored-CRD check can fail: an unknown field and a missing required one are errors."""
    schema = version_schema(VENDORED["InferencePool"], "v1")
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "p"},
            "spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 8000}],
                     "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}
    assert structural_errors(schema, pool) == []
    assert structural_errors(schema, {**pool, "spec": {**pool["spec"], "extensionRef": {"name": "x"}}})
    assert structural_errors(schema, {**pool, "spec": {"selector": {"matchLabels": {"a": "b"}}}})
    no_port = {**pool, "spec": {**pool["spec"], "endpointPickerRef": {"name": "epp"}}}
    assert cel_failures(schema, no_port)


def test_multinode_spec_renders_a_leader_worker_set_instead_of_a_deployment() -> None:
    """The multi-node case above is a LeaderWorkerSet (so the LWS CRD's schema checked it), and the
    LWS schema can fail: an unknown field and a wrong restart policy are errors."""
    kinds = [c[1]["kind"] for c in CASES if c[0].startswith("builder-multinode-")]
    assert "LeaderWorkerSet" in kinds and "Deployment" not in kinds and kinds.count("PodTemplate") >= 2
    (lws,) = [c[1] for c in CASES if c[0].startswith("builder-multinode-LeaderWorkerSet-demo")
              and c[1]["kind"] == "LeaderWorkerSet"]
    schema = version_schema(VENDORED["LeaderWorkerSet"], "v1")
    group = lws["spec"]["leaderWorkerTemplate"]
    assert structural_errors(schema, {**lws, "spec": {**lws["spec"], "groupSize": 2}})
    bad = {**lws, "spec": {**lws["spec"], "leaderWorkerTemplate": {**group, "restartPolicy": "Always"}}}
    assert structural_errors(schema, bad)


def test_validator_rejects_unknown_and_mistyped_fields() -> None:
    """The check above can fail: strict mode rejects an unknown field and a wrong type."""
    good = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"a": "b"}}
    kubernetes_validate.validate(good, KUBERNETES_VERSION, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({**good, "spec": {}}, KUBERNETES_VERSION, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({**good, "data": {"a": 1}}, KUBERNETES_VERSION, strict=True)


def test_kubernetes_135_schemas_are_available() -> None:
    """1.35 has its own schemas (kubernetes-validate would otherwise silently use an older version's)."""
    assert KUBERNETES_VERSION in kubernetes_validate.utils.all_versions()
