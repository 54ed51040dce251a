"""Pure builder of the serving Deployment: engine container, agent sidecar, volumes, probes, security."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from confkv_api.config import DeploymentSpec

from . import names as n
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


def _engine_container(name: str, spec: DeploymentSpec, settings: OperatorSettings) -> dict[str, Any]:
    mounts = [
        {"name": "config", "mountPath": n.CONFIG_DIR, "readOnly": True},
        {"name": "socket", "mountPath": n.SOCKET_DIR},
        {"name": "cache", "mountPath": spec.cache_storage.mount_path},
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
        "env": _env(name),
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
        ],
    }


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


def _cache_volume(spec: DeploymentSpec) -> dict[str, Any]:
    storage = spec.cache_storage
    if storage.type == "pvc":
        return {"name": "cache", "persistentVolumeClaim": {"claimName": storage.claim_name}}
    if storage.type == "hostPath":
        return {"name": "cache", "hostPath": {"path": storage.host_path, "type": "DirectoryOrCreate"}}
    return {"name": "cache", "emptyDir": {"sizeLimit": storage.size} if storage.size else {}}


def _volumes(name: str, spec: DeploymentSpec) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        # Mounted as a directory (no subPath) so ConfigMap updates reach running pods.
        {"name": "config", "configMap": {"name": n.config_map_name(name)}},
        {"name": "socket", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        _cache_volume(spec),
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
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": n.RUN_AS_USER, "runAsGroup": n.RUN_AS_USER,
            "fsGroup": n.RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_engine_container(name, spec, settings), _agent_container(name, spec, settings)],
        "volumes": _volumes(name, spec),
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
