"""The Kubernetes API emulator, driven over HTTP by the real `kubernetes` client: CRUD semantics."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from testkit.k8s_emulator import JSON_PATCH, MERGE, KubeEmulator, crd_manifest

CKV_CRD = crd_manifest("confkv.io", "v1alpha1", "ConfKVDeployment", short_names=("ckv",), scale=True)


@pytest.fixture
def k8s(api: KubeEmulator) -> Iterator[client.ApiClient]:
    with api.api_client() as api_client:
        yield api_client


def _error(exc: pytest.ExceptionInfo[ApiException]) -> dict[str, Any]:
    body = json.loads(exc.value.body)
    assert body["kind"] == "Status" and body["code"] == exc.value.status
    return body


def _deployment(name: str, replicas: int = 1) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {"name": "engine", "image": "e:1", "env": [{"name": "A", "value": "1"}]},
                        {"name": "agent", "image": "a:1"},
                    ]
                },
            },
        },
        "status": {"replicas": 99},
    }


def test_discovery_and_initial_namespaces(k8s: client.ApiClient) -> None:
    assert client.CoreApi(k8s).get_api_versions().versions == ["v1"]
    groups = {g.name: g.preferred_version.version for g in client.ApisApi(k8s).get_api_versions().groups}
    assert groups["apps"] == "v1" and groups["rbac.authorization.k8s.io"] == "v1"
    assert "confkv.io" not in groups
    core = {r.name for r in client.CoreV1Api(k8s).get_api_resources().resources}
    assert {"namespaces", "configmaps", "pods", "services/status"} <= core
    apps = {r.name: r for r in client.AppsV1Api(k8s).get_api_resources().resources}
    assert {"deployments", "deployments/status", "deployments/scale"} <= set(apps)
    names = [ns.metadata.name for ns in client.CoreV1Api(k8s).list_namespace().items]
    assert names == ["default", "kube-system"]


def test_create_get_duplicate_and_missing(k8s: client.ApiClient) -> None:
    core = client.CoreV1Api(k8s)
    created = core.create_namespaced_config_map("default", {"metadata": {"name": "cfg"}, "data": {"a": "1"}})
    assert created is not None and created.metadata.uid and created.metadata.generation == 1
    assert created.metadata.creation_timestamp is not None and int(created.metadata.resource_version) > 0
    assert core.read_namespaced_config_map("cfg", "default").data == {"a": "1"}
    with pytest.raises(ApiException) as duplicate:
        core.create_namespaced_config_map("default", {"metadata": {"name": "cfg"}})
    assert duplicate.value.status == 409 and _error(duplicate)["reason"] == "AlreadyExists"
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_config_map("nope", "default")
    assert missing.value.status == 404 and _error(missing)["reason"] == "NotFound"
    with pytest.raises(ApiException) as no_namespace:
        core.create_namespaced_config_map("ghost", {"metadata": {"name": "cfg"}})
    assert no_namespace.value.status == 404


def test_resource_version_conflict_and_generation(k8s: client.ApiClient) -> None:
    apps = client.AppsV1Api(k8s)
    first = apps.create_namespaced_deployment("default", _deployment("web"))
    assert first.status is None or first.status.replicas is None  # status is dropped on create
    stale = first.to_dict()
    apps.patch_namespaced_deployment("web", "default", {"metadata": {"labels": {"tier": "x"}}})
    relabelled = apps.read_namespaced_deployment("web", "default")
    assert relabelled.metadata.generation == 1
    assert int(relabelled.metadata.resource_version) > int(first.metadata.resource_version)
    stale["spec"]["replicas"] = 5
    with pytest.raises(ApiException) as conflict:
        apps.replace_namespaced_deployment("web", "default", k8s.sanitize_for_serialization(stale))
    assert conflict.value.status == 409 and _error(conflict)["reason"] == "Conflict"
    fresh = relabelled.to_dict()
    fresh["spec"]["replicas"] = 5
    replaced = apps.replace_namespaced_deployment("web", "default", k8s.sanitize_for_serialization(fresh))
    assert replaced.spec.replicas == 5 and replaced.metadata.generation == 2
    # A no-op patch changes nothing, not even the resourceVersion.
    same = apps.patch_namespaced_deployment("web", "default", {"spec": {"replicas": 5}})
    assert same.metadata.resource_version == replaced.metadata.resource_version


def test_status_subresource_is_separate(api: KubeEmulator, k8s: client.ApiClient) -> None:
    apps = client.AppsV1Api(k8s)
    apps.create_namespaced_deployment("default", _deployment("web"))
    apps.patch_namespaced_deployment("web", "default", {"status": {"replicas": 7}, "spec": {"paused": True}})
    body = api.get("apps/v1", "deployments", "web", "default")
    assert body is not None and "status" not in body and body["metadata"]["generation"] == 2
    patched = apps.patch_namespaced_deployment_status(
        "web", "default", {"status": {"readyReplicas": 1}, "spec": {"replicas": 9}}
    )
    assert patched.status.ready_replicas == 1 and patched.spec.replicas == 1
    assert patched.metadata.generation == 2
    rolled = api.patch_deployment_status("web", "default")
    assert rolled["status"]["availableReplicas"] == 1 and rolled["status"]["observedGeneration"] == 2


def test_scale_subresource(k8s: client.ApiClient) -> None:
    apps = client.AppsV1Api(k8s)
    apps.create_namespaced_deployment("default", _deployment("web", replicas=2))
    scale = apps.read_namespaced_deployment_scale("web", "default")
    assert scale.spec.replicas == 2 and scale.status.selector == "app=web"
    apps.patch_namespaced_deployment_scale("web", "default", {"spec": {"replicas": 4}})
    assert apps.read_namespaced_deployment("web", "default").spec.replicas == 4


def test_merge_and_json_patch(k8s: client.ApiClient) -> None:
    core = client.CoreV1Api(k8s)
    made = core.create_namespaced_config_map(
        "default", {"metadata": {"name": "cfg"}, "data": {"a": "1", "b": "2"}}
    )
    merged = core.patch_namespaced_config_map(
        "cfg", "default", {"data": {"a": None, "c": "3"}}, _content_type=MERGE
    )
    assert merged.data == {"b": "2", "c": "3"}
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": merged.metadata.resource_version},
        {"op": "add", "path": "/data/d", "value": "4"},
    ]
    assert core.patch_namespaced_config_map("cfg", "default", ops, _content_type=JSON_PATCH).data["d"] == "4"
    stale = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": made.metadata.resource_version},
        {"op": "remove", "path": "/data/b"},
    ]
    with pytest.raises(ApiException) as failed:
        core.patch_namespaced_config_map("cfg", "default", stale, _content_type=JSON_PATCH)
    assert failed.value.status == 422 and _error(failed)["reason"] == "Invalid"
    assert core.read_namespaced_config_map("cfg", "default").data["b"] == "2"
    stale_merge = {"metadata": {"resourceVersion": made.metadata.resource_version}, "data": {"b": "x"}}
    with pytest.raises(ApiException) as conflict:
        core.patch_namespaced_config_map("cfg", "default", stale_merge, _content_type=MERGE)
    assert conflict.value.status == 409


def test_strategic_merge_and_apply(k8s: client.ApiClient) -> None:
    apps = client.AppsV1Api(k8s)
    apps.create_namespaced_deployment("default", _deployment("web"))
    patch = {
        "spec": {
            "template": {
                "spec": {
                    "containers": [{"name": "engine", "image": "e:2", "env": [{"name": "B", "value": "2"}]}]
                }
            }
        }
    }
    patched = apps.patch_namespaced_deployment(
        "web", "default", patch, _content_type="application/strategic-merge-patch+json"
    )
    containers = {c.name: c for c in patched.spec.template.spec.containers}
    assert set(containers) == {"engine", "agent"} and containers["engine"].image == "e:2"
    assert [e.name for e in containers["engine"].env] == ["A", "B"]
    core = client.CoreV1Api(k8s)
    apply = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "applied"}, "data": {"a": "1"}}
    core.patch_namespaced_config_map(
        "applied", "default", apply, field_manager="test", _content_type="application/apply-patch+yaml"
    )
    apply["data"] = {"b": "2"}
    again = core.patch_namespaced_config_map(
        "applied", "default", apply, field_manager="test", _content_type="application/apply-patch+yaml"
    )
    assert again.data == {"b": "2"}  # the manager's field "a", no longer applied, is removed


def test_selectors_and_cluster_wide_lists(api: KubeEmulator, k8s: client.ApiClient) -> None:
    core = client.CoreV1Api(k8s)
    core.create_namespace({"metadata": {"name": "other"}})
    for name, ns, labels in (
        ("a", "default", {"app": "x", "tier": "web"}),
        ("b", "default", {"app": "y"}),
        ("c", "other", {"app": "x", "tier": "db"}),
    ):
        core.create_namespaced_config_map(ns, {"metadata": {"name": name, "labels": labels}})

    def names(**kw: Any) -> list[str]:
        return [cm.metadata.name for cm in core.list_config_map_for_all_namespaces(**kw).items]

    assert names() == ["a", "b", "c"]
    assert names(label_selector="app=x,tier!=db") == ["a"]
    assert names(label_selector="tier in (web,db)") == ["a", "c"]
    assert names(label_selector="app notin (x),!tier") == ["b"]
    assert names(field_selector="metadata.name=c") == ["c"]
    with pytest.raises(ApiException) as bad:
        names(label_selector="app in (x")
    assert bad.value.status == 400 and _error(bad)["reason"] == "BadRequest"
    assert [cm.metadata.name for cm in core.list_namespaced_config_map("other").items] == ["c"]
    core.delete_namespace("other")
    assert names() == ["a", "b"]


def test_crd_registers_custom_resources(api: KubeEmulator, k8s: client.ApiClient) -> None:
    custom = client.CustomObjectsApi(k8s)
    with pytest.raises(ApiException) as before:
        custom.list_cluster_custom_object("confkv.io", "v1alpha1", "confkvdeployments")
    assert before.value.status == 404
    client.ApiextensionsV1Api(k8s).create_custom_resource_definition(CKV_CRD)
    resources = {r.name: r for r in client.ApisApi(k8s).get_api_versions().groups if r.name == "confkv.io"}
    assert resources["confkv.io"].preferred_version.version == "v1alpha1"
    body = {
        "apiVersion": "confkv.io/v1alpha1",
        "kind": "ConfKVDeployment",
        "metadata": {"name": "demo"},
        "spec": {"replicas": 1},
        "status": {"phase": "Bogus"},
    }
    made = custom.create_namespaced_custom_object(
        "confkv.io", "v1alpha1", "default", "confkvdeployments", body
    )
    assert made["metadata"]["generation"] == 1 and "status" not in made
    custom.patch_namespaced_custom_object_status(
        "confkv.io",
        "v1alpha1",
        "default",
        "confkvdeployments",
        "demo",
        {"status": {"phase": "Ready", "replicas": 1}},
    )
    custom.patch_namespaced_custom_object_scale(
        "confkv.io", "v1alpha1", "default", "confkvdeployments", "demo", {"spec": {"replicas": 3}}
    )
    got = custom.get_namespaced_custom_object("confkv.io", "v1alpha1", "default", "confkvdeployments", "demo")
    assert (
        got["spec"]["replicas"] == 3
        and got["status"]["phase"] == "Ready"
        and got["metadata"]["generation"] == 2
    )
    listed = custom.list_cluster_custom_object("confkv.io", "v1alpha1", "confkvdeployments")
    assert [o["metadata"]["name"] for o in listed["items"]] == ["demo"]
    assert api.serves("confkv.io/v1alpha1", "ckv")
    client.ApiextensionsV1Api(k8s).delete_custom_resource_definition("confkvdeployments.confkv.io")
    assert not api.serves("confkv.io/v1alpha1", "ckv")


def test_invalid_bodies_and_methods(api: KubeEmulator) -> None:
    def call(method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            api.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            urllib.request.urlopen(request, timeout=10)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())
        raise AssertionError(f"{method} {path} unexpectedly succeeded")

    assert call("POST", "/api/v1/namespaces/default/configmaps", {"metadata": {}})[1]["reason"] == "Invalid"
    assert call("POST", "/api/v1/namespaces/default/configmaps", [1, 2])[0] == 422
    bad_crd = {
        "metadata": {"name": "wrong"},
        "spec": {
            "group": "g.io",
            "names": {"plural": "xs", "kind": "X"},
            "scope": "Namespaced",
            "versions": [{"name": "v1"}],
        },
    }
    assert call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", bad_crd)[0] == 422
    assert call("POST", "/api/v1/namespaces/default/configmaps/x")[0] == 405
    assert call("GET", "/apis/nothing.io/v1/things")[1]["reason"] == "NotFound"


def test_request_log_uses_rbac_verbs(api: KubeEmulator, k8s: client.ApiClient) -> None:
    core = client.CoreV1Api(k8s)
    core.create_namespaced_service_account("default", {"metadata": {"name": "sa"}})
    core.list_namespaced_service_account("default")
    core.patch_namespaced_service_account("sa", "default", {"metadata": {"labels": {"a": "b"}}})
    core.delete_namespaced_service_account("sa", "default")
    client.AppsV1Api(k8s).list_deployment_for_all_namespaces()
    verbs = [(r.verb, r.resource, r.namespace) for r in api.request_log]
    assert verbs == [
        ("create", "serviceaccounts", "default"),
        ("list", "serviceaccounts", "default"),
        ("patch", "serviceaccounts", "default"),
        ("delete", "serviceaccounts", "default"),
        ("list", "deployments", None),
    ]
    assert ("apps", "deployments", "list") in api.rbac_usage()
