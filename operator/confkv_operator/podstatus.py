"""Pure reading of the serving pods: why a rollout is still under way, or why it is failing.

A first start on a GPU node takes long for known reasons (scheduling, pulling a CUDA image,
downloading the weights, loading them); the CR's ``Progressing`` condition names the stage the
slowest pod is in, so a normal start reads as Progressing, not Degraded. Failures a human must act on
(unschedulable pods, image pulls that fail, a missing Secret, an engine or download that exits) make
``Degraded`` True at once with the container's own termination message, e.g. the engine's
``device cuda requested but ...`` on a node without a usable GPU, instead of after the progress
deadline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import names as n

Obj = Mapping[str, Any]
_WAITING_FAILURES = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                               "CreateContainerConfigError", "CreateContainerError", "CrashLoopBackOff"})
_MESSAGE_LIMIT = 512


@dataclass(frozen=True)
class PodReport:
    """One finding: a condition reason and its message; ``failing`` means a human must act."""

    reason: str
    message: str
    failing: bool


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MESSAGE_LIMIT else text[:_MESSAGE_LIMIT - 3] + "..."


def _terminated_failure(pod: str, container: Obj) -> PodReport | None:
    # A past exit (lastState) matters only while the container has not recovered.
    keys = ("state",) if container.get("ready") else ("state", "lastState")
    for state_key in keys:
        done = (container.get(state_key) or {}).get("terminated")
        if done and int(done.get("exitCode") or 0) != 0:
            what = "model download" if container.get("name") == n.FETCH_CONTAINER else "engine"
            detail = done.get("message") or done.get("reason") or "no message"
            reason = "ModelDownloadFailed" if what == "model download" else "EngineExited"
            return PodReport(reason, _short(f"pod {pod}: {what} exited with code {done.get('exitCode')}: "
                                             f"{detail}"), True)
    return None


def _container_report(pod: str, container: Obj) -> PodReport | None:
    failed = _terminated_failure(pod, container)
    if failed:
        return failed
    waiting = (container.get("state") or {}).get("waiting") or {}
    if waiting.get("reason") in _WAITING_FAILURES:
        detail = waiting.get("message") or waiting["reason"]
        where = f"pod {pod}: container {container.get('name')}"
        return PodReport(str(waiting["reason"]), _short(f"{where}: {detail}"), True)
    if waiting.get("reason") in ("ContainerCreating", "PodInitializing"):
        return PodReport("PullingImages", f"pod {pod}: creating containers (pulling images)", False)
    return None


def _pod_report(pod: Obj) -> PodReport | None:
    name = str((pod.get("metadata") or {}).get("name", ""))
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return PodReport("Unschedulable", _short(f"pod {name}: {cond.get('message') or 'not scheduled'}"),
                             cond.get("reason") == "Unschedulable")
    containers = {c.get("name"): c for c in status.get("containerStatuses") or []}
    inits = {c.get("name"): c for c in status.get("initContainerStatuses") or []}
    for container in [*inits.values(), *containers.values()]:
        found = _container_report(name, container)
        if found:
            return found
    fetch = inits.get(n.FETCH_CONTAINER)
    if fetch and (fetch.get("state") or {}).get("running"):
        return PodReport("DownloadingModel", f"pod {name}: downloading the model (init container "
                         f"{n.FETCH_CONTAINER})", False)
    engine = containers.get(n.ENGINE_CONTAINER)
    if engine and (engine.get("state") or {}).get("running") and not engine.get("ready"):
        stage = "loading the model" if not engine.get("started") else "not ready"
        return PodReport("LoadingModel" if not engine.get("started") else "EngineNotReady",
                         f"pod {name}: engine {stage}", False)
    return None


def pods_report(pods: Sequence[Obj]) -> PodReport | None:
    """The finding that matters most across the pods: a failure first, else the earliest stage."""
    reports = [r for r in (_pod_report(p) for p in pods) if r is not None]
    failing = [r for r in reports if r.failing]
    if failing:
        return failing[0]
    order = ("Unschedulable", "PullingImages", "DownloadingModel", "LoadingModel", "EngineNotReady")
    reports.sort(key=lambda r: order.index(r.reason) if r.reason in order else len(order))
    return reports[0] if reports else None
