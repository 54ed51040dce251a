"""The agent's recording and collection edges: Events and the last-remediation annotation through the
real ``kubernetes`` client against the API emulator (within the agent Role the operator grants),
the operator reading that annotation back, NVML with a stand-in library, and the fallback."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from confkv_agent.collect import NvmlReader, vram_reading
from confkv_agent.kube import KubeRecorder
from confkv_agent.logs import JsonFormatter, utc_iso
from confkv_api.resources import LAST_REMEDIATION_ANNOTATION
from confkv_api.v1 import control_pb2 as pb
from confkv_operator.rbac import AGENT_RULES, expand
from confkv_operator.status import last_remediation
from testkit.k8s_emulator import KubeEmulator, crd_manifest

NS = "serving"


@pytest.fixture
def cluster() -> Iterator[KubeEmulator]:
    with KubeEmulator(namespaces=("default", NS)) as api:
        api.create(crd_manifest("confkv.io", "v1alpha1", "ConfKVDeployment", plural="confkvdeployments"))
        api.create({"apiVersion": "confkv.io/v1alpha1", "kind": "ConfKVDeployment",
                    "metadata": {"name": "demo", "namespace": NS}, "spec": {}})
        api.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "demo-abc", "namespace": NS},
                    "spec": {"containers": [{"name": "confkv-engine", "image": "x"}]}})
        api.clear_log()
        yield api


def test_events_and_annotation_reach_the_cluster_within_the_agent_role(cluster: KubeEmulator) -> None:
    rec = KubeRecorder({"POD_NAME": "demo-abc", "POD_NAMESPACE": NS, "CONFKV_DEPLOYMENT": "demo",
                        "KUBECONFIG": str(cluster.kubeconfig_path)})
    assert rec.enabled, rec.reason
    rec.event(1_800_000_000.0, "Remediated", "latencyMs: smallerBatches(engine.maxBatchSize=48)")
    rec.annotate({"time": utc_iso(1_800_000_000.0), "alert": "latencyMs", "action": "smallerBatches",
                  "result": "applied", "message": "policy version 2"})
    events = cluster.list("v1", "events", NS)
    kinds = sorted(e["involvedObject"]["kind"] for e in events)
    assert kinds == ["ConfKVDeployment", "Pod"]
    assert {e["reason"] for e in events} == {"Remediated"}
    pod = cluster.get("v1", "pods", "demo-abc", NS)
    assert pod is not None
    record = json.loads(pod["metadata"]["annotations"][LAST_REMEDIATION_ANNOTATION])
    assert record["action"] == "smallerBatches"
    # The operator's status code reads what the agent wrote.
    assert last_remediation([pod]) == {**record, "pod": "demo-abc"}
    assert cluster.rbac_usage() <= expand(AGENT_RULES)


def test_recording_is_off_outside_a_pod_and_never_raises() -> None:
    rec = KubeRecorder({})
    assert not rec.enabled and "POD_NAME" in rec.reason
    rec.event(0.0, "AlertFiring", "x")
    rec.annotate({"time": utc_iso(0.0)})


def test_annotation_times_sort_in_time_order() -> None:
    stamps = [utc_iso(t) for t in (9.5, 10.0, 100.25, 1_000_000.0)]
    assert stamps == sorted(stamps) and stamps[0] == "1970-01-01T00:00:09.500000Z"


class FakeNvml:
    """The part of pynvml the collector calls."""

    def __init__(self, mem: list[tuple[int, int]], fail_init: Exception | None = None) -> None:
        self.mem, self.fail_init = mem, fail_init
        self.shutdowns = 0

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        if self.fail_init is not None:
            raise self.fail_init

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.mem)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        return i

    def nvmlDeviceGetUUID(self, h: int) -> bytes:  # noqa: N802
        return f"GPU-{h:04d}".encode()

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:  # noqa: N802
        used, total = self.mem[h]
        return SimpleNamespace(used=used, total=total)


def _status(used: int, total: int, device: str = "cpu") -> pb.EngineStatus:
    return pb.EngineStatus(device_memory=pb.DeviceMemory(device=device, used_bytes=used, total_bytes=total))


def test_nvml_uses_the_fullest_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = NvmlReader(FakeNvml([(10, 100), (90, 100), (50, 100)]))
    reading = vram_reading(nvml, _status(1, 2))
    assert (reading.source, reading.device, reading.fraction) == ("nvml", "gpu0,gpu1,gpu2", 0.9)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,GPU-0002")
    reading = vram_reading(nvml, _status(1, 2))
    assert (reading.device, reading.fraction) == ("gpu0,gpu2", 0.5)


def test_without_nvml_the_engine_report_is_used_and_said(caplog: pytest.LogCaptureFixture) -> None:
    nvml = NvmlReader(FakeNvml([], fail_init=RuntimeError("NVML Shared Library Not Found")))
    assert not nvml.available and "NVML unavailable" in nvml.reason
    reading = vram_reading(nvml, _status(25, 100, "cuda:0"))
    assert (reading.source, reading.device, reading.fraction) == ("engine", "cuda:0", 0.25)
    assert vram_reading(nvml, None).fraction is None


def test_a_reserved_but_empty_kv_pool_does_not_read_as_a_full_gpu() -> None:
    # NVML (a fake library: no GPU here) sees 90 of 100 GiB used, 60 of them the engine's KV pool, of
    # which 55 hold nothing a running request needs: the alert compares 35%, not 90%.
    gib = 1 << 30
    status = pb.EngineStatus(device_memory=pb.DeviceMemory(device="cuda:0", used_bytes=90 * gib,
                                                           total_bytes=100 * gib,
                                                           effective_used_bytes=35 * gib),
                             kv_bytes_reclaimable=55 * gib)
    reading = vram_reading(NvmlReader(FakeNvml([(90 * gib, 100 * gib), (20 * gib, 100 * gib)])), status)
    assert reading.source == "nvml" and reading.fraction == pytest.approx(0.35)
    assert [g.used_bytes for g in reading.gpus] == [35 * gib, 20 * gib]  # only the engine's GPU
    no_nvml = NvmlReader(FakeNvml([], fail_init=RuntimeError("no driver")))
    assert vram_reading(no_nvml, status).fraction == pytest.approx(0.35)  # the engine's own figure
    mem = pb.DeviceMemory(device="cuda:0", used_bytes=90 * gib, total_bytes=100 * gib,
                          effective_used_bytes=88 * gib)
    full = pb.EngineStatus(device_memory=mem, kv_bytes_reclaimable=2 * gib)
    assert vram_reading(NvmlReader(FakeNvml([(90 * gib, 100 * gib)])), full).fraction == pytest.approx(0.88)


def test_json_logs_carry_structured_fields() -> None:
    record = logging.LogRecord("confkv.agent", logging.INFO, __file__, 1, "remediation %s", ("x",), None)
    record.fields = {"alert": "vram", "result": "applied"}
    doc = json.loads(JsonFormatter().format(record))
    assert doc["message"] == "remediation x" and doc["alert"] == "vram" and doc["level"] == "info"


def test_nvml_is_a_declared_dependency_and_off_cleanly_without_a_gpu() -> None:
    """pynvml's own errors (no library, no driver) and a driver that sees no GPU all turn NVML off with
    a reason; the agent then reads the engine's report, and ``read`` never raises."""
    import pynvml  # nvidia-ml-py: a main dependency, importable everywhere

    for code, words in ((pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "Library Not Found"),
                        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded")):
        nvml = NvmlReader(FakeNvml([], fail_init=pynvml.NVMLError(code)))
        assert not nvml.available and words in nvml.reason and nvml.read() == ()
    no_gpu = FakeNvml([])
    nvml = NvmlReader(no_gpu)
    assert not nvml.available and nvml.reason == "NVML sees no GPU" and no_gpu.shutdowns == 1
    reading = vram_reading(nvml, _status(3, 4))
    assert (reading.source, reading.device, reading.fraction) == ("engine", "cpu", 0.75)


def test_a_failing_nvml_read_falls_back_to_the_engine_report() -> None:
    fake = FakeNvml([(10, 100)])
    nvml = NvmlReader(fake)
    assert nvml.available

    def lost(handle: int) -> Any:
        raise RuntimeError("GPU is lost")

    fake.nvmlDeviceGetMemoryInfo = lost  # type: ignore[method-assign]
    reading = vram_reading(nvml, _status(1, 4, "cuda:0"))
    assert (reading.source, reading.fraction) == ("engine", 0.25)
