"""The Kubernetes API emulator: watches, finalizers, owner-reference cascade, and Kopf against it."""

from __future__ import annotations

import json
import textwrap
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch

from testkit.k8s_emulator import ApiError, KubeEmulator, crd_manifest
from testkit.k8s_emulator.watching import Event, Hub


@pytest.fixture
def core(api: KubeEmulator) -> Iterator[client.CoreV1Api]:
    with api.api_client() as api_client:
        yield client.CoreV1Api(api_client)


def _cm(name: str, owner: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, **meta}
    if owner is not None:
        metadata["ownerReferences"] = [
            {
                "apiVersion": owner["apiVersion"],
                "kind": owner["kind"],
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
            }
        ]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata}


def _watch(core: client.CoreV1Api, count: int, **kw: Any) -> list[tuple[str, str]]:
    """The first `count` events of a configmap watch in 'default', as (type, name)."""
    events: list[tuple[str, str]] = []
    stream = watch.Watch()
    for event in stream.stream(core.list_namespaced_config_map, "default", timeout_seconds=10, **kw):
        events.append((event["type"], event["object"].metadata.name))
        if len(events) == count:
            stream.stop()
    return events


def test_watch_resumes_after_resource_version_without_replay(core: client.CoreV1Api) -> None:
    core.create_namespaced_config_map("default", _cm("before"))
    since = core.list_namespaced_config_map("default").metadata.resource_version
    core.create_namespaced_config_map("default", _cm("after"))
    core.patch_namespaced_config_map("before", "default", {"data": {"x": "1"}})
    core.delete_namespaced_config_map("after", "default")
    assert _watch(core, 3, resource_version=since) == [
        ("ADDED", "after"),
        ("MODIFIED", "before"),
        ("DELETED", "after"),
    ]
    assert _watch(core, 1) == [("ADDED", "before")]  # no resourceVersion: current objects first


def test_watch_streams_live_events_with_label_selector(api: KubeEmulator, core: client.CoreV1Api) -> None:
    since = core.list_namespaced_config_map("default").metadata.resource_version
    pool = ThreadPoolExecutor(max_workers=1)
    seen = pool.submit(_watch, core, 3, resource_version=since, label_selector="app=x")
    # Change things once the stream is open, so the events arrive live rather than from history.
    api.wait_for(lambda: any(r.verb == "watch" for r in api.request_log))
    core.create_namespaced_config_map("default", _cm("other", labels={"app": "y"}))
    core.create_namespaced_config_map("default", _cm("mine", labels={"app": "x"}))
    core.patch_namespaced_config_map("other", "default", {"metadata": {"labels": {"app": "x"}}})
    core.patch_namespaced_config_map("mine", "default", {"metadata": {"labels": {"app": "z"}}})
    assert seen.result(timeout=15) == [("ADDED", "mine"), ("ADDED", "other"), ("DELETED", "mine")]
    pool.shutdown()


def test_watch_timeout_and_reset_end_the_stream(api: KubeEmulator) -> None:
    url = f"{api.url}/api/v1/namespaces/default/configmaps?watch=true&resourceVersion=1&timeoutSeconds=1"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.read() == b""  # nothing happened; the server closed the stream at the timeout

    def read_until_closed() -> bytes:
        with urllib.request.urlopen(f"{api.url}/api/v1/pods?watch=true&resourceVersion=1", timeout=10) as rsp:
            return rsp.read()

    pool = ThreadPoolExecutor(max_workers=1)
    reader = pool.submit(read_until_closed)
    api.wait_for(lambda: any(r.verb == "watch" and r.resource == "pods" for r in api.request_log))
    api.reset()
    assert reader.result(timeout=10) == b""
    pool.shutdown()


def test_finalizers_delay_removal(api: KubeEmulator, core: client.CoreV1Api) -> None:
    core.create_namespaced_config_map("default", _cm("held", finalizers=["example.com/hold"]))
    core.delete_namespaced_config_map("held", "default")
    held = core.read_namespaced_config_map("held", "default")
    assert held.metadata.deletion_timestamp is not None
    core.patch_namespaced_config_map("held", "default", {"metadata": {"finalizers": None}})
    assert api.get("v1", "configmaps", "held", "default") is None


