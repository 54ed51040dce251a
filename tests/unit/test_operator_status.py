"""Pure status computation, drift detection, settings and RBAC data."""

from __future__ import annotations

import json
from typing import Any

import pytest

from confkv_operator import names as n
from confkv_operator.kube import drifted, object_path
from confkv_operator.rbac import AGENT_RULES, OPERATOR_API_RULES, OPERATOR_RULES, expand
from confkv_operator.settings import SettingsError, load_settings
from confkv_operator.status import (
    compute_status,
    invalid_status,
    last_remediation,
    merge_conditions,
    status_delta,
)


def _dep(generation: int = 1, observed: int | None = 1, replicas: int = 2, ready: int = 2,
         updated: int = 2, conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    status = {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
              "conditions": conditions or []}
    if observed is not None:
        status["observedGeneration"] = observed
    return {"metadata": {"generation": generation}, "status": status}


def _conditions(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status["conditions"]}


@pytest.mark.parametrize(("dep", "phase", "ready", "progressing", "degraded"), [
    (None, "Pending", "False", "True", "False"),
    (_dep(), "Running", "True", "False", "False"),
    (_dep(generation=2, observed=1), "Progressing", "False", "True", "False"),
    (_dep(updated=1), "Progressing", "False", "True", "False"),
    (_dep(ready=1), "Degraded", "False", "False", "True"),
    (_dep(ready=1, conditions=[{"type": "Progressing", "reason": "ProgressDeadlineExceeded"}]),
     "Degraded", "False", "False", "True"),
])
def test_phase_and_conditions(dep: dict[str, Any] | None, phase: str, ready: str, progressing: str,
                              degraded: str) -> None:
    status = compute_status("demo", "ns", 8000, "builtin:smollm2-135m", 2, 3, dep)
    assert status["phase"] == phase
    assert _conditions(status) == {"Ready": ready, "Progressing": progressing, "Degraded": degraded,
                                   "InvalidSpec": "False"}
    assert status["observedGeneration"] == 3
    assert status["endpoint"] == "http://demo.ns.svc:8000"
    assert status["selector"] == "app.kubernetes.io/instance=demo,app.kubernetes.io/name=confkv"


def test_invalid_status() -> None:
    status = invalid_status("invalid ConfKVDeployment spec: confkv.eviction.k: too small", 4)
    assert status["phase"] == "Invalid"
    invalid = next(c for c in status["conditions"] if c["type"] == "InvalidSpec")
    assert invalid["status"] == "True" and "eviction.k" in invalid["message"]


def test_transition_times_survive_unchanged_statuses() -> None:
    first = merge_conditions([], [{"type": "Ready", "status": "False"}], "t1")
    same = merge_conditions(first, [{"type": "Ready", "status": "False", "message": "x"}], "t2")
    flipped = merge_conditions(same, [{"type": "Ready", "status": "True"}], "t3")
    assert [c["lastTransitionTime"] for c in (*first, *same, *flipped)] == ["t1", "t1", "t3"]


def test_status_delta_only_lists_changes() -> None:
    assert status_delta({"phase": "Running", "replicas": 1}, {"phase": "Running", "replicas": 2}) == {
        "replicas": 2}


def _pod(name: str, record: Any) -> dict[str, Any]:
    value = record if isinstance(record, str) else json.dumps(record)
    return {"metadata": {"name": name, "annotations": {n.LAST_REMEDIATION_ANNOTATION: value}}}


def test_last_remediation_is_the_newest_valid_record() -> None:
    pods = [
        _pod("a", {"time": "2026-01-01T10:00:00Z", "alert": "hitRate", "action": "raiseLruK",
                   "result": "applied"}),
        _pod("b", {"time": "2026-01-01T11:00:00Z", "alert": "vram", "action": "compress",
                   "result": "applied"}),
        _pod("c", "{not json"),
        _pod("d", {"alert": "no time"}),
        {"metadata": {"name": "e"}},
    ]
    assert last_remediation(pods) == {"time": "2026-01-01T11:00:00Z", "alert": "vram", "action": "compress",
                                      "result": "applied", "pod": "b"}
    assert last_remediation(pods[2:]) is None


def test_drift_ignores_server_added_fields_but_not_changed_ones() -> None:
    desired = {"spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "e", "image": "a"}]}}},
               "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "1Gi"}}}
    live = {"spec": {"replicas": 1, "revisionHistoryLimit": 10, "template": {"spec": {
        "containers": [{"name": "e", "image": "a", "terminationMessagePath": "/dev/termination-log"}]}}},
        "resources": {"limits": {"nvidia.com/gpu": "1", "memory": "1Gi"}}, "status": {"x": 1}}
    assert drifted(desired, live) == []
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "b"
    assert drifted(desired, live) == [".spec.template.spec.containers[0].image"]
    live["spec"]["template"]["spec"]["containers"].append({"name": "intruder"})
    assert drifted(desired, live) == [".spec.template.spec.containers"]
    assert drifted({"data": {"k": "v"}}, {}) == [".data"]


def test_object_paths() -> None:
    assert object_path("v1", "ConfigMap", "ns", "c") == "/api/v1/namespaces/ns/configmaps/c"
    assert object_path("apps/v1", "Deployment", "ns") == "/apis/apps/v1/namespaces/ns/deployments"


def test_settings_from_env() -> None:
    settings = load_settings({"CONFKV_NAMESPACES": "a, b", "CONFKV_RESYNC_SECONDS": "2.5",
                              "CONFKV_LIVENESS_PORT": "0", "CONFKV_LOG_LEVEL": "debug"})
    assert settings.namespaces == ("a", "b") and settings.resync_seconds == 2.5
    assert settings.liveness_endpoint is None and settings.log_level == "DEBUG"
    assert settings.standalone and settings.agent_image_or_default == settings.engine_image
    assert load_settings({}).liveness_endpoint == "http://0.0.0.0:8080/healthz"


@pytest.mark.parametrize(("env", "name"), [
    ({"CONFKV_RESYNC_SECONDS": "0"}, "CONFKV_RESYNC_SECONDS"),
    ({"CONFKV_AGENT_PORT": "http"}, "CONFKV_AGENT_PORT"),
    ({"CONFKV_LOG_LEVEL": "loud"}, "CONFKV_LOG_LEVEL"),
])
def test_bad_settings_name_the_variable(env: dict[str, str], name: str) -> None:
    with pytest.raises(SettingsError, match=name):
        load_settings(env)


def test_operator_rules_grant_what_the_agent_role_needs() -> None:
    # RBAC escalation prevention: the operator can only create a Role whose rules it holds itself.
    assert expand(AGENT_RULES) <= expand(OPERATOR_RULES)
    assert expand(OPERATOR_RULES) == expand(OPERATOR_API_RULES) | expand(AGENT_RULES)


def test_entry_point_rejects_bad_settings_before_starting(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from confkv_operator.main import main, run_kwargs

    monkeypatch.setenv("CONFKV_RESYNC_SECONDS", "-1")
    assert main() == 2
    assert "CONFKV_RESYNC_SECONDS" in capsys.readouterr().err
    assert run_kwargs(load_settings({})) == {"clusterwide": True, "standalone": True, "peering_name": None,
                                             "priority": 0}
    scoped = run_kwargs(load_settings({"CONFKV_NAMESPACES": "ml", "CONFKV_PEERING_NAME": "confkv",
                                       "CONFKV_PEERING_PRIORITY": "100"}))
    assert scoped == {"namespaces": ["ml"], "standalone": False, "peering_name": "confkv", "priority": 100}
