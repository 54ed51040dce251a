"""Contract of the rendering of tensor-parallel deployments (pure builders): a pod of several GPUs
(``gpusPerPod > 1``: one rank per GPU, the degree in confkv.json, a memory-backed /dev/shm) and
groups across nodes (``nodes > 1``: a LeaderWorkerSet whose leader serves and whose workers join
its process group with LWS's variables)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from confkv_api.config import ConfigError
from confkv_api.deployment import load_deployment_spec
from confkv_operator import names as n
from confkv_operator.builders import OPTIONAL_KINDS, build_children
from confkv_operator.groups import RENDEZVOUS_PORT, ROLE_LABEL
from confkv_operator.pod import DOWNLOAD_ALLOWANCE_SECONDS, TP_SHM_SIZE
from confkv_operator.settings import OperatorSettings
from confkv_operator.status import missing_api_status

SETTINGS = OperatorSettings()


def _children(spec: dict[str, Any], served: frozenset[str] = OPTIONAL_KINDS) -> dict[str, dict[str, Any]]:
    built = build_children("llm", "serving", load_deployment_spec(spec), SETTINGS, served)
    return {c["kind"]: c for c in built}


def _config(children: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return json.loads(children["ConfigMap"]["data"][n.CONFIG_FILE])


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in [*pod.get("initContainers", []), *pod["containers"]] if c["name"] == name]
    return found


def test_a_pod_of_four_gpus_runs_four_ranks_with_shared_memory() -> None:
    children = _children({"resources": {"gpusPerPod": 4}})
    pod = children["Deployment"]["spec"]["template"]["spec"]
    engine = _container(pod, n.ENGINE_CONTAINER)
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert _config(children)["engine"]["tensorParallel"] == 4
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": TP_SHM_SIZE}} in pod["volumes"]
    assert "LeaderWorkerSet" not in children


def test_pod_shm_size_overrides_the_tensor_parallel_default_and_one_gpu_has_none() -> None:
    sized = _children({"resources": {"gpusPerPod": 2}, "pod": {"shmSize": "8Gi"}})["Deployment"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in \
        sized["spec"]["template"]["spec"]["volumes"]
    one = _children({"resources": {"gpusPerPod": 1}})
    assert _config(one)["engine"]["tensorParallel"] == 1
    assert not [v for v in one["Deployment"]["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm"]


@pytest.mark.parametrize(("spec", "message"), [
    ({"resources": {"gpusPerPod": 2}, "engine": {"tensorParallel": 3}},
     "contradicts nodes x resources.gpusPerPod"),
    ({"nodes": 2, "engine": {"tensorParallel": 3}}, "must be a multiple of nodes"),
    ({"nodes": 8, "resources": {"gpusPerPod": 16}}, "exceeds the largest tensor-parallel degree"),
])
def test_contradictory_parallelism_is_refused(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_deployment_spec(spec)


def test_nodes_render_a_leader_worker_set_whose_group_is_one_tensor_parallel_group() -> None:
    children = _children({"nodes": 2, "replicas": 3, "resources": {"gpusPerPod": 8}})
    assert "Deployment" not in children
    lws = children["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["replicas"] == 3
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert _config(children)["engine"]["tensorParallel"] == 16  # 2 nodes x 8 GPUs
    flags = ["--nnodes", "2", "--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr", "$(LWS_LEADER_ADDRESS)",
             "--master-port", str(RENDEZVOUS_PORT), "--join-timeout", "600"]
    for key, role in (("leaderTemplate", "leader"), ("workerTemplate", "worker")):
        template = group[key]
        assert template["metadata"]["labels"][ROLE_LABEL] == role
        engine = _container(template["spec"], n.ENGINE_CONTAINER)
        assert engine["command"][-len(flags):] == flags
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]


def test_the_leader_serves_and_the_workers_only_compute() -> None:
    lws = _children({"nodes": 2, "resources": {"gpusPerPod": 1}})["LeaderWorkerSet"]
    group = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = group["leaderTemplate"]["spec"], group["workerTemplate"]["spec"]
    engine = _container(leader, n.ENGINE_CONTAINER)
    assert {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"} in engine["ports"]
    assert {"readinessProbe", "livenessProbe", "startupProbe"} <= set(engine)
    _container(leader, n.AGENT_CONTAINER)  # the agent watches rank 0's engine
    assert [c["name"] for c in worker["containers"]] == [n.ENGINE_CONTAINER]
    assert "initContainers" not in worker
    assert not {"readinessProbe", "livenessProbe", "startupProbe", "ports"} & set(worker["containers"][0])
    assert n.API_TOKEN_VOLUME not in [v["name"] for v in worker["volumes"]]


def test_services_and_the_pool_select_leaders_and_the_group_reaches_itself() -> None:
    children = _children({"nodes": 2, "resources": {"gpusPerPod": 1}, "inferencePool": {"enabled": True}})
    assert children["Service"]["spec"]["selector"][ROLE_LABEL] == "leader"
    assert children["InferencePool"]["spec"]["selector"]["matchLabels"][ROLE_LABEL] == "leader"
    rules = children["NetworkPolicy"]["spec"]["ingress"]
    assert {"from": [{"podSelector": {"matchLabels": n.selector_labels("llm")}}]} in rules
    single = _children({"resources": {"gpusPerPod": 1}})
    assert ROLE_LABEL not in single["Service"]["spec"]["selector"]
    assert all("ports" in rule for rule in single["NetworkPolicy"]["spec"]["ingress"])


def test_without_the_leader_worker_set_api_no_workload_is_rendered() -> None:
    children = _children({"nodes": 2, "resources": {"gpusPerPod": 1}}, OPTIONAL_KINDS - {"LeaderWorkerSet"})
    assert "LeaderWorkerSet" not in children and "Deployment" not in children
    status = missing_api_status("install it", 3)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert status["phase"] == "Degraded" and conditions["Degraded"]["status"] == "True"
    assert conditions["Ready"]["reason"] == "LeaderWorkerSetNotInstalled"
    assert conditions["InvalidSpec"]["status"] == "False"


def test_a_group_that_downloads_its_weights_waits_longer_for_its_nodes() -> None:
    spec = {"nodes": 2, "resources": {"gpusPerPod": 1},
            "model": {"hfId": "Qwen/Qwen2.5-72B-Instruct", "source": "/models/qwen"}}
    group = _children(spec)["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        command = _container(group[key]["spec"], n.ENGINE_CONTAINER)["command"]
        assert command[command.index("--join-timeout") + 1] == str(600 + DOWNLOAD_ALLOWANCE_SECONDS)
        _container(group[key]["spec"], n.FETCH_CONTAINER)  # every pod downloads its own copy
