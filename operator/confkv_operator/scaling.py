"""Pure builders of the objects that scale and route a deployment's replicas: the autoscaler (an HPA,
or a KEDA ScaledObject) and the Gateway API Inference Extension's ``InferencePool``.

Autoscaling reads the engine's own gauges: the queue (requests waiting for a batch slot, per pod) and
the KV-cache usage (fraction of blocks in use), and the agent's scale-out recommendation
(``confkv_agent_scale_out_recommended``, 1 while the latency alert's remedies ran out and the cause
is load): a recommendation on every pod asks for twice the replicas, bounded by the scale-up policy,
so the agent's judgement feeds the autoscaler instead of duplicating it. The HPA takes them as Pods
metrics, which prometheus-adapter serves from Prometheus (docs/kubernetes.md gives its rules); the
ScaledObject asks Prometheus itself. Both target the ConfKVDeployment's scale subresource, so the
operator carries the replica count to the Deployment and nothing fights over it. GPU pods start in
minutes and cost a GPU each: scale-up adds one pod per five minutes, scale-down waits
``scaleDownStabilizationSeconds`` (15 minutes by default) and removes one pod per ten minutes.

The InferencePool selects the CR's pods on the engine's port and names the endpoint picker Service
(installed with the EPP's own chart), so a conformant gateway routes by prefix and load.
"""

from __future__ import annotations

from typing import Any

from confkv_api import metrics as m
from confkv_api.deployment import DeploymentSpec
from confkv_api.resources import CR_API_VERSION, CR_KIND

from . import names as n
from .groups import serving_selector

Obj = dict[str, Any]
SCALE_UP_PERIOD_SECONDS = 300
#: The recommendation gauge is 0 or 1 per pod: a mean of 1 against 0.5 asks for twice the replicas.
RECOMMENDATION_TARGET = 0.5
SCALE_DOWN_PERIOD_SECONDS = 600


def _meta(name: str) -> Obj:
    return {"name": name, "labels": n.common_labels(name)}


def _target(name: str) -> Obj:
    return {"apiVersion": CR_API_VERSION, "kind": CR_KIND, "name": name}


def _behavior(spec: DeploymentSpec) -> Obj:
    return {
        "scaleUp": {"stabilizationWindowSeconds": 60, "selectPolicy": "Max",
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": SCALE_UP_PERIOD_SECONDS}]},
        "scaleDown": {"stabilizationWindowSeconds": spec.autoscaling.scale_down_stabilization_seconds,
                      "selectPolicy": "Min",
                      "policies": [{"type": "Pods", "value": 1, "periodSeconds": SCALE_DOWN_PERIOD_SECONDS}]},
    }


def _milli(value: float) -> str:
    return f"{round(value * 1000)}m"


def build_hpa(name: str, spec: DeploymentSpec) -> Obj:
    scaling = spec.autoscaling

    def pods_metric(metric: str, average: str) -> Obj:
        return {"type": "Pods", "pods": {"metric": {"name": metric},
                                         "target": {"type": "AverageValue", "averageValue": average}}}

    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": _meta(name),
        "spec": {
            "scaleTargetRef": _target(name),
            "minReplicas": scaling.min_replicas, "maxReplicas": scaling.max_replicas,
            "metrics": [pods_metric(m.REQUESTS_WAITING, _milli(scaling.target_queue_depth)),
                        pods_metric(m.KV_CACHE_USAGE_RATIO, _milli(scaling.target_kv_cache_usage)),
                        pods_metric(m.AGENT_SCALE_OUT_RECOMMENDED, _milli(RECOMMENDATION_TARGET))],
            "behavior": _behavior(spec),
        },
    }


def build_scaled_object(name: str, namespace: str, spec: DeploymentSpec) -> Obj:
    scaling = spec.autoscaling
    selector = f'{{namespace="{namespace}", service="{name}"}}'
    queue = {"type": "prometheus", "metricType": "AverageValue", "metadata": {
        "serverAddress": scaling.prometheus_address,
        "query": f"sum({m.REQUESTS_WAITING}{selector})", "threshold": f"{scaling.target_queue_depth:g}"}}
    # The mean usage over the pods is compared as is (Value), not divided by the replica count.
    kv = {"type": "prometheus", "metricType": "Value", "metadata": {
        "serverAddress": scaling.prometheus_address,
        "query": f"avg({m.KV_CACHE_USAGE_RATIO}{selector})",
        "threshold": f"{scaling.target_kv_cache_usage:g}"}}
    agent = {"type": "prometheus", "metricType": "Value", "metadata": {
        "serverAddress": scaling.prometheus_address,
        "query": f"avg(max by (pod) ({m.AGENT_SCALE_OUT_RECOMMENDED}{selector}))",
        "threshold": f"{RECOMMENDATION_TARGET:g}"}}
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": _meta(name),
        "spec": {
            "scaleTargetRef": _target(name),
            "minReplicaCount": scaling.min_replicas, "maxReplicaCount": scaling.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(spec)}},
            "triggers": [queue, kv, agent],
        },
    }


def build_autoscaler(name: str, namespace: str, spec: DeploymentSpec, served: frozenset[str]) -> Obj | None:
    """The HPA or the ScaledObject the spec asks for; None when autoscaling is off or KEDA was asked for
    and its CRD is not served."""
    backend = spec.autoscaling.backend
    if not spec.autoscaling.enabled:
        return None
    if backend == "keda" or (backend == "auto" and "ScaledObject" in served):
        return build_scaled_object(name, namespace, spec) if "ScaledObject" in served else None
    return build_hpa(name, spec)


def build_inference_pool(name: str, spec: DeploymentSpec) -> Obj:
    picker = spec.inference_pool.endpoint_picker
    return {
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": _meta(name),
        "spec": {
            "selector": {"matchLabels": serving_selector(name, spec)},
            "targetPorts": [{"number": spec.engine.port}],
            "endpointPickerRef": {"name": picker.name or f"{name}-epp", "port": {"number": picker.port},
                                  "failureMode": picker.failure_mode},
        },
    }
