"""The scheduler's node filters a pod template must pass, as pure functions: nodeSelector, required node
affinity (In, NotIn, Exists, DoesNotExist, Gt, Lt) and taints against tolerations (NoSchedule and
NoExecute). Resources, pod affinity and topology spread are not evaluated (the emulator runs no
scheduler); a test that uses this says which filters it relies on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Obj = Mapping[str, Any]


def _expression(labels: Mapping[str, str], expr: Obj) -> bool:
    key, op, values = expr["key"], expr["operator"], list(expr.get("values") or [])
    present = key in labels
    if op == "In":
        return present and labels[key] in values
    if op == "NotIn":
        return not present or labels[key] not in values
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt"):
        try:
            have, bound = int(labels[key]), int(values[0])
        except (KeyError, ValueError, IndexError):
            return False  # a missing or non-integer label never matches Gt/Lt, as in the scheduler
        return have > bound if op == "Gt" else have < bound
    raise ValueError(f"unknown operator {op!r}")


def _affinity(labels: Mapping[str, str], pod: Obj) -> bool:
    required = (((pod.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    if not required:
        return True
    # Terms are ORed; the expressions of one term are ANDed.
    return any(all(_expression(labels, e) for e in term.get("matchExpressions") or [])
               for term in required.get("nodeSelectorTerms") or [])


def _tolerated(taint: Obj, tolerations: Sequence[Obj]) -> bool:
    for tol in tolerations:
        if tol.get("effect") and tol["effect"] != taint.get("effect"):
            continue
        if tol.get("operator") == "Exists" and (not tol.get("key") or tol["key"] == taint["key"]):
            return True
        if tol.get("key") == taint["key"] and tol.get("value") == taint.get("value"):
            return True
    return False


def fits(pod: Obj, node_labels: Mapping[str, str], taints: Sequence[Obj] = ()) -> bool:
    """Whether a pod spec passes the node's label and taint filters."""
    selector = pod.get("nodeSelector") or {}
    if any(node_labels.get(k) != v for k, v in selector.items()):
        return False
    if not _affinity(node_labels, pod):
        return False
    blocking = [t for t in taints if t.get("effect") in ("NoSchedule", "NoExecute")]
    return all(_tolerated(t, pod.get("tolerations") or []) for t in blocking)
