"""Pure status computation: the CR's ``status`` from the child Deployment and the agents' pod annotations.

Phases: Invalid (spec fails validation), Pending (no Deployment yet), Progressing (a rollout is under
way), Running (all replicas ready), Degraded (rollout finished or stuck, yet not all replicas ready, or
a pod fails in a way a human must fix: see ``podstatus``).

A rollout is under way while the Deployment's own ``Progressing`` condition says so (any reason but
``NewReplicaSetAvailable``); it is stuck only at ``ProgressDeadlineExceeded``, so a first start that
downloads and loads a large model reads Progressing (reason: the pods' stage) until the deadline the
operator sized for it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from . import names as n
from .podstatus import PodReport

Obj = Mapping[str, Any]
CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "InvalidSpec", "APIAuthenticated")


def _deployment_state(dep: Obj | None, desired: int) -> tuple[int, int, bool, str]:
    """(replicas, ready, progressing, reason) of the child Deployment."""
    if dep is None:
        return 0, 0, True, "Creating"
    st = dep.get("status") or {}
    replicas, ready = int(st.get("replicas") or 0), int(st.get("readyReplicas") or 0)
    updated = int(st.get("updatedReplicas") or 0)
    generation = dep.get("metadata", {}).get("generation")
    observed = st.get("observedGeneration")
    progress = next((c for c in st.get("conditions") or [] if c.get("type") == "Progressing"), {})
    if progress.get("reason") == "ProgressDeadlineExceeded":
        return replicas, ready, False, "ProgressDeadlineExceeded"
    if observed is None or (generation is not None and observed < generation):
        return replicas, ready, True, "RolloutPending"
    if updated < desired or replicas > desired:
        return replicas, ready, True, "RollingUpdate"
    if progress.get("status") == "True" and progress.get("reason") != "NewReplicaSetAvailable" \
            and ready < desired:
        return replicas, ready, True, "ReplicaSetUpdated"  # pods still starting, within the deadline
    return replicas, ready, False, "RolloutComplete"


def _condition(ctype: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {"type": ctype, "status": "True" if ok else "False", "reason": reason, "message": message,
            "observedGeneration": generation}


def merge_conditions(old: Sequence[Obj], new: list[dict[str, Any]], now: str) -> list[dict[str, Any]]:
    """Keep ``lastTransitionTime`` of conditions whose status did not change."""
    previous = {c.get("type"): c for c in old or []}
    out = []
    for cond in new:
        before = previous.get(cond["type"])
        same = before is not None and before.get("status") == cond["status"]
        stamp = before.get("lastTransitionTime") if same and before else None
        out.append({**cond, "lastTransitionTime": stamp or now})
    return out


def invalid_status(message: str, generation: int) -> dict[str, Any]:
    """Status fields for a spec that fails validation (the children are left as they were)."""
    return {
        "phase": "Invalid",
        "observedGeneration": generation,
        "conditions": [
            _condition("InvalidSpec", True, "ValidationFailed", message, generation),
            _condition("Ready", False, "InvalidSpec", "the spec does not validate", generation),
            _condition("Progressing", False, "InvalidSpec", "the spec does not validate", generation),
            _condition("Degraded", False, "InvalidSpec", "", generation),
        ],
    }


def missing_api_status(message: str, generation: int) -> dict[str, Any]:
    """Status fields for a valid spec whose workload kind the cluster does not serve (a
    LeaderWorkerSet without its CRD): nothing runs until it is installed; the resync retries."""
    reason = "LeaderWorkerSetNotInstalled"
    return {
        "phase": "Degraded",
        "observedGeneration": generation,
        "conditions": [
            _condition("Ready", False, reason, message, generation),
            _condition("Progressing", False, reason, message, generation),
            _condition("Degraded", True, reason, message, generation),
            _condition("InvalidSpec", False, "Valid", "", generation),
        ],
    }


def compute_status(name: str, namespace: str, port: int, model: str, desired: int, generation: int,
                   deployment: Obj | None, pods: PodReport | None = None,
                   selector: str | None = None) -> dict[str, Any]:
    """Status fields for a valid spec (conditions without timestamps; see ``merge_conditions``).
    ``deployment``: the workload (a Deployment, or a LeaderWorkerSet whose status has the same
    counts and a Progressing condition); ``pods``: the most telling finding about the pods
    (``podstatus.pods_report``); ``selector``: the serving pods (default: all of the CR's)."""
    replicas, ready, progressing, reason = _deployment_state(deployment, desired)
    all_ready = ready >= desired and not progressing
    failing = pods is not None and pods.failing and not all_ready
    degraded = failing or (not progressing and ready < desired)
    if all_ready:
        phase = "Running"
    elif degraded:
        phase = "Degraded"
    else:
        phase = "Pending" if deployment is None else "Progressing"
    counts = f"{ready}/{desired} replicas ready"
    stage = f"{counts}; {pods.message}" if pods is not None and not all_ready else counts
    if progressing and pods is not None and not pods.failing:
        reason = pods.reason
    degraded_reason = pods.reason if failing and pods else reason
    return {
        "phase": phase,
        "replicas": replicas,
        "readyReplicas": ready,
        "observedGeneration": generation,
        "endpoint": f"http://{name}.{namespace}.svc:{port}",
        "selector": selector or n.selector_string(name),
        "model": model,
        "conditions": [
            _condition("Ready", all_ready, "AllReplicasReady" if all_ready else "NotReady", counts,
                       generation),
            _condition("Progressing", progressing, reason, stage, generation),
            _condition("Degraded", degraded, degraded_reason if degraded else "AsExpected", stage,
                       generation),
            _condition("InvalidSpec", False, "Valid", "", generation),
        ],
    }


def open_api_message(name: str) -> str:
    return (f"the OpenAI API (/v1) of Service {name} accepts requests from anyone who can reach it on the "
            "cluster network: set spec.engine.apiKeySecretRef to a Secret key holding a bearer key")


def auth_condition(name: str, secret_key: tuple[str, str] | None, generation: int) -> dict[str, Any]:
    """``APIAuthenticated``: True when the engine requires a bearer key from (Secret, key)."""
    if secret_key is None:
        return _condition("APIAuthenticated", False, "NoAPIKey", open_api_message(name), generation)
    secret, key = secret_key
    return _condition("APIAuthenticated", True, "APIKeyFromSecret",
                      f"/v1 requires the bearer key in Secret {secret} (key {key})", generation)


def last_remediation(pods: Sequence[Obj]) -> dict[str, Any] | None:
    """The newest remediation any agent recorded in its pod's ``confkv.io/last-remediation`` annotation.
    Malformed annotations are ignored (an agent bug must not break the operator)."""
    newest: dict[str, Any] | None = None
    for pod in pods:
        meta = pod.get("metadata") or {}
        raw = (meta.get("annotations") or {}).get(n.LAST_REMEDIATION_ANNOTATION)
        if not raw:
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("time"), str):
            continue
        entry = {k: str(record[k]) for k in ("time", "alert", "action", "result", "message") if k in record}
        entry["pod"] = str(meta.get("name", ""))
        if newest is None or entry["time"] > newest["time"]:
            newest = entry
    return newest


def status_delta(current: Obj, desired: Obj) -> dict[str, Any]:
    """Only the top-level status fields that differ (avoids no-op writes and their watch events)."""
    return {key: value for key, value in desired.items() if current.get(key) != value}
