"""Per-CR monitoring objects against the API emulator: labels from the operator's settings and the CR
(kube-prometheus-stack selects by its release label), a switch that removes them, and alert rules that
select by namespace and service, so same-named CRs in two namespaces keep their own alerts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from testkit.k8s_emulator import KubeEmulator
from testkit.operator_harness import API_VERSION, OperatorThread, cr, install_crds


def wait(condition: Callable[[], Any], message: str, timeout: float = 20.0) -> Any:
    return KubeEmulator.wait_for(condition, timeout=timeout, message=message)


@pytest.mark.timeout(90)
def test_monitoring_labels_switch_and_namespace_scoped_rules() -> None:
    with KubeEmulator(namespaces=("default", "team-b")) as api:
        api.activate()
        try:
            install_crds(api, monitoring=True)
            with OperatorThread(api, resync_seconds=0.5, CONFKV_MONITORING_LABELS="release=kps"):
                _monitoring_scenario(api)
        finally:
            api.deactivate()


def _monitoring_scenario(api: KubeEmulator) -> None:
    for namespace in ("default", "team-b"):
        api.create(cr("llm", {"monitoring": {"labels": {"team": namespace}}}, namespace=namespace))
    for namespace in ("default", "team-b"):
        monitor = wait(lambda ns=namespace: api.get("monitoring.coreos.com/v1", "servicemonitors", "llm",
                                                    ns), "ServiceMonitor")
        assert monitor["metadata"]["labels"]["release"] == "kps"
        assert monitor["metadata"]["labels"]["team"] == namespace
        rule = wait(lambda ns=namespace: api.get("monitoring.coreos.com/v1", "prometheusrules", "llm", ns),
                    "PrometheusRule")
        assert rule["metadata"]["labels"]["release"] == "kps"
        exprs = [r["expr"] for r in rule["spec"]["groups"][0]["rules"]]
        assert exprs and all(f'namespace="{namespace}", service="llm"' in e for e in exprs)
    api.patch(API_VERSION, "ckv", "llm", {"spec": {"monitoring": {"enabled": False}}}, "team-b")
    # The operator deletes the two objects one after the other: wait for both (under load the rule's
    # deletion can land after the monitor's).
    wait(lambda: all(api.get("monitoring.coreos.com/v1", kind, "llm", "team-b") is None
                     for kind in ("servicemonitors", "prometheusrules")), "switched off")
    assert api.get("monitoring.coreos.com/v1", "servicemonitors", "llm", "default") is not None
