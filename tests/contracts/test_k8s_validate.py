"""Rendered chart manifests and the operator's builder output through kubernetes-validate --strict (1.35).

kubernetes-validate ships the upstream OpenAPI schemas of built-in kinds only (v1.25 .. v1.37 in 1.37.0);
custom kinds it cannot know are skipped one by one with the reason and covered elsewhere (PrometheusRule
by promtool, ConfKVDeployment by the CRD schema tests).
"""

from __future__ import annotations

import sys
from typing import Any

import kubernetes_validate
import pytest
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

from confkv_api.deployment import DeploymentSpec, load_deployment_spec  # noqa: E402
from confkv_operator.builders import build_children  # noqa: E402
from confkv_operator.settings import OperatorSettings  # noqa: E402

OTHER_CHECKS = {
    "PrometheusRule": "no upstream schema; checked by promtool in test_prometheus_rules.py",
    "ServiceMonitor": "Prometheus Operator kind, no upstream schema; selector/ports checked in test_chart.py",
    "ClusterKopfPeering": "Kopf's own kind with no upstream schema; its CRD is validated instead",
    "ConfKVDeployment": "custom kind; validated against the CRD schema in test_crd_schema.py",
}
MONITORING = frozenset({"ServiceMonitor", "PrometheusRule"})
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


def _builder_cases() -> list[tuple[str, dict[str, Any]]]:
    specs = {"default": DeploymentSpec(), "gpu-hf": load_deployment_spec(GPU_SPEC)}
    for label, cr in example_crs():
        specs[f"example-{label}"] = load_deployment_spec(cr.get("spec", {}))
    cases = []
    for label, spec in specs.items():
        for obj in build_children("demo", "serving", spec, SETTINGS, monitoring=MONITORING):
            cases.append((f"builder-{label}-{obj['kind']}", obj))
    return cases


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
    if obj["kind"] in OTHER_CHECKS:
        pytest.skip(f"{obj['kind']}: {OTHER_CHECKS[obj['kind']]}")
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


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
