"""Pure builder of the serving Deployment: engine container, agent sidecar, volumes, probes, security.

The agent is a native sidecar (an init container with ``restartPolicy: Always``, Kubernetes 1.29+) unless
the cluster is older or ``pod.nativeSidecar`` is false; it has no readiness probe in either form, so
only the engine's readiness decides whether the pod receives traffic (a stalled agent is restarted by
its liveness probe, never takes a healthy engine out of the Service).

The engine image is ``spec.image.engine``, else the operator's CUDA image for a pod with a GPU, else
its CPU image. The engine's termination message falls back to its log tail, so a start-up failure
(``device cuda requested but ...``) reaches the CR's conditions.

``progressDeadlineSeconds`` covers a first start: the model download (with ``model.hfId``), the
startup probe's 30 minutes of loading and the image pulls, so a slow first start reads as Progressing.

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
from .overrides import merge_template
from .settings import OperatorSettings

_HTTP_PORT = "http"
_AGENT_PORT = "agent-http"
STARTUP_PERIOD_SECONDS = 10
STARTUP_FAILURES = 180  # x 10 s: a 32B model may load for up to 30 minutes
DOWNLOAD_ALLOWANCE_SECONDS = 3600  # ~65 GB at ~20 MB/s, the slow end of a Hugging Face download
PULL_ALLOWANCE_SECONDS = 600  # scheduling and pulling a multi-GB CUDA image
#: /dev/shm of a tensor-parallel pod without pod.shmSize (memory-backed: it counts against the pod's
#: memory). vLLM's and KServe's multi-GPU examples mount a few GiB; NCCL's buffers need far less.
TP_SHM_SIZE = "2Gi"

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


def shm_size(spec: DeploymentSpec) -> str | None:
    """The /dev/shm emptyDir's size: ``pod.shmSize``, else ``TP_SHM_SIZE`` for a pod whose ranks talk
    to each other (NCCL's intra-node transport and gloo use shared memory), else none."""
    if spec.pod.shm_size:
        return spec.pod.shm_size
    return TP_SHM_SIZE if spec.tensor_parallel_degree > 1 else None


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
    env += [var.model_dump(by_alias=True, exclude_none=True) for var in spec.pod.env]
    return env


def engine_image(spec: DeploymentSpec, settings: OperatorSettings) -> str:
    if spec.image.engine:
        return spec.image.engine
    return settings.engine_cuda_image if spec.resources.gpus_per_pod > 0 else settings.engine_image


def progress_deadline(spec: DeploymentSpec) -> int:
    """Seconds a rollout may go without progress before the Deployment reports it stuck."""
    if spec.progress_deadline_seconds is not None:
        return spec.progress_deadline_seconds
    download = DOWNLOAD_ALLOWANCE_SECONDS if spec.model.hf_id else 0
    return download + STARTUP_PERIOD_SECONDS * STARTUP_FAILURES + PULL_ALLOWANCE_SECONDS


def _engine_mounts(spec: DeploymentSpec, settings: OperatorSettings) -> list[dict[str, Any]]:
    mounts = [
        {"name": "config", "mountPath": n.CONFIG_DIR, "readOnly": True},
        {"name": "socket", "mountPath": n.SOCKET_DIR},
        _cache_mount(spec, settings),
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if uses_model_volume(spec):
        mounts.append({"name": "model", "mountPath": spec.model_storage.mount_path, "readOnly": True})
    if shm_size(spec):
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    mounts += [m.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True) | {"name": m.name}
               for m in spec.pod.volume_mounts]
    return mounts


def _engine_container(name: str, spec: DeploymentSpec, settings: OperatorSettings) -> dict[str, Any]:
    probe = {"httpGet": {"port": _HTTP_PORT}, "periodSeconds": STARTUP_PERIOD_SECONDS, "timeoutSeconds": 5}
    container = {
        "name": n.ENGINE_CONTAINER,
        "image": engine_image(spec, settings),
        "imagePullPolicy": spec.image.pull_policy,
        "command": ["confkv-engine", "--config", f"{n.CONFIG_DIR}/{n.CONFIG_FILE}"],
        "ports": [{"name": _HTTP_PORT, "containerPort": spec.engine.port, "protocol": "TCP"}],
        "env": _engine_env(name, spec),
        # Loading a 32B model takes minutes: the startup probe holds liveness off for up to 30 minutes.
        "startupProbe": {**_probe(probe, "/health"), "failureThreshold": STARTUP_FAILURES},
        "readinessProbe": {**_probe(probe, "/ready"), "failureThreshold": 3},
        "livenessProbe": {**_probe(probe, "/health"), "failureThreshold": 6},
        "securityContext": _CONTAINER_SECURITY,
        "volumeMounts": _engine_mounts(spec, settings),
        "terminationMessagePolicy": "FallbackToLogsOnError",
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
        # No readiness probe: the engine's readiness alone decides whether the pod takes traffic.
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
        "image": engine_image(spec, settings),
        "imagePullPolicy": spec.image.pull_policy,
        "command": ["hf", "download", spec.model.hf_id, "--local-dir", spec.model.source],
        "env": env,
        "terminationMessagePolicy": "FallbackToLogsOnError",
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
    size = shm_size(spec)
    if size:
        # NCCL and PyTorch's shared-memory tensors outgrow the runtime's 64 MiB /dev/shm.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}})
    return volumes + [dict(volume) for volume in spec.pod.volumes]


def _containers(name: str, spec: DeploymentSpec, settings: OperatorSettings,
                native_sidecars: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(init containers, containers): the fetch first (the agent has nothing to watch before the
    model is on disk), then the agent as a native sidecar where the cluster runs them."""
    init = [_fetch_container(spec, settings)] if spec.model.hf_id else []
    agent = _agent_container(name, spec, settings)
    if native_sidecars and spec.pod.native_sidecar:
        return [*init, {**agent, "restartPolicy": "Always"}], [_engine_container(name, spec, settings)]
    return init, [_engine_container(name, spec, settings), agent]


def _scheduling(spec: DeploymentSpec) -> dict[str, Any]:
    pod: dict[str, Any] = {}
    if spec.resources.node_selector:
        pod["nodeSelector"] = dict(spec.resources.node_selector)
    if spec.resources.tolerations:
        pod["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True)
                              for t in spec.resources.tolerations]
    if spec.pod.affinity:
        pod["affinity"] = dict(spec.pod.affinity)
    if spec.pod.runtime_class_name:
        pod["runtimeClassName"] = spec.pod.runtime_class_name
    if spec.pod.priority_class_name:
        pod["priorityClassName"] = spec.pod.priority_class_name
    if spec.pod.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": secret} for secret in spec.pod.image_pull_secrets]
    return pod


def _pod_spec(name: str, spec: DeploymentSpec, settings: OperatorSettings,
              native_sidecars: bool) -> dict[str, Any]:
    init, containers = _containers(name, spec, settings, native_sidecars)
    pod: dict[str, Any] = {
        "serviceAccountName": n.agent_account_name(name),
        "automountServiceAccountToken": False,  # only the agent container mounts a token (see above)
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": n.RUN_AS_USER, "runAsGroup": n.RUN_AS_USER,
            "fsGroup": n.RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": containers,
        "volumes": _volumes(name, spec, settings),
    }
    if init:
        pod["initContainers"] = init
    return {**pod, **_scheduling(spec)}


def pod_template(name: str, spec: DeploymentSpec, settings: OperatorSettings,
                 native_sidecars: bool = True) -> dict[str, Any]:
    """The serving pod's template (engine and agent), ``spec.pod.template`` merged over it: the
    Deployment's, and the start of a LeaderWorkerSet's leader and worker templates (``groups``)."""
    template = {
        "metadata": {
            "labels": {**spec.pod.labels, **n.common_labels(name)},
            "annotations": {**spec.pod.annotations, n.RESTART_CHECKSUM_ANNOTATION: restart_checksum(spec)},
        },
        "spec": _pod_spec(name, spec, settings, native_sidecars),
    }
    return merge_template(template, spec.pod.template) if spec.pod.template else template


def build_deployment(name: str, spec: DeploymentSpec, settings: OperatorSettings,
                     native_sidecars: bool = True) -> dict[str, Any]:
    """The serving Deployment. Policy sections never reach the template (they are applied live).
    ``native_sidecars``: the cluster runs init containers with ``restartPolicy: Always`` (1.29+)."""
    # A GPU pod cannot surge onto a full node: replace pods one at a time instead.
    strategy = ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
                if spec.resources.gpus_per_pod > 0 else
                {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}})
    template = pod_template(name, spec, settings, native_sidecars)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": n.common_labels(name)},
        "spec": {
            # With autoscaling the HPA or KEDA scale the CR (its scale subresource): the count arrives here.
            "replicas": spec.replicas,
            "selector": {"matchLabels": n.selector_labels(name)},
            "strategy": strategy,
            "progressDeadlineSeconds": progress_deadline(spec),
            "template": template,
        },
    }
