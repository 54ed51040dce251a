"""The chart's agent pod guard (a ValidatingAdmissionPolicy) evaluated with cel-python, as the API server
would: match conditions first (with an ``authorizer`` that answers from RBAC rules, like the real one),
then every validation. The requesters' rules are the operator's own: the agent Role from the builders
and the operator's ClusterRole from the RBAC data.

Not covered (no API server here): the CEL type checks the server runs when the policy is created.
kubernetes-validate checks the objects' shape (test_k8s_validate.py).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import celpy
import pytest
from celpy import celtypes
from contract_tools import REPO, find_obj, render, require_tool

sys.path.insert(0, str(REPO / "operator"))

from confkv_operator import names as n  # noqa: E402
from confkv_operator.builders import build_role  # noqa: E402
from confkv_operator.rbac import OPERATOR_RULES, Rule  # noqa: E402

NS = "serving"
POD = "demo-7d9f8b6c5d-abcde"
OTHER_POD = "demo-7d9f8b6c5d-fghij"
AGENT = f"system:serviceaccount:{NS}:demo-agent"
ADMIN_RULES: list[Rule] = [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]


@pytest.fixture(scope="module")
def policy() -> dict[str, Any]:
    return find_obj(render(require_tool("helm")), "ValidatingAdmissionPolicy")


def _allows(rules: list[Rule], attrs: dict[str, str]) -> bool:
    """RBAC's answer for one request: a rule matches group, resource[/subresource], verb and name."""
    resource = attrs["resource"] + (f"/{attrs['subresource']}" if attrs.get("subresource") else "")
    for rule in rules:
        names = rule.get("resourceNames")
        if (attrs["group"] in rule["apiGroups"] or "*" in rule["apiGroups"]) and (
                resource in rule["resources"] or "*" in rule["resources"]) and (
                attrs["verb"] in rule["verbs"] or "*" in rule["verbs"]) and (
                not names or attrs.get("name") in names):
            return True
    return False


def _authorizer_functions(rules: list[Rule]) -> dict[str, Callable[..., Any]]:
    """The Kubernetes CEL authorizer library (group/resource/subresource/namespace/name/check/allowed)."""
    def setter(key: str) -> Callable[[Any, Any], Any]:
        return lambda attrs, value: celtypes.MapType({**attrs, celtypes.StringType(key): value})

    functions: dict[str, Callable[..., Any]] = {
        key: setter(key) for key in ("group", "resource", "subresource", "namespace", "name")}
    functions["check"] = setter("verb")
    functions["allowed"] = lambda attrs: celtypes.BoolType(
        _allows(rules, {str(k): str(v) for k, v in attrs.items()}))
    return functions


def _eval(expression: str, activation: dict[str, Any], rules: list[Rule]) -> bool:
    env = celpy.Environment()
    result = env.program(env.compile(expression), functions=_authorizer_functions(rules)).evaluate(activation)
    assert isinstance(result, celtypes.BoolType), f"{expression!r} gave {result!r}"
    return bool(result)


def admit(policy: dict[str, Any], user: str, rules: list[Rule], old: dict[str, Any], new: dict[str, Any],
          pod_name: str | None = POD) -> list[str]:
    """Messages of the failed validations ([] = admitted; also [] when the policy does not match)."""
    extra = {"authentication.kubernetes.io/pod-name": [pod_name]} if pod_name else {}
    activation: dict[str, Any] = {
        "request": celpy.json_to_cel({"namespace": NS, "userInfo": {"username": user, "extra": extra}}),
        "object": celpy.json_to_cel(new), "oldObject": celpy.json_to_cel(old),
        "authorizer": celtypes.MapType({}),
    }
    spec = policy["spec"]
    if not all(_eval(c["expression"], activation, rules) for c in spec["matchConditions"]):
        return []
    env = celpy.Environment()
    variables = {v["name"]: env.program(env.compile(v["expression"])).evaluate(activation)
                 for v in spec.get("variables", [])}
    activation["variables"] = celtypes.MapType({celtypes.StringType(k): v for k, v in variables.items()})
    return [v["message"] for v in spec["validations"] if not _eval(v["expression"], activation, rules)]


