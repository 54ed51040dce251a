"""Run the real operator (Kopf + confkv_operator handlers) in-process against a KubeEmulator.

Kopf runs in its own thread and event loop; ``stop()`` sets Kopf's stop flag and joins the thread.
Used by tests/operator and bench/ops/operator.py.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import yaml

from confkv_operator.kube import Kube
from confkv_operator.main import run_operator
from confkv_operator.settings import OperatorSettings, load_settings

ROOT = Path(__file__).resolve().parents[1]
CRD_PATH = ROOT / "crds" / "confkvdeployments.confkv.io.yaml"
API_VERSION = "confkv.io/v1alpha1"
OPEN_SCHEMA = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
OPTIONAL_CRDS = {"monitoring": (("monitoring.coreos.com", "v1", "ServiceMonitor", "servicemonitors"),
                                 ("monitoring.coreos.com", "v1", "PrometheusRule", "prometheusrules")),
                  "keda": (("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects"),),
                  "inference": (("inference.networking.k8s.io", "v1", "InferencePool", "inferencepools"),),
                  "lws": (("leaderworkerset.x-k8s.io", "v1", "LeaderWorkerSet", "leaderworkersets"),)}


def install_crds(api: Any, monitoring: bool = False, keda: bool = False, inference: bool = False,
                 lws: bool = False) -> None:
    """The ConfKVDeployment CRD, and optionally minimal prometheus-operator, KEDA, Inference
    Extension and LeaderWorkerSet CRDs (open schemas: the contract tests validate against the real ones)."""
    api.create(yaml.safe_load(CRD_PATH.read_text()))
    wanted = {"monitoring": monitoring, "keda": keda, "inference": inference, "lws": lws}
    for key in (key for key in OPTIONAL_CRDS if wanted[key]):
        install_optional_crds(api, key)


def install_optional_crds(api: Any, key: str) -> None:
    """The minimal CRDs of one ``OPTIONAL_CRDS`` entry (also into a running emulator: an operator
    already running discovers them at its next resync)."""
    for group, version, kind, plural in OPTIONAL_CRDS[key]:
        api.create({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{group}"},
            "spec": {"group": group, "scope": "Namespaced",
                     "names": {"kind": kind, "plural": plural, "singular": kind.lower(),
                               "listKind": f"{kind}List"},
                     "versions": [{"name": version, "served": True, "storage": True, "schema": {
                         "openAPIV3Schema": OPEN_SCHEMA}}]},
        })


def cr(name: str, spec: dict[str, Any] | None = None, namespace: str = "default") -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "ConfKVDeployment",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec or {}}


class OperatorThread:
    """``with OperatorThread(api, resync_seconds=0.5):`` runs the operator until the block ends."""

    def __init__(self, api: Any, resync_seconds: float = 0.5, **env: str) -> None:
        self.settings: OperatorSettings = load_settings(
            {"CONFKV_RESYNC_SECONDS": str(resync_seconds), "CONFKV_LIVENESS_PORT": "0", **env})
        self.kube = Kube(api.api_client())
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="confkv-operator", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(run_operator(self.settings, self._stop, self._ready, liveness=False, kube=self.kube))
        except BaseException as err:  # surfaced by stop(): a crashed operator fails the test
            self._error = err

    def start(self, timeout: float = 30.0) -> OperatorThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"operator not ready after {timeout}s: {self._error!r}")
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("operator did not stop")
        if self._error is not None:
            raise RuntimeError(f"operator crashed: {self._error!r}") from self._error

    def __enter__(self) -> OperatorThread:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
