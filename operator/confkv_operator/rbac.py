"""RBAC as data: the chart renders the operator's ClusterRole from ``OPERATOR_RULES``, the builders render
the agent's Role from ``AGENT_RULES``, and tests compare both with the requests seen by the API emulator.

A Kubernetes subject can only grant permissions it holds (RBAC escalation prevention), so the operator's
ClusterRole is the union of what its own requests use (``OPERATOR_API_RULES``) and the agent Role it
creates (``AGENT_RULES``).
"""

from __future__ import annotations

from typing import Any

Rule = dict[str, Any]

GROUP = "confkv.io"
PLURAL = "confkvdeployments"

#: What the agent sidecar does in its own namespace: read and annotate its pod, post Events, read its CR.
AGENT_RULES: list[Rule] = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get"]},
]

#: What the operator's own requests use (Kopf's watches and patches, child create-or-patch, status).
OPERATOR_API_RULES: list[Rule] = [
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["list", "watch", "patch"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["patch"]},
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
     "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    {"apiGroups": [""], "resources": ["configmaps", "services", "serviceaccounts"],
     "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"],
     "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["monitoring.coreos.com"], "resources": ["servicemonitors", "prometheusrules"],
     "verbs": ["get", "create", "patch"]},
]


def expand(rules: list[Rule]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples of a rule list."""
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def merge(*rule_lists: list[Rule]) -> list[Rule]:
    """One rule per (apiGroup, resource), verbs sorted: a stable, minimal ClusterRole."""
    verbs: dict[tuple[str, str], set[str]] = {}
    for group, resource, verb in expand([r for rules in rule_lists for r in rules]):
        verbs.setdefault((group, resource), set()).add(verb)
    return [
        {"apiGroups": [group], "resources": [resource], "verbs": sorted(vs)}
        for (group, resource), vs in sorted(verbs.items())
    ]


#: The operator's ClusterRole rules (rendered by the Helm chart).
OPERATOR_RULES: list[Rule] = merge(OPERATOR_API_RULES, AGENT_RULES)
