"""The real kubectl against the emulator with the operator running: apply, get, wait, scale."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import pytest

from testkit.k8s_emulator import KubeEmulator
from testkit.operator_harness import ROOT

KUBECTL = shutil.which("kubectl")
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("operator"),
    # In CI (`make test` installs kubectl) a missing kubectl fails the test instead of skipping it.
    pytest.mark.skipif(KUBECTL is None and not os.environ.get("CI"),
                       reason="no kubectl (scripts/install-tools.sh installs it)"),
]


def kubectl(api: KubeEmulator, *args: str, timeout: float = 60.0) -> str:
    done = subprocess.run([KUBECTL, "--kubeconfig", api.kubeconfig_path, *args], capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout


def test_apply_get_wait_scale_delete(emulator: KubeEmulator) -> None:
    example = ROOT / "examples" / "cpu-embedded.yaml"
    assert "created" in kubectl(emulator, "apply", "--validate=false", "-f", str(example))
    assert "smollm2-cpu" in kubectl(emulator, "get", "ckv")
    kubectl(emulator, "wait", "--for=jsonpath={.status.phase}=Progressing", "ckv/smollm2-cpu",
            "--timeout=30s")
    deployment = KubeEmulator.wait_for(lambda: _deployment(emulator), timeout=20, message="deployment")
    assert deployment["spec"]["template"]["spec"]["initContainers"][0]["name"] == "confkv-agent"
    emulator.patch_deployment_status("smollm2-cpu", "default", ready=True)
    kubectl(emulator, "wait", "--for=jsonpath={.status.phase}=Running", "ckv/smollm2-cpu", "--timeout=30s")
    assert kubectl(emulator, "get", "ckv", "smollm2-cpu", "-o", "jsonpath={.status.readyReplicas}") == "1"

    kubectl(emulator, "scale", "ckv/smollm2-cpu", "--replicas=3")
    KubeEmulator.wait_for(lambda: _replicas(emulator) == 3, timeout=20, message="scaled deployment")

    kubectl(emulator, "delete", "-f", str(example), "--wait=true", "--timeout=30s")
    KubeEmulator.wait_for(lambda: _replicas(emulator) is None, timeout=20, message="children deleted")


def _deployment(api: KubeEmulator) -> Any:
    return api.get("apps/v1", "deployments", "smollm2-cpu", "default")


def _replicas(api: KubeEmulator) -> Any:
    deployment = _deployment(api)
    return None if deployment is None else deployment["spec"]["replicas"]
