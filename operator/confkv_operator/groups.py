"""Pure builder of the LeaderWorkerSet that serves a CR with ``spec.nodes > 1`` (instead of the
Deployment): ``replicas`` groups of ``nodes`` pods, each group one tensor-parallel process group of
``nodes x gpusPerPod`` ranks (no pipeline stages).

The LeaderWorkerSet controller (leaderworkerset.x-k8s.io/v1, https://lws.sigs.k8s.io) creates the
pods and gives every container ``LWS_LEADER_ADDRESS`` (the leader pod's DNS name through the
group's headless Service), ``LWS_GROUP_SIZE`` and ``LWS_WORKER_INDEX`` (0 for the leader). Both
templates start the engine with the same config and ``--nnodes <nodes> --node-rank
$(LWS_WORKER_INDEX) --master-addr $(LWS_LEADER_ADDRESS) --master-port 29500 --join-timeout S``
(Kubernetes expands ``$(VAR)`` from the container's environment; ``join_timeout``):

- the leader (rank 0) is the serving pod of a Deployment: engine with probes and the HTTP port,
  the agent sidecar, plus the rendezvous port where the other nodes meet it; labelled
  ``confkv.io/role: leader``, which the Services and the InferencePool select;
- a worker serves nothing: the engine container only (no agent, no API token, no probes: it has no
  HTTP server), which follows rank 0 and exits when the group is lost.

``RecreateGroupOnPodRestart``: a group with a restarted pod can never step again (its ranks lost
their process group), so LWS recreates the whole group, as vLLM's LWS examples do.
"""

from __future__ import annotations

import copy
from typing import Any

from confkv_api.deployment import DeploymentSpec

from . import names as n
from .pod import DOWNLOAD_ALLOWANCE_SECONDS, pod_template
from .settings import OperatorSettings

Obj = dict[str, Any]
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
#: The group's rendezvous on the leader (torchrun's default port; the engine's --master-port).
RENDEZVOUS_PORT = 29500
ROLE_LABEL = "confkv.io/role"
JOIN_SECONDS = 600  # image pulls and scheduling of a group's pods (the engine's default)
_PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def join_timeout(spec: DeploymentSpec) -> int:
    """Seconds the group's pods may take to meet: their image pulls and loads start together, but
    each pod downloads ``model.hfId`` on its own, so a download's spread is allowed for too."""
    return JOIN_SECONDS + (DOWNLOAD_ALLOWANCE_SECONDS if spec.model.hf_id else 0)


def node_flags(spec: DeploymentSpec) -> list[str]:
    """The engine's place in the group, from the variables the LWS controller sets."""
    return ["--nnodes", str(spec.nodes), "--node-rank", "$(LWS_WORKER_INDEX)",
            "--master-addr", "$(LWS_LEADER_ADDRESS)", "--master-port", str(RENDEZVOUS_PORT),
            "--join-timeout", str(join_timeout(spec))]


def serving_selector(name: str, spec: DeploymentSpec) -> dict[str, str]:
    """Labels of the pods that serve HTTP: every pod of a Deployment, only the leaders of groups."""
    labels = n.selector_labels(name)
    return {**labels, ROLE_LABEL: "leader"} if spec.nodes > 1 else labels


def _engine(pod: Obj) -> Obj:
    (engine,) = [c for c in pod["containers"] if c["name"] == n.ENGINE_CONTAINER]
    return engine


def _role_template(name: str, spec: DeploymentSpec, settings: OperatorSettings, native_sidecars: bool,
                   role: str) -> Obj:
    template = copy.deepcopy(pod_template(name, spec, settings, native_sidecars))
    template["metadata"]["labels"][ROLE_LABEL] = role
    engine = _engine(template["spec"])
    engine["command"] = [*engine["command"], *node_flags(spec)]
    return template


def leader_template(name: str, spec: DeploymentSpec, settings: OperatorSettings,
                    native_sidecars: bool = True) -> Obj:
    template = _role_template(name, spec, settings, native_sidecars, "leader")
    engine = _engine(template["spec"])
    engine["ports"] = [*engine["ports"],
                       {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"}]
    return template


def worker_template(name: str, spec: DeploymentSpec, settings: OperatorSettings,
                    native_sidecars: bool = True) -> Obj:
    template = _role_template(name, spec, settings, native_sidecars, "worker")
    pod = template["spec"]
    pod["containers"] = [_engine(pod)]
    pod["initContainers"] = [c for c in pod.get("initContainers", []) if c["name"] != n.AGENT_CONTAINER]
    if not pod["initContainers"]:
        del pod["initContainers"]
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] != n.API_TOKEN_VOLUME]
    engine = _engine(pod)
    for key in (*_PROBES, "ports"):
        engine.pop(key, None)
    return template


def build_leader_worker_set(name: str, spec: DeploymentSpec, settings: OperatorSettings,
                            native_sidecars: bool = True) -> Obj:
    """The LeaderWorkerSet of a CR with ``nodes > 1`` (see the module docstring)."""
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": {"name": name, "labels": n.common_labels(name)},
        "spec": {
            # With autoscaling the HPA or KEDA scale the CR (its scale subresource): groups arrive here.
            "replicas": spec.replicas,
            "startupPolicy": "LeaderCreated",
            # A group holds several GPU nodes: replace one group at a time, never surge a second one.
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}},
            "leaderWorkerTemplate": {
                "size": spec.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader_template(name, spec, settings, native_sidecars),
                "workerTemplate": worker_template(name, spec, settings, native_sidecars),
            },
        },
    }
