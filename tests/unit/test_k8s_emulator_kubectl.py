"""The Kubernetes API emulator against the real kubectl (v1.35 from scripts/install-tools.sh)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from testkit.k8s_emulator import KubeEmulator, crd_manifest

Kubectl = Callable[..., subprocess.CompletedProcess[str]]


def _kubectl() -> str:
    """kubectl from the project venv first (the pinned v1.35), then PATH; fail in CI, skip elsewhere."""
    local = Path(sys.prefix) / "bin" / "kubectl"
    found = str(local) if local.exists() else shutil.which("kubectl")
    if found is None:
        message = "kubectl not found: run scripts/install-tools.sh"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.fixture(scope="module")
def kubectl() -> str:
    return _kubectl()


@pytest.fixture(scope="module")
def emulator() -> Iterator[KubeEmulator]:
    with KubeEmulator() as api:
        yield api


@pytest.fixture
def run(emulator: KubeEmulator, kubectl: str) -> Iterator[Kubectl]:
    emulator.reset()

    def run(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        result = subprocess.run(
            [kubectl, "--kubeconfig", emulator.kubeconfig_path, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    yield run


def test_kubectl_lists_namespaces_and_configmaps(run: Kubectl, emulator: KubeEmulator) -> None:
    assert run("get", "ns", "-o", "name").stdout.split() == ["namespace/default", "namespace/kube-system"]
    emulator.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "cfg", "namespace": "default"},
            "data": {"k": "v"},
        }
    )
    listed = json.loads(run("get", "configmap", "-o", "json").stdout)
    assert [(i["metadata"]["name"], i["data"]) for i in listed["items"]] == [("cfg", {"k": "v"})]
    run("delete", "configmap", "cfg")
    assert emulator.get("v1", "configmaps", "cfg", "default") is None
    missing = run("get", "configmap", "cfg", check=False)
    assert missing.returncode != 0 and "NotFound" in missing.stderr


def test_kubectl_applies_crd_then_custom_resource(run: Kubectl, emulator: KubeEmulator) -> None:
    crd = crd_manifest(
        "confkv.io",
        "v1alpha1",
        "ConfKVDeployment",
        short_names=("ckv",),
        scale=True,
        printer_columns=({"name": "Phase", "type": "string", "jsonPath": ".status.phase"},),
    )
    run("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(crd))
    resource = {
        "apiVersion": "confkv.io/v1alpha1",
        "kind": "ConfKVDeployment",
        "metadata": {"name": "demo"},
        "spec": {"replicas": 1, "model": "smollm2"},
    }
    assert "created" in run("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(resource)).stdout
    resource["spec"]["replicas"] = 2
    assert "configured" in run("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(resource)).stdout
    stored = emulator.get("confkv.io/v1alpha1", "ckv", "demo", "default")
    assert stored is not None and stored["spec"]["replicas"] == 2 and stored["metadata"]["generation"] == 2
    emulator.patch_status("confkv.io/v1alpha1", "ckv", "demo", {"phase": "Serving"}, "default")
    table = run("get", "ckv").stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "AGE"] and table[1].split()[:2] == ["demo", "Serving"]
    run("scale", "ckv", "demo", "--replicas=3")
    got = json.loads(run("get", "confkvdeployment", "demo", "-o", "json").stdout)
    assert got["spec"]["replicas"] == 3
    run("delete", "ckv", "demo")
    assert "No resources found" in run("get", "ckv").stderr
    verbs = {(r.verb, r.resource) for r in emulator.request_log}
    assert {
        ("create", "confkvdeployments"),
        ("patch", "confkvdeployments"),
        ("delete", "confkvdeployments"),
        ("patch", "confkvdeployments/scale"),
    } <= verbs
