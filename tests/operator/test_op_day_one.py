"""A GPU deployment's first day, with the operator under Kopf against the API emulator: the example's
claims are created and its pods fit real H100/A100 nodes, spec edits that remove fields reach the
Deployment (server-side apply), a slow first start reads Progressing and an engine that exits says why,
gpusPerPod > 1 renders a tensor-parallel pod, and nodes > 1 a LeaderWorkerSet once its API exists.

The emulator runs no scheduler and no kubelet: pods and their statuses are written here as the kubelet
would report them, and scheduling is checked with the scheduler's label and taint filters
(``testkit.k8s_emulator.scheduling``), not its resource fit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from confkv_operator import names as n
from testkit.k8s_emulator import KubeEmulator
from testkit.k8s_emulator.scheduling import fits
from testkit.operator_harness import API_VERSION, cr, install_optional_crds

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("operator")]
ROOT = Path(__file__).resolve().parents[2]
NS = "default"
LWS = "leaderworkerset.x-k8s.io/v1"
GPU_TAINT = [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
# Labels GPU Feature Discovery puts on real nodes (product and memory in MiB as the driver reports it).
NODES = {
    "h100-80gb": {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                  "nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.count": "8"},
    "a100-80gb": {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
                  "nvidia.com/gpu.memory": "81920", "nvidia.com/gpu.count": "8"},
    "a100-40gb": {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
                  "nvidia.com/gpu.memory": "40960", "nvidia.com/gpu.count": "8"},
    "l4": {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-L4",
           "nvidia.com/gpu.memory": "23034", "nvidia.com/gpu.count": "1"},
    "cpu-only": {"kubernetes.io/os": "linux"},
}


def wait(condition: Any, message: str, timeout: float = 20.0) -> Any:
    return KubeEmulator.wait_for(condition, timeout=timeout, message=message)


def get_cr(api: KubeEmulator, name: str) -> dict[str, Any]:
    return api.get(API_VERSION, "ckv", name, NS) or {}


def condition(api: KubeEmulator, name: str, ctype: str) -> dict[str, Any]:
    conditions = (get_cr(api, name).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == ctype), {})


def pod_spec(api: KubeEmulator, name: str) -> dict[str, Any]:
    return api.get("apps/v1", "deployments", name, NS)["spec"]["template"]["spec"]


def test_gpu_example_creates_its_claims_and_fits_80gb_gpu_nodes(emulator: KubeEmulator) -> None:
    example = yaml.safe_load((ROOT / "examples" / "gpu-32b.yaml").read_text())
    emulator.create({**example, "metadata": {**example["metadata"], "namespace": NS}})
    name = example["metadata"]["name"]
    claims = [wait(lambda c=c: emulator.get("v1", "persistentvolumeclaims", c, NS), f"claim {c}")
              for c in ("qwen25-32b-weights", "qwen25-32b-nvme-cache")]
    for claim in claims:
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        assert "ownerReferences" not in claim["metadata"]  # kept when the CR is deleted
    assert claims[0]["spec"]["resources"]["requests"]["storage"] == "100Gi"
    dep = wait(lambda: emulator.get("apps/v1", "deployments", name, NS), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    engine = next(c for c in pod["containers"] if c["name"] == n.ENGINE_CONTAINER)
    assert engine["image"].endswith("-cuda") and engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    fitting = sorted(node for node, labels in NODES.items() if fits(pod, labels, GPU_TAINT))
    assert fitting == ["a100-80gb", "h100-80gb"]
    # The old exact selector matched no H100: its driver reports 81559 MiB.
    assert not fits({**pod, "affinity": None, "nodeSelector": {"nvidia.com/gpu.memory": "81920"}},
                    NODES["h100-80gb"], GPU_TAINT)
    emulator.delete(API_VERSION, "ckv", name, NS)
    wait(lambda: emulator.get(API_VERSION, "ckv", name, NS) is None, "CR deleted")
    assert emulator.get("v1", "persistentvolumeclaims", "qwen25-32b-weights", NS) is not None


def test_removed_fields_reach_the_deployment(emulator: KubeEmulator) -> None:
    spec = {"model": {"source": "/models/qwen", "hfId": "Qwen/Qwen2.5-0.5B-Instruct"},
            "resources": {"gpusPerPod": 1, "requests": {"cpu": "4", "memory": "16Gi"},
                          "limits": {"memory": "32Gi"}, "nodeSelector": {"nvidia.com/gpu.present": "true"},
                          "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}}
    emulator.create(cr("strip", spec))
    dep = wait(lambda: emulator.get("apps/v1", "deployments", "strip", NS), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["nodeSelector"] and pod["tolerations"]
    assert pod["initContainers"][0]["name"] == n.FETCH_CONTAINER

    def engine() -> dict[str, Any]:
        return next(c for c in pod_spec(emulator, "strip")["containers"] if c["name"] == n.ENGINE_CONTAINER)

    removals = [
        ({"resources": {"nodeSelector": None}}, lambda p: "nodeSelector" not in p),
        ({"resources": {"tolerations": None}}, lambda p: "tolerations" not in p),
        ({"resources": {"limits": {"memory": None}}},
         lambda p: "memory" not in engine()["resources"]["limits"]),
        ({"resources": {"requests": {"cpu": None}}},
         lambda p: "cpu" not in engine()["resources"]["requests"]),
        ({"model": {"hfId": None, "source": "builtin:smollm2-135m"}},
         lambda p: [c["name"] for c in p["initContainers"]] == [n.AGENT_CONTAINER]),
    ]
    for change, gone in removals:
        emulator.patch(API_VERSION, "ckv", "strip", {"spec": change}, NS)
        wait(lambda gone=gone: gone(pod_spec(emulator, "strip")), f"removal of {change}")
    pod = pod_spec(emulator, "strip")
    assert "model" not in {v["name"] for v in pod["volumes"]}  # the download's emptyDir went with it
    assert "model" not in {m["name"] for m in engine()["volumeMounts"]}
    assert engine()["resources"]["requests"] == {"memory": "16Gi"}
    assert engine()["resources"]["limits"] == {"nvidia.com/gpu": "1"}


def _pod(owner: str, status: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{owner}-abc12", "namespace": NS, "labels": n.selector_labels(owner)},
            "spec": {"containers": [{"name": n.ENGINE_CONTAINER, "image": "x"}]}, "status": status}


def test_slow_first_start_is_progressing_and_an_engine_exit_says_why(emulator: KubeEmulator) -> None:
    emulator.create(cr("slow", {"model": {"source": "/models/qwen", "hfId": "Qwen/Qwen2.5-32B-Instruct"},
                                "resources": {"gpusPerPod": 1}}))
    dep = wait(lambda: emulator.get("apps/v1", "deployments", "slow", NS), "Deployment")
    assert dep["spec"]["progressDeadlineSeconds"] >= 3600 + 1800  # the download plus the loading window
    emulator.patch_deployment_status("slow", NS, ready=False, progress="ReplicaSetUpdated")
    pod = emulator.create(_pod("slow", {}))
    emulator.patch_status("v1", "pods", pod["metadata"]["name"], {"initContainerStatuses": [
        {"name": n.FETCH_CONTAINER, "state": {"running": {"startedAt": "2026-12-01T00:00:00Z"}}}]}, NS)
    wait(lambda: condition(emulator, "slow", "Progressing").get("reason") == "DownloadingModel",
         "downloading")
    assert get_cr(emulator, "slow")["status"]["phase"] == "Progressing"
    assert condition(emulator, "slow", "Degraded")["status"] == "False"
    running = {"name": n.ENGINE_CONTAINER, "ready": False, "started": False,
               "state": {"running": {"startedAt": "2026-12-01T00:40:00Z"}}}
    emulator.patch_status("v1", "pods", pod["metadata"]["name"],
                          {"initContainerStatuses": [], "containerStatuses": [running]}, NS)
    wait(lambda: condition(emulator, "slow", "Progressing").get("reason") == "LoadingModel", "loading")
    message = "device cuda requested but torch.cuda.is_available() is False (no GPU in this container)"
    exited = {**running, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
              "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message}}}
    emulator.patch_status("v1", "pods", pod["metadata"]["name"], {"containerStatuses": [exited]}, NS)
    degraded = wait(lambda: (c := condition(emulator, "slow", "Degraded")).get("status") == "True" and c,
                    "Degraded with the engine's message")
    assert degraded["reason"] == "EngineExited" and "device cuda requested but" in degraded["message"]
    assert get_cr(emulator, "slow")["status"]["phase"] == "Degraded"


def test_gpus_per_pod_above_one_renders_a_tensor_parallel_pod(emulator: KubeEmulator) -> None:
    emulator.create(cr("twogpu", {"resources": {"gpusPerPod": 2}, "engine": {"device": "cuda"}}))
    deployment = wait(lambda: emulator.get("apps/v1", "deployments", "twogpu", NS), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (engine,) = [c for c in pod["containers"] if c["name"] == n.ENGINE_CONTAINER]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    config = json.loads(emulator.get("v1", "configmaps", "twogpu-config", NS)["data"][n.CONFIG_FILE])
    assert config["engine"]["tensorParallel"] == 2  # one rank per GPU of the pod
    wait(lambda: condition(emulator, "twogpu", "InvalidSpec").get("status") == "False", "a valid spec")


def test_gpus_that_contradict_tensor_parallel_are_refused_with_a_condition(emulator: KubeEmulator) -> None:
    emulator.create(cr("contra", {"resources": {"gpusPerPod": 2}, "engine": {"tensorParallel": 4}}))
    invalid = wait(lambda: (c := condition(emulator, "contra", "InvalidSpec")).get("status") == "True" and c,
                   "InvalidSpec")
    assert "engine.tensorParallel 4 contradicts nodes x resources.gpusPerPod = 2" in invalid["message"]
    assert emulator.get("apps/v1", "deployments", "contra", NS) is None


def test_nodes_without_the_leader_worker_set_api_say_so_then_render_one(emulator: KubeEmulator) -> None:
    """A cluster without the LWS CRD: a clear condition, the operator stays up; once the CRD is
    installed the next resync creates the LeaderWorkerSet and its status drives the CR's."""
    emulator.create(cr("group", {"nodes": 2, "resources": {"gpusPerPod": 4}}))
    degraded = wait(lambda: (c := condition(emulator, "group", "Degraded")).get("status") == "True" and c,
                    "Degraded without the LWS API")
    assert degraded["reason"] == "LeaderWorkerSetNotInstalled"
    assert "install the LeaderWorkerSet controller" in degraded["message"]
    assert emulator.get("apps/v1", "deployments", "group", NS) is None
    install_optional_crds(emulator, "lws")
    lws = wait(lambda: emulator.get(LWS, "leaderworkersets", "group", NS), "LeaderWorkerSet", timeout=30)
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and lws["metadata"]["ownerReferences"][0]["kind"] == "ConfKVDeployment"
    config = json.loads(emulator.get("v1", "configmaps", "group-config", NS)["data"][n.CONFIG_FILE])
    assert config["engine"]["tensorParallel"] == 8  # 2 nodes x 4 GPUs, one group
    service = emulator.get("v1", "services", "group", NS)
    assert service["spec"]["selector"]["confkv.io/role"] == "leader"
    emulator.patch_status(LWS, "leaderworkersets", "group", {
        "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1,
        "observedGeneration": lws["metadata"]["generation"],
        "conditions": [{"type": "Available", "status": "True", "reason": "AllGroupsReady"}]}, NS)
    wait(lambda: get_cr(emulator, "group").get("status", {}).get("phase") == "Running", "Running")
    assert condition(emulator, "group", "Degraded")["status"] == "False"
