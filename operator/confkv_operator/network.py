"""Pure builders of what reaches the pods over the network: the API Service, the metrics Service
scraped by the ServiceMonitor, and the NetworkPolicy.

The API Service ``<name>`` carries only the engine's port, so clients (and a gateway) see the OpenAI
API alone. The headless Service ``<name>-metrics`` carries the engine's and the agent's ports for
Prometheus; the ServiceMonitor selects it by the ``confkv.io/metrics`` label and writes the CR's name
into the series' ``service`` label, which the alert rules and the dashboard select on.

The NetworkPolicy (``spec.networkPolicy``, on by default) admits the engine's port from the ``apiFrom``
peers (default: pods of the same namespace) and from the ``metricsFrom`` peers (default: the
``monitoring`` namespace; the engine serves /metrics on its API port), and the agent's port from the
``metricsFrom`` peers only; with ``nodes > 1`` the CR's own pods reach each other on every port
(the tensor-parallel group's rendezvous and collectives). Everything else is denied ingress; egress
is left alone (the fetch init container downloads from Hugging Face).
"""

from __future__ import annotations

from typing import Any

from confkv_api.deployment import DeploymentSpec

from . import names as n
from .groups import serving_selector
from .settings import OperatorSettings

Obj = dict[str, Any]
METRICS_LABEL = "confkv.io/metrics"


def _meta(name: str, owner: str, extra: dict[str, str] | None = None) -> Obj:
    return {"name": name, "labels": {**n.common_labels(owner), **(extra or {})}}


def build_service(name: str, spec: DeploymentSpec) -> Obj:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(name, name),
        "spec": {
            "type": "ClusterIP",
            "selector": serving_selector(name, spec),
            "ports": [{"name": "http", "port": spec.engine.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_metrics_service(name: str, spec: DeploymentSpec, settings: OperatorSettings) -> Obj:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(n.metrics_service_name(name), name, {METRICS_LABEL: "true"}),
        "spec": {
            "clusterIP": "None",  # Prometheus scrapes each pod; nothing balances over this Service
            "selector": serving_selector(name, spec),
            "ports": [
                {"name": "http", "port": spec.engine.port, "targetPort": "http", "protocol": "TCP"},
                {"name": "agent-http", "port": settings.agent_port, "targetPort": "agent-http",
                 "protocol": "TCP"},
            ],
        },
    }


def build_service_monitor(name: str, spec: DeploymentSpec, settings: OperatorSettings) -> Obj:
    relabel = [{"action": "replace", "targetLabel": "service", "replacement": name}]
    endpoints = [{"port": port, "path": "/metrics", "interval": spec.monitoring.interval,
                  "relabelings": relabel} for port in ("http", "agent-http")]
    labels = {**settings.monitoring_labels, **spec.monitoring.labels}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _meta(name, name, labels),
            "spec": {"selector": {"matchLabels": {**n.selector_labels(name), METRICS_LABEL: "true"}},
                     "endpoints": endpoints}}


def build_network_policy(name: str, spec: DeploymentSpec, settings: OperatorSettings) -> Obj:
    policy = spec.network_policy
    api_port = {"port": spec.engine.port, "protocol": "TCP"}
    agent_port = {"port": settings.agent_port, "protocol": "TCP"}
    rules = [{"from": [*policy.api_from, *policy.metrics_from], "ports": [api_port]}]
    if policy.metrics_from:
        rules.append({"from": list(policy.metrics_from), "ports": [agent_port]})
    if spec.nodes > 1:  # a group's ranks talk to each other on ports NCCL and gloo pick at run time
        rules.append({"from": [{"podSelector": {"matchLabels": n.selector_labels(name)}}]})
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(name, name),
        "spec": {"podSelector": {"matchLabels": n.selector_labels(name)}, "policyTypes": ["Ingress"],
                 "ingress": rules},
    }
