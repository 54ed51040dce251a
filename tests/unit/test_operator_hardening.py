"""What a ConfKVDeployment author can get from the operator: no node root, no API token in the engine,
a bearer key from a Secret (or a visible warning without one)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from confkv_api.config import ConfigError
from confkv_api.deployment import load_deployment_spec
from confkv_operator import names as n
from confkv_operator.builders import build_children, build_config_map
from confkv_operator.handlers import check_spec
from confkv_operator.hostpaths import HostPathRefused, split_host_path
from confkv_operator.pod import build_deployment
from confkv_operator.settings import SettingsError, load_settings
from confkv_operator.status import auth_condition

ALLOWING = load_settings({"CONFKV_HOST_PATH_PREFIXES": "/data,/mnt/nvme/"})
DEFAULT = load_settings({})


def _pod(spec: dict[str, Any], settings: Any = ALLOWING) -> dict[str, Any]:
    return build_deployment("demo", check_spec(spec, settings), settings)["spec"]["template"]["spec"]


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in [*pod["containers"], *pod.get("initContainers", [])]}


def _host(path: str) -> dict[str, Any]:
    return {"cacheStorage": {"type": "hostPath", "hostPath": path}}


# --- hostPath -------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/data", "/mnt/nvme", "/mnt/nvme/confkv"])
def test_default_operator_refuses_every_host_path(path: str) -> None:
    with pytest.raises(ConfigError, match="allows no hostPath volumes"):
        check_spec(_host(path), DEFAULT)


@pytest.mark.parametrize(("path", "expected"), [
    ("/data", ("/data", "")),
    ("/data/confkv", ("/data", "confkv")),
    ("/data/a/b", ("/data", "a/b")),
    ("/mnt/nvme/x", ("/mnt/nvme", "x")),  # the prefix was given with a trailing slash
    ("/data/...", ("/data", "...")),  # three dots is a name, not a parent reference
])
def test_allowed_paths_split_into_the_prefix_and_a_sub_path(path: str, expected: tuple[str, str]) -> None:
    assert split_host_path(path, ALLOWING.host_path_prefixes) == expected


@pytest.mark.parametrize("path", ["/database", "/dat", "/mnt", "/mnt/nvme2", "/etc", "/var/lib/kubelet"])
def test_paths_outside_the_prefixes_are_refused(path: str) -> None:
    with pytest.raises(HostPathRefused, match="not under an allowed prefix"):
        split_host_path(path, ALLOWING.host_path_prefixes)
    with pytest.raises(ConfigError, match="not under an allowed prefix"):
        check_spec(_host(path), ALLOWING)


@pytest.mark.parametrize("path", ["/", "//", "/data/../etc", "/data/./x", "/data/", "/data//x", "data/x",
                                  "/data/..", "/data/.", "", "/../data"])
def test_non_canonical_paths_are_refused_by_the_model(path: str) -> None:
    with pytest.raises(ConfigError, match="cacheStorage.hostPath"):
        check_spec(_host(path), ALLOWING)
    with pytest.raises(HostPathRefused):
        split_host_path(path, ALLOWING.host_path_prefixes)


@pytest.mark.parametrize("prefixes", ["/", "/data,/", "/data/../etc", "relative", "/a//b", "/./a"])
def test_bad_prefixes_fail_operator_start_up(prefixes: str) -> None:
    with pytest.raises(SettingsError, match="CONFKV_HOST_PATH_PREFIXES"):
        load_settings({"CONFKV_HOST_PATH_PREFIXES": prefixes})


def test_host_path_volume_is_the_prefix_and_the_rest_a_sub_path() -> None:
    """The kubelet follows symlinks in a hostPath but refuses a subPath that leaves its volume."""
    pod = _pod({"cacheStorage": {"type": "hostPath", "hostPath": "/data/confkv/a", "mountPath": "/nvme"}})
    (volume,) = [v for v in pod["volumes"] if v["name"] == "cache"]
    assert volume == {"name": "cache", "hostPath": {"path": "/data", "type": "Directory"}}
    mounts = {m["name"]: m for m in _containers(pod)[n.ENGINE_CONTAINER]["volumeMounts"]}
    assert mounts["cache"] == {"name": "cache", "mountPath": "/nvme", "subPath": "confkv/a"}
    exact = _pod(_host("/data"))
    engine_mounts = {m["name"]: m for m in _containers(exact)[n.ENGINE_CONTAINER]["volumeMounts"]}
    assert "subPath" not in engine_mounts["cache"]


@pytest.mark.parametrize("spec", [
    {}, {"cacheStorage": {"type": "pvc", "claimName": "c"}}, {"cacheStorage": {"size": "1Gi"}},
    _host("/data/x"),
    {"model": {"hfId": "a/b", "source": "/models/b"}, "modelStorage": {"claimName": "m"}},
])
def test_no_host_path_outside_the_allow_list_in_any_child(spec: dict[str, Any]) -> None:
    """Walk every child object: the only hostPath anywhere is an allowed prefix."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "hostPath" in node and isinstance(node["hostPath"], dict):
                found.append(node["hostPath"]["path"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(build_children("demo", "ns", check_spec(spec, ALLOWING), ALLOWING))
    assert set(found) <= set(ALLOWING.host_path_prefixes)


# --- service account token ------------------------------------------------------------------------

def test_only_the_agent_container_mounts_an_api_token() -> None:
    pod = _pod({"model": {"hfId": "a/b", "source": "/models/b"}, "modelStorage": {"claimName": "m"}})
    assert pod["automountServiceAccountToken"] is False
    (volume,) = [v for v in pod["volumes"] if v["name"] == n.API_TOKEN_VOLUME]
    sources = volume["projected"]["sources"]
    assert sources[0]["serviceAccountToken"]["expirationSeconds"] <= 3607
    assert {"key": "ca.crt", "path": "ca.crt"} in sources[1]["configMap"]["items"]
    for name, container in _containers(pod).items():
        token_mounts = [m for m in container["volumeMounts"] if m["name"] == n.API_TOKEN_VOLUME]
        if name == n.AGENT_CONTAINER:
            assert token_mounts == [{"name": n.API_TOKEN_VOLUME, "mountPath": n.API_TOKEN_DIR,
                                     "readOnly": True}]
        else:
            assert token_mounts == [], f"{name} must not get a Kubernetes API token"


def test_the_agent_account_automounts_nothing_either() -> None:
    children = build_children("demo", "ns", check_spec({}, DEFAULT), DEFAULT)
    (account,) = [c for c in children if c["kind"] == "ServiceAccount"]
    assert account["automountServiceAccountToken"] is False


def test_the_projected_token_is_where_the_agents_kubernetes_client_reads_it() -> None:
    """The agent calls kubernetes.config.load_incluster_config(): token and CA at its fixed paths."""
    from kubernetes.config import incluster_config

    (volume,) = [v for v in _pod({})["volumes"] if v["name"] == n.API_TOKEN_VOLUME]
    files = {f"{n.API_TOKEN_DIR}/{s['serviceAccountToken']['path']}" for s in volume["projected"]["sources"]
             if "serviceAccountToken" in s}
    files |= {f"{n.API_TOKEN_DIR}/{item['path']}" for s in volume["projected"]["sources"] if "configMap" in s
              for item in s["configMap"]["items"]}
    assert {incluster_config.SERVICE_TOKEN_FILENAME, incluster_config.SERVICE_CERT_FILENAME} <= files


# --- API key ----------------------------------------------------------------------------------------

KEYED = {"engine": {"apiKeySecretRef": {"name": "demo-api", "key": "bearer"}}}


def test_api_key_reaches_only_the_engine_from_the_secret() -> None:
    containers = _containers(_pod(KEYED))
    env = {e["name"]: e for e in containers[n.ENGINE_CONTAINER]["env"]}
    assert env["CONFKV_API_KEY"] == {"name": "CONFKV_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "demo-api", "key": "bearer"}}}
    assert "CONFKV_API_KEY" not in {e["name"] for e in containers[n.AGENT_CONTAINER]["env"]}
    assert "CONFKV_API_KEY" not in {e["name"] for e in _containers(_pod({}))[n.ENGINE_CONTAINER]["env"]}


def test_config_map_carries_no_secret_reference() -> None:
    doc = json.loads(build_config_map("demo", load_deployment_spec(KEYED))["data"][n.CONFIG_FILE])
    assert "apiKeySecretRef" not in doc["engine"] and doc["engine"]["apiKey"] is None


def test_setting_the_key_rolls_the_pods() -> None:
    keyed, plain = build_deployment("d", load_deployment_spec(KEYED), DEFAULT), build_deployment(
        "d", load_deployment_spec({}), DEFAULT)
    checksum = n.RESTART_CHECKSUM_ANNOTATION
    assert (keyed["spec"]["template"]["metadata"]["annotations"][checksum]
            != plain["spec"]["template"]["metadata"]["annotations"][checksum])


@pytest.mark.parametrize("ref", [{"name": "x"}, {"key": "k"}, {"name": "Bad_Name", "key": "k"},
                                 {"name": "x", "key": "a/b"}, {"name": "x", "key": "k", "extra": 1}])
def test_bad_secret_refs_are_refused(ref: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="engine.apiKeySecretRef"):
        load_deployment_spec({"engine": {"apiKeySecretRef": ref}})


def test_auth_condition_says_whether_the_api_is_open() -> None:
    open_ = auth_condition("demo", None, 3)
    assert (open_["type"], open_["status"], open_["reason"]) == ("APIAuthenticated", "False", "NoAPIKey")
    assert "cluster network" in open_["message"] and "apiKeySecretRef" in open_["message"]
    keyed = auth_condition("demo", ("demo-api", "bearer"), 3)
    assert keyed["status"] == "True" and "demo-api" in keyed["message"]


# --- Pod Security Standards ---------------------------------------------------------------------

#: Volume types the "restricted" Pod Security Standard allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


@pytest.mark.parametrize("spec", [
    {}, KEYED, {"cacheStorage": {"type": "pvc", "claimName": "c"}, "resources": {"gpusPerPod": 1}},
    {"model": {"hfId": "a/b", "source": "/models/b", "tokenSecretRef": "hf"},
     "modelStorage": {"claimName": "m"}},
])
def test_pods_meet_the_restricted_pod_security_standard(spec: dict[str, Any]) -> None:
    """Without hostPath (even "baseline" forbids it) the pods run in a namespace enforcing "restricted"."""
    pod = _pod(spec, DEFAULT)
    for volume in pod["volumes"]:
        assert set(volume) - {"name"} <= RESTRICTED_VOLUMES, volume
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod)
    for container in _containers(pod).values():
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
        assert context["runAsNonRoot"] is True and not context.get("privileged")
        assert "ports" not in container or all("hostPort" not in p for p in container["ports"])
