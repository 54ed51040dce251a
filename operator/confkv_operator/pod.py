"""Pure builder of the serving Deployment: engine container, agent sidecar, volumes, probes, security.

Credentials: the pod does not automount its service account token. The engine serves the network and
never talks to the Kubernetes API, so it gets no token; the agent (Events, its pod's annotation) gets a
projected, expiring token volume at the standard path, which the kubernetes client's in-cluster loader
reads and refreshes. The OpenAI API key, when ``engine.apiKeySecretRef`` names one, reaches the engine
only as ``CONFKV_API_KEY`` from the Secret (never through the ConfigMap).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from confkv_api.deployment import DeploymentSpec

from . import names as n
from .hostpaths import split_host_path
from .settings import OperatorSettings

_HTTP_PORT = "http"
_AGENT_PORT = "agent-http"

_CONTAINER_SECURITY = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def restart_checksum(spec: DeploymentSpec) -> str:
    """Hash of the restart-only fields that reach the pod only through confkv.json (policy excluded)."""
    doc = {"model": spec.model.model_dump(mode="json", by_alias=True),
           "engine": spec.engine.model_dump(mode="json", by_alias=True)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def uses_model_volume(spec: DeploymentSpec) -> bool:
    return bool(spec.model.hf_id or spec.model_storage.claim_name)


def _env(name: str) -> list[dict[str, Any]]:
    field = {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    return [
        *({"name": key, "valueFrom": {"fieldRef": {"fieldPath": path}}} for key, path in field.items()),
        {"name": "CONFKV_DEPLOYMENT", "value": name},
        {"name": "HOME", "value": "/tmp"},
    ]


def _resources(spec: DeploymentSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("requests", "limits"):
        quantities = getattr(spec.resources, kind).model_dump(exclude_none=True)
        if quantities:
            out[kind] = quantities
    if spec.resources.gpus_per_pod > 0:
        out.setdefault("limits", {})["nvidia.com/gpu"] = str(spec.resources.gpus_per_pod)
    return out


def _cache_mount(spec: DeploymentSpec, settings: OperatorSettings) -> dict[str, Any]:
    mount = {"name": "cache", "mountPath": spec.cache_storage.mount_path}
    if spec.cache_storage.type == "hostPath":
        _, sub_path = split_host_path(spec.cache_storage.host_path or "", settings.host_path_prefixes)
        if sub_path:
            mount["subPath"] = sub_path  # resolved by the kubelet inside the allowed directory
    return mount


def _engine_env(name: str, spec: DeploymentSpec) -> list[dict[str, Any]]:
    env = _env(name)
    ref = spec.engine.api_key_secret_ref
    if ref is not None:
        env.append({"name": "CONFKV_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env


def _engine_container(name: str, spec: DeploymentSpec, settings: OperatorSettings) -> dict[str, Any]:
    mounts = [
        {"name": "config", "mountPath": n.CONFIG_DIR, "readOnly": True},
        {"name": "socket", "mountPath": n.SOCKET_DIR},
        _cache_mount(spec, settings),
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if uses_model_volume(spec):
        mounts.append({"name": "model", "mountPath": spec.model_storage.mount_path, "readOnly": True})
    probe = {"httpGet": {"port": _HTTP_PORT}, "periodSeconds": 10, "timeoutSeconds": 5}
    container = {
        "name": n.ENGINE_CONTAINER,
        "image": spec.image.engine or settings.engine_image,
        "imagePullPolicy": spec.image.pull_policy,
        "command": ["confkv-engine", "--config", f"{n.CONFIG_DIR}/{n.CONFIG_FILE}"],
        "ports": [{"name": _HTTP_PORT, "containerPort": spec.engine.port, "protocol": "TCP"}],
        "env": _engine_env(name, spec),
        # Loading a 32B model takes minutes: the startup probe holds liveness off for up to 30 minutes.
        "startupProbe": {**_probe(probe, "/health"), "failureThreshold": 180},
        "readinessProbe": {**_probe(probe, "/ready"), "failureThreshold": 3},
        "livenessProbe": {**_probe(probe, "/health"), "failureThreshold": 6},
        "securityContext": _CONTAINER_SECURITY,
        "volumeMounts": mounts,
    }
    resources = _resources(spec)
    if resources:
        container["resources"] = resources
    return container


def _probe(base: dict[str, Any], path: str) -> dict[str, Any]:
    return {**base, "httpGet": {**base["httpGet"], "path": path}}


def _agent_container(name: str, spec: DeploymentSpec, settings: OperatorSettings) -> dict[str, Any]:
    probe = {"httpGet": {"port": _AGENT_PORT, "path": "/health"}, "periodSeconds": 10, "timeoutSeconds": 5}
    return {
        "name": n.AGENT_CONTAINER,
        "image": spec.image.agent or settings.agent_image_or_default,
        "imagePullPolicy": spec.image.pull_policy,
        "command": ["confkv-agent", "--config", f"{n.CONFIG_DIR}/{n.CONFIG_FILE}"],
        "ports": [{"name": _AGENT_PORT, "containerPort": settings.agent_port, "protocol": "TCP"}],
        "env": [*_env(name), {"name": "CONFKV_AGENT_PORT", "value": str(settings.agent_port)}],
        "readinessProbe": probe,
        "livenessProbe": {**probe, "failureThreshold": 6},
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": _CONTAINER_SECURITY,
        "volumeMounts": [
            {"name": "config", "mountPath": n.CONFIG_DIR, "readOnly": True},
            {"name": "socket", "mountPath": n.SOCKET_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": n.API_TOKEN_VOLUME, "mountPath": n.API_TOKEN_DIR, "readOnly": True},
        ],
    }


def _api_token_volume() -> dict[str, Any]:
    """What the kubelet would automount (token, cluster CA, namespace), for the agent container only."""
    return {"name": n.API_TOKEN_VOLUME, "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": n.API_TOKEN_SECONDS}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace",
                                    "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
    ]}}


def _fetch_container(spec: DeploymentSpec, settings: OperatorSettings) -> dict[str, Any]:
    """Downloads ``model.hfId`` into ``model.source`` on the model volume (skips files already there)."""
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": "/tmp/hf"}, {"name": "HOME", "value": "/tmp"}]
    if spec.model.token_secret_ref:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": spec.model.token_secret_ref, "key": "token"}}})
    return {
        "name": n.FETCH_CONTAINER,
        "image": spec.image.engine or settings.engine_image,
        "imagePullPolicy": spec.image.pull_policy,
        "command": ["hf", "download", spec.model.hf_id, "--local-dir", spec.model.source],
        "env": env,
        "securityContext": _CONTAINER_SECURITY,
        "volumeMounts": [
            {"name": "model", "mountPath": spec.model_storage.mount_path},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


def _cache_volume(spec: DeploymentSpec, settings: OperatorSettings) -> dict[str, Any]:
    storage = spec.cache_storage
    if storage.type == "pvc":
        return {"name": "cache", "persistentVolumeClaim": {"claimName": storage.claim_name}}
    if storage.type == "hostPath":
        # The allowed directory itself, which must exist: nothing is created on the node outside it.
        root, _ = split_host_path(storage.host_path or "", settings.host_path_prefixes)
        return {"name": "cache", "hostPath": {"path": root, "type": "Directory"}}
    return {"name": "cache", "emptyDir": {"sizeLimit": storage.size} if storage.size else {}}


def _volumes(name: str, spec: DeploymentSpec, settings: OperatorSettings) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        # Mounted as a directory (no subPath) so ConfigMap updates reach running pods.
        {"name": "config", "configMap": {"name": n.config_map_name(name)}},
        {"name": "socket", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        _cache_volume(spec, settings),
        _api_token_volume(),
    ]
    if uses_model_volume(spec):
        claim = spec.model_storage.claim_name
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim}} if claim else
                       {"name": "model", "emptyDir": {"sizeLimit": spec.model_storage.size}
                        if spec.model_storage.size else {}})
    return volumes


def _pod_spec(name: str, spec: DeploymentSpec, settings: OperatorSettings) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "serviceAccountName": n.agent_account_name(name),
        "automountServiceAccountToken": False,  # only the agent container mounts a token (see above)
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": n.RUN_AS_USER, "runAsGroup": n.RUN_AS_USER,
            "fsGroup": n.RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_engine_container(name, spec, settings), _agent_container(name, spec, settings)],
        "volumes": _volumes(name, spec, settings),
    }
    if spec.model.hf_id:
        pod["initContainers"] = [_fetch_container(spec, settings)]
    if spec.resources.node_selector:
        pod["nodeSelector"] = dict(spec.resources.node_selector)
    if spec.resources.tolerations:
        pod["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True)
                              for t in spec.resources.tolerations]
    return pod


def build_deployment(name: str, spec: DeploymentSpec, settings: OperatorSettings) -> dict[str, Any]:
    """The serving Deployment. Policy sections never reach the template (they are applied live)."""
    # A GPU pod cannot surge onto a full node: replace pods one at a time instead.
    strategy = ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
                if spec.resources.gpus_per_pod > 0 else
                {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": n.common_labels(name)},
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": n.selector_labels(name)},
            "strategy": strategy,
            "template": {
                "metadata": {
                    "labels": n.common_labels(name),
                    "annotations": {n.RESTART_CHECKSUM_ANNOTATION: restart_checksum(spec)},
                },
                "spec": _pod_spec(name, spec, settings),
            },
        },
    }
