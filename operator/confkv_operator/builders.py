"""Pure builders: a validated spec in, Kubernetes object dicts out (no I/O, no Kopf).

Names: the Deployment (or, for ``nodes > 1``, the LeaderWorkerSet), Service, PodDisruptionBudget,
NetworkPolicy, ServiceMonitor, PrometheusRule, HPA/ScaledObject and InferencePool carry the CR's
name; the ConfigMap is ``<name>-config``; the metrics Service ``<name>-metrics``; the agent's
ServiceAccount, Role and RoleBinding are ``<name>-agent``.
"""

from __future__ import annotations

import json
from typing import Any

from confkv_api.config import ConfKVConfig, dump_config
from confkv_api.deployment import DeploymentSpec

from . import names as n
from .groups import LWS_KIND, build_leader_worker_set
from .monitoring import build_prometheus_rule
from .network import build_metrics_service, build_network_policy, build_service, build_service_monitor
from .pod import build_deployment
from .rbac import AGENT_RULES
from .scaling import build_autoscaler, build_inference_pool
from .settings import OperatorSettings

Obj = dict[str, Any]


def engine_config(spec: DeploymentSpec) -> ConfKVConfig:
    """confkv.json: the CR's five config sections plus the fields the operator owns inside the pod."""
    engine = spec.engine_section().model_copy(update={
        "host": "0.0.0.0",  # the Service reaches the engine over the pod network
        "grpc_socket": f"{n.SOCKET_DIR}/engine.sock",  # shared emptyDir, never on the network
        "cache_dir": spec.cache_storage.mount_path,
        "api_key": None,
        # The whole group's degree: nodes x gpusPerPod on GPU pods (DeploymentSpec.tensor_parallel_degree).
        "tensor_parallel": spec.tensor_parallel_degree,
    })
    return ConfKVConfig(model=spec.model, engine=engine, confkv=spec.confkv, alerts=spec.alerts,
                        remediation=spec.remediation)


def _meta(name: str, owner_name: str) -> Obj:
    return {"name": name, "labels": n.common_labels(owner_name)}


def build_config_map(name: str, spec: DeploymentSpec) -> Obj:
    document = json.dumps(dump_config(engine_config(spec)), indent=2, sort_keys=True)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(n.config_map_name(name), name),
            "data": {n.CONFIG_FILE: document}}


def build_service_account(name: str) -> Obj:
    # No automount for any pod using the account: only the agent container mounts a token (pod.py).
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(n.agent_account_name(name), name),
            "automountServiceAccountToken": False}


def build_role(name: str) -> Obj:
    rules = [dict(rule) for rule in AGENT_RULES]
    for rule in rules:
        if n.PLURAL in rule["resources"]:
            rule["resourceNames"] = [name]  # the agent reads its own CR only
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _meta(n.agent_account_name(name), name), "rules": rules}


def build_role_binding(name: str, namespace: str) -> Obj:
    account = n.agent_account_name(name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(account, name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
    }


def build_pdb(name: str) -> Obj:
    # maxUnavailable (not minAvailable) so a single-replica deployment never blocks a node drain.
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(name, name),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": n.selector_labels(name)}}}


#: Kinds from optional CRDs the operator renders when the cluster serves them.
OPTIONAL_KINDS = frozenset({"ServiceMonitor", "PrometheusRule", "ScaledObject", "InferencePool", LWS_KIND})


def build_workload(name: str, spec: DeploymentSpec, settings: OperatorSettings,
                   served: frozenset[str], native_sidecars: bool) -> Obj | None:
    """The Deployment, or for ``nodes > 1`` the LeaderWorkerSet (None when its API is not served:
    the status says so, ``status.missing_api_status``)."""
    if spec.nodes == 1:
        return build_deployment(name, spec, settings, native_sidecars)
    if LWS_KIND in served:
        return build_leader_worker_set(name, spec, settings, native_sidecars)
    return None


def build_children(name: str, namespace: str, spec: DeploymentSpec, settings: OperatorSettings,
                   served: frozenset[str] = frozenset(), native_sidecars: bool = True) -> list[Obj]:
    """Every child of one CR, in creation order (claims excluded: ``build_claims``). ``served`` holds
    the optional kinds whose CRDs exist (``OPTIONAL_KINDS``); ``native_sidecars``: the cluster runs
    init containers with ``restartPolicy: Always``."""
    workload = build_workload(name, spec, settings, served, native_sidecars)
    children = [
        build_config_map(name, spec),
        build_service_account(name),
        build_role(name),
        build_role_binding(name, namespace),
        *([workload] if workload is not None else []),
        build_service(name, spec),
        build_metrics_service(name, spec, settings),
        build_pdb(name),
    ]
    if spec.network_policy.enabled:
        children.append(build_network_policy(name, spec, settings))
    if spec.monitoring.enabled and "ServiceMonitor" in served:
        children.append(build_service_monitor(name, spec, settings))
    if spec.monitoring.enabled and "PrometheusRule" in served:
        on_cpu = spec.engine.device == "cpu" or spec.resources.gpus_per_pod == 0
        rule = build_prometheus_rule(name, spec.alerts, on_cpu=on_cpu, namespace=namespace)
        rule["metadata"]["labels"] = {**settings.monitoring_labels, **spec.monitoring.labels,
                                      **n.common_labels(name)}
        children.append(rule)
    autoscaler = build_autoscaler(name, namespace, spec, served)
    if autoscaler is not None:
        children.append(autoscaler)
    if spec.inference_pool.enabled and "InferencePool" in served:
        children.append(build_inference_pool(name, spec))
    return children