def _pod(name: str = POD) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": n.selector_labels("demo"),
                         "annotations": {"kubectl.kubernetes.io/default-container": n.ENGINE_CONTAINER},
                         "ownerReferences": [{"kind": "ReplicaSet", "name": "demo-7d9f8b6c5d"}]},
            "spec": {"containers": [{"name": n.ENGINE_CONTAINER, "image": "ghcr.io/confkv/confkv:0.1.0"}]}}


def _annotated(pod: dict[str, Any], key: str = n.LAST_REMEDIATION_ANNOTATION) -> dict[str, Any]:
    new = copy.deepcopy(pod)
    new["metadata"]["annotations"][key] = '{"time": "2026-12-01T10:00:00Z"}'
    return new


AGENT_RULES_OF_DEMO = build_role("demo")["rules"]


def test_the_agent_may_annotate_its_own_pod(policy: dict[str, Any]) -> None:
    assert admit(policy, AGENT, AGENT_RULES_OF_DEMO, _pod(), _annotated(_pod())) == []
    # ... also when the pod had no annotations at all
    bare = _pod()
    del bare["metadata"]["annotations"]
    first = copy.deepcopy(bare)
    first["metadata"]["annotations"] = {n.LAST_REMEDIATION_ANNOTATION: "{}"}
    assert admit(policy, AGENT, AGENT_RULES_OF_DEMO, bare, first) == []


def test_the_agent_may_not_touch_another_pod(policy: dict[str, Any]) -> None:
    other = _pod(OTHER_POD)
    assert admit(policy, AGENT, AGENT_RULES_OF_DEMO, other, _annotated(other)) == [
        "a ConfKVDeployment agent may change only its own pod"]


@pytest.mark.parametrize("change", ["image", "label", "annotation", "drop-annotation", "owner", "finalizer"])
def test_the_agent_may_change_nothing_else_in_its_pod(policy: dict[str, Any], change: str) -> None:
    new = _annotated(_pod())
    meta = new["metadata"]
    if change == "image":
        new["spec"]["containers"][0]["image"] = "evil:1"
    elif change == "label":
        meta["labels"]["app.kubernetes.io/instance"] = "someone-else"
    elif change == "annotation":
        meta["annotations"]["prometheus.io/scrape"] = "false"
    elif change == "drop-annotation":
        del meta["annotations"]["kubectl.kubernetes.io/default-container"]
    elif change == "owner":
        meta["ownerReferences"] = []
    else:
        meta["finalizers"] = ["example.com/hold"]
    assert len(admit(policy, AGENT, AGENT_RULES_OF_DEMO, _pod(), new)) == 1


@pytest.mark.parametrize(("user", "rules", "pod_name"), [
    ("system:serviceaccount:confkv-system:confkv-confkv-operator", OPERATOR_RULES, "confkv-op-1"),
    ("system:serviceaccount:kube-system:admin-tool", ADMIN_RULES, "admin-tool-1"),
    ("system:serviceaccount:serving:datadog-agent", [{"apiGroups": [""], "resources": ["pods"],
                                                      "verbs": ["get", "patch"]}], "datadog-agent-xyz"),
    (AGENT, AGENT_RULES_OF_DEMO, None),  # a token not bound to a pod (e.g. a legacy Secret token)
    ("alice@example.com", ADMIN_RULES, None),
])
def test_nobody_else_is_matched(policy: dict[str, Any], user: str, rules: list[Rule],
                                pod_name: str | None) -> None:
    """Only agent tokens are judged: everyone else's pod updates pass through untouched."""
    new = _pod(OTHER_POD)
    new["spec"]["containers"][0]["image"] = "other:2"
    assert admit(policy, user, rules, _pod(OTHER_POD), new, pod_name=pod_name) == []


def test_the_policy_guards_the_annotation_the_operator_reads(policy: dict[str, Any]) -> None:
    text = str(policy["spec"]["validations"])
    assert f"'{n.LAST_REMEDIATION_ANNOTATION}'" in text
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rules == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"],
                      "resources": ["pods"]}]
    binding = find_obj(render(require_tool("helm")), "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


def test_namespace_scope_binds_the_release_namespace_only() -> None:
    helm = require_tool("helm")
    binding = find_obj(render(helm, "--set", "scope=namespace"), "ValidatingAdmissionPolicyBinding")
    selector = binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"]
    assert selector == {"kubernetes.io/metadata.name": "confkv-system"}
    objs = render(helm, "--set", "agentPodGuard.enabled=false")
    assert not [o for o in objs if o["kind"].startswith("ValidatingAdmissionPolicy")]
