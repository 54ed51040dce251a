"""Peering with a namespace list: the replicas share the chart's one ClusterKopfPeering (Kopf's own default
for a namespaced operator would be a KopfPeering in each watched namespace, which the chart does not
create and which globs could not name)."""

from __future__ import annotations

import pytest

from testkit.k8s_emulator import KubeEmulator, crd_manifest
from testkit.operator_harness import OperatorThread, cr, install_crds

PEERING = "confkv-operator"


@pytest.mark.timeout(90)
def test_namespace_list_uses_the_cluster_peering_object() -> None:
    with KubeEmulator() as api:
        api.activate()
        try:
            install_crds(api)
            for kind, scope in (("ClusterKopfPeering", "Cluster"), ("KopfPeering", "Namespaced")):
                api.create(crd_manifest("kopf.dev", "v1", kind, scope=scope, status=False))
            api.create({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                        "metadata": {"name": PEERING}})
            env = {"CONFKV_NAMESPACES": "default", "CONFKV_PEERING_NAME": PEERING,
                   "CONFKV_PEERING_PRIORITY": "100"}
            with OperatorThread(api, resync_seconds=0.5, **env):
                KubeEmulator.wait_for(lambda: (api.get("kopf.dev/v1", "clusterkopfpeerings", PEERING) or {})
                                      .get("status"), timeout=30, message="keep-alive in ClusterKopfPeering")
                api.create(cr("peered"))
                KubeEmulator.wait_for(lambda: api.get("apps/v1", "deployments", "peered", "default"),
                                      timeout=30, message="the peered operator reconciles")
            namespaced = [r for r in api.request_log if r.resource == "kopfpeerings"]
        finally:
            api.deactivate()
    assert namespaced == [], "Kopf looked for a namespaced KopfPeering"
