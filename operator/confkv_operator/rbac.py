"""RBAC as data: the chart renders the operator's ClusterRole (or, in the namespaced install, its Role)
from these lists, the builders render the agent's Role from ``AGENT_RULES``, and tests compare both with
the requests seen by the API emulator, verb by verb.

A Kubernetes subject can only grant permissions it holds (RBAC escalation prevention), so the operator's
rules are the union of what its own requests use (``OPERATOR_API_RULES``) and the agent Role it creates
(``AGENT_RULES``).

Verb by verb, what each permission is for:

- ``confkvdeployments`` list/watch: Kopf's watch; patch: Kopf's finalizer and progress annotations;
  ``/status`` patch: the status. No get (the watch delivers the bodies), no update, no delete.
- ``customresourcedefinitions`` list/watch: Kopf's scan for the CRD (cluster scope only; the namespaced
  install turns the scan off because a Role cannot grant a cluster-scoped resource).
- ``namespaces`` list/watch (``NAMESPACE_SCAN_RULES``): only when a cluster-scope operator watches a
  namespace list, so Kopf can expand globs and notice new namespaces.
- ``events`` create: Kopf's Warning Events (invalid spec, API open). No Event reads.
- ``pods`` list: the agents' last-remediation annotations for the status. No pod writes of its own.
- children (configmaps, services, serviceaccounts, deployments, poddisruptionbudgets, roles, rolebindings,
  networkpolicies, servicemonitors, prometheusrules, horizontalpodautoscalers, scaledobjects,
  inferencepools, leaderworkersets) get/create/patch: server-side apply (a PATCH; creating through it
  also needs create) with drift repair. Every child has an ownerReference and the garbage collector
  removes it with the CR; delete only on the children a spec can switch off (networkpolicies,
  servicemonitors, prometheusrules, horizontalpodautoscalers, scaledobjects, inferencepools, and the
  workload: deployments and leaderworkersets swap when ``spec.nodes`` crosses 1), and only those the
  CR controls.
- persistentvolumeclaims get/create/patch: claims the spec asks the operator to create, once (apply).
- pods get/patch and ``confkvdeployments`` get: held only to grant them to the agent (see below).

What RBAC cannot narrow for the agent (its per-CR Role narrows what it can):

- ``confkvdeployments`` get is limited to its own CR (``resourceNames: [<name>]``).
- pods get/patch cannot be limited to its own pods: a Deployment's pod names are generated
  (``<name>-<hash>-<suffix>``) and RBAC has no name prefixes or label selectors. The Role is per CR and
  per namespace, so an agent can read and patch pods of its own namespace only. The chart's optional
  ValidatingAdmissionPolicy (``agentPodGuard``) closes the rest: a request made with an agent's pod-bound
  token may change only that same pod, and only its ``confkv.io/last-remediation`` annotation. The policy
  recognises agents by a marker permission in their Role, ``get`` on ``confkvdeployments/agent`` (a
  subresource that does not exist), held by no one else but the operator (which must hold what it
  grants) and cluster admins; both can list ConfKVDeployments, which agents cannot, so neither is matched.
- events create cannot be narrowed at all (``resourceNames`` does not apply to create).
"""

from __future__ import annotations

from typing import Any

Rule = dict[str, Any]

GROUP = "confkv.io"
PLURAL = "confkvdeployments"
AGENT_MARKER = "agent"

#: What the agent sidecar does in its own namespace: read and annotate its pod, post Events, read its CR.
AGENT_RULES: list[Rule] = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get"]},
    # A marker, not an access: the subresource does not exist. The chart's admission policy asks the
    # authorizer for it to recognise an agent's token (see the module docstring).
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/{AGENT_MARKER}"], "verbs": ["get"]},
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
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"],
     "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"],
     "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["monitoring.coreos.com"], "resources": ["servicemonitors", "prometheusrules"],
     "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
     "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers"],
     "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": ["keda.sh"], "resources": ["scaledobjects"], "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
     "verbs": ["get", "create", "patch", "delete"]},
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


#: Cluster-scoped resources among the rules: a namespaced Role cannot grant them.
CLUSTER_SCOPED: frozenset[tuple[str, str]] = frozenset({
    ("apiextensions.k8s.io", "customresourcedefinitions"),
})

#: Kopf's namespace scan, needed when a cluster-scope operator watches a list of namespaces (globs).
NAMESPACE_SCAN_RULES: list[Rule] = [
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
]


def namespaced_only(rules: list[Rule]) -> list[Rule]:
    """``rules`` without the cluster-scoped resources (what the namespaced install's Role holds)."""
    return merge([
        {"apiGroups": [group], "resources": [resource], "verbs": [verb]}
        for group, resource, verb in expand(rules) if (group, resource) not in CLUSTER_SCOPED
    ])


#: The operator's ClusterRole rules (rendered by the Helm chart).
OPERATOR_RULES: list[Rule] = merge(OPERATOR_API_RULES, AGENT_RULES)
#: The namespaced install's Role rules (CONFKV_WATCH_SCOPE=namespace: Kopf scans nothing cluster-wide).
OPERATOR_NAMESPACE_RULES: list[Rule] = namespaced_only(OPERATOR_RULES)


def chart_rules() -> dict[str, list[Rule]]:
    """What the chart's files/rbac/operator-rules.yaml holds (scripts/sync-chart.py writes it)."""
    return {"cluster": OPERATOR_RULES, "namespace": OPERATOR_NAMESPACE_RULES,
            "namespaceScan": merge(NAMESPACE_SCAN_RULES)}