def test_owner_reference_cascade_is_recursive(api: KubeEmulator, core: client.CoreV1Api) -> None:
    owner = api.create(_cm("owner"))
    child = api.create(_cm("child", owner))
    api.create(_cm("grandchild", child))
    api.create(_cm("orphan-kept", api.create(_cm("other-owner"))))
    core.delete_namespaced_config_map("owner", "default")
    assert [cm["metadata"]["name"] for cm in api.list("v1", "configmaps", "default")] == [
        "orphan-kept",
        "other-owner",
    ]
    core.delete_namespaced_config_map("other-owner", "default", propagation_policy="Orphan")
    assert api.get("v1", "cm", "orphan-kept", "default") is not None


OPERATOR = textwrap.dedent("""
    import kopf
    import kubernetes

    @kopf.on.startup()
    def configure(settings, **_):
        settings.persistence.finalizer = "example.com/finalizer"
        settings.watching.connect_timeout = 5

    @kopf.on.create("example.com", "v1", "widgets")
    def create(body, name, namespace, patch, **_):
        child = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name + "-child"}}
        kopf.adopt(child, owner=body)
        kubernetes.client.CoreV1Api().create_namespaced_config_map(namespace, child)
        patch.status["phase"] = "Ready"
        kopf.info(body, reason="Created", message="child made")

    @kopf.on.delete("example.com", "v1", "widgets")
    def delete(**_):
        pass
""")

WIDGET_CRD = crd_manifest("example.com", "v1", "Widget")


@pytest.fixture
def activated(api: KubeEmulator) -> Iterator[KubeEmulator]:
    api.activate()
    yield api
    api.deactivate()


def test_kopf_operator_round_trip(activated: KubeEmulator, tmp_path: Path) -> None:
    """Kopf 1.45 against the emulator: handlers, status patches, finalizers, JSON-patch tests, GC."""
    from kopf.testing import KopfRunner

    operator = tmp_path / "operator.py"
    operator.write_text(OPERATOR)
    api = activated
    api.create(WIDGET_CRD)
    widget = {
        "apiVersion": "example.com/v1",
        "kind": "Widget",
        "metadata": {"name": "w", "namespace": "default"},
    }
    with KopfRunner(["run", "-A", "--standalone", str(operator)], timeout=60) as runner:
        api.create(widget)
        done = api.wait_for(
            lambda: (
                (w := api.get("example.com/v1", "widgets", "w", "default"))
                and w.get("status", {}).get("phase") == "Ready"
                and w
            ),
            timeout=20,
        )
        assert done["metadata"]["finalizers"] == ["example.com/finalizer"]
        assert api.get("v1", "configmaps", "w-child", "default") is not None
        events = api.wait_for(lambda: api.list("v1", "events", "default"), timeout=20, message="kopf events")
        assert (events[0]["involvedObject"]["name"], events[0]["reason"]) == ("w", "Created")
        api.delete("example.com/v1", "widgets", "w", "default")
        api.wait_for(lambda: api.get("example.com/v1", "widgets", "w", "default") is None, timeout=20)
        assert api.get("v1", "configmaps", "w-child", "default") is None
    assert runner.exit_code == 0, runner.output
    assert runner.exception is None
    status_patches = [r for r in api.request_log if r.resource == "widgets/status" and r.verb == "patch"]
    assert status_patches, json.dumps(api.request_log)


def test_watch_history_expires_with_410() -> None:
    hub = Hub(history=2)
    key = ("", "configmaps")
    for rv in (1, 2, 3):
        hub.emit(Event(rv, "ADDED", key, "default", {"metadata": {"name": str(rv)}}))
    assert [e.rv for e in hub.since(key, "default", 1)] == [2, 3]
    assert hub.since(key, "other", 1) == []
    with pytest.raises(ApiError) as expired:
        hub.since(key, "default", 0)
    assert expired.value.code == 410 and expired.value.reason == "Expired"
