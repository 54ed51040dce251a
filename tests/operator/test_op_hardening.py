"""The running operator's guards against the API emulator: hostPath allow-list, API key, pod credentials.

This module's operator allows hostPath volumes under ``/data`` only (``CONFKV_HOST_PATH_PREFIXES``).
The emulator does no schema validation, so specs the CRD would refuse (``hostPath: /``) reach the
operator here, which must refuse them on its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from confkv_operator import names as n
from testkit.k8s_emulator import KubeEmulator
from testkit.operator_harness import API_VERSION, OperatorThread, cr
from tests.operator.conftest import RESYNC_SECONDS

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("operator")]
NS = "default"


@pytest.fixture(scope="module")
def operator(emulator: KubeEmulator) -> Iterator[OperatorThread]:
    allowing = {"CONFKV_HOST_PATH_PREFIXES": "/data"}
    with OperatorThread(emulator, resync_seconds=RESYNC_SECONDS, **allowing) as running:
        yield running
        assert running.alive, "the operator thread died"


def _status(api: KubeEmulator, name: str) -> dict[str, Any]:
    return (api.get(API_VERSION, "ckv", name, NS) or {}).get("status") or {}


def _condition(api: KubeEmulator, name: str, ctype: str) -> dict[str, Any] | None:
    return next((c for c in _status(api, name).get("conditions", []) if c["type"] == ctype), None)


def _events(api: KubeEmulator, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in api.list("v1", "events", NS)
            if e.get("reason") == reason and e["involvedObject"].get("name") == name]


@pytest.mark.parametrize(("name", "path", "fragment"), [
    ("host-root", "/", "cacheStorage.hostPath"),
    ("host-parent", "/data/../etc", "cacheStorage.hostPath"),
    ("host-sibling", "/database", "not under an allowed prefix"),
    ("host-other", "/var/lib/kubelet", "not under an allowed prefix"),
])
def test_refused_host_paths_set_invalid_spec_and_create_nothing(emulator: KubeEmulator, name: str, path: str,
                                                                fragment: str) -> None:
    emulator.create(cr(name, {"cacheStorage": {"type": "hostPath", "hostPath": path}}))
    invalid = KubeEmulator.wait_for(lambda: (c := _condition(emulator, name, "InvalidSpec")) and c["status"]
                                    == "True" and c, timeout=20, message="InvalidSpec")
    assert fragment in invalid["message"]
    assert _status(emulator, name)["phase"] == "Invalid"
    assert emulator.get("apps/v1", "deployments", name, NS) is None
    KubeEmulator.wait_for(lambda: _events(emulator, name, "InvalidSpec"), timeout=20, message="Warning Event")


def test_allowed_host_path_mounts_the_prefix_with_a_sub_path(emulator: KubeEmulator) -> None:
    emulator.create(cr("host-ok", {"cacheStorage": {"type": "hostPath", "hostPath": "/data/confkv"}}))
    dep = KubeEmulator.wait_for(lambda: emulator.get("apps/v1", "deployments", "host-ok", NS), timeout=20,
                                message="Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "cache", "hostPath": {"path": "/data", "type": "Directory"}} in pod["volumes"]
    engine = next(c for c in pod["containers"] if c["name"] == n.ENGINE_CONTAINER)
    cache = next(m for m in engine["volumeMounts"] if m["name"] == "cache")
    assert cache["subPath"] == "confkv"


def test_open_api_is_reported_then_a_secret_key_closes_it(emulator: KubeEmulator) -> None:
    emulator.create(cr("open", {}))
    cond = KubeEmulator.wait_for(lambda: _condition(emulator, "open", "APIAuthenticated"), timeout=20,
                                 message="APIAuthenticated")
    assert cond["status"] == "False" and "cluster network" in cond["message"]
    (event,) = KubeEmulator.wait_for(lambda: _events(emulator, "open", "APIUnauthenticated"), timeout=20,
                                     message="Warning Event")
    assert event["type"] == "Warning" and "apiKeySecretRef" in event["message"]

    ref = {"name": "open-api", "key": "bearer"}
    emulator.patch(API_VERSION, "ckv", "open", {"spec": {"engine": {"apiKeySecretRef": ref}}}, NS)
    KubeEmulator.wait_for(lambda: (c := _condition(emulator, "open", "APIAuthenticated")) and c["status"]
                          == "True", timeout=20, message="APIAuthenticated True")
    dep = emulator.get("apps/v1", "deployments", "open", NS)
    engine = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == n.ENGINE_CONTAINER)
    env = {e["name"]: e for e in engine["env"]}
    assert env["CONFKV_API_KEY"]["valueFrom"] == {"secretKeyRef": ref}
    config = emulator.get("v1", "configmaps", "open-config", NS)["data"][n.CONFIG_FILE]
    assert "open-api" not in config
    assert len(_events(emulator, "open", "APIUnauthenticated")) == 1, "no new warning once a key is set"


def test_pods_get_no_token_except_in_the_agent(emulator: KubeEmulator) -> None:
    emulator.create(cr("tok", {}))
    dep = KubeEmulator.wait_for(lambda: emulator.get("apps/v1", "deployments", "tok", NS), timeout=20,
                                message="Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    mounted = {c["name"] for c in [*pod["containers"], *pod.get("initContainers", [])]
               if any(m["name"] == n.API_TOKEN_VOLUME for m in c["volumeMounts"])}
    assert mounted == {n.AGENT_CONTAINER}
