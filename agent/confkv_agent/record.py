"""Record: agent metrics and ``/health`` on the agent's HTTP port, Kubernetes Events and the pod
annotation the operator summarises into the CR status, and structured (JSON) logs.

Kubernetes recording is on when the agent runs in a pod (``POD_NAME``/``POD_NAMESPACE`` from the
downward API, in-cluster credentials; ``KUBECONFIG`` is honoured for tests and local runs). It is
best effort: an API error is logged and never stops the control loop. Events go to the pod and, when
``CONFKV_DEPLOYMENT`` names it, to the ConfKVDeployment.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from confkv_api import metrics as names

from .rules import ALERTS, AlertState

log = logging.getLogger("confkv.agent.record")

#: Read by the operator (confkv_operator.names.LAST_REMEDIATION_ANNOTATION; a unit test keeps them equal).
LAST_REMEDIATION_ANNOTATION = "confkv.io/last-remediation"
CR_GROUP, CR_VERSION, CR_PLURAL, CR_KIND = "confkv.io", "v1alpha1", "confkvdeployments", "ConfKVDeployment"
COMPONENT = "confkv-agent"


def utc_iso(ts: float) -> str:
    """RFC 3339 UTC with a ``Z``: sorts lexically in time order (the operator compares them as strings)."""
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class JsonFormatter(logging.Formatter):
    """One JSON object per line; ``extra={"fields": {...}}`` adds structured fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"time": utc_iso(record.created), "level": record.levelname.lower(),
                               "logger": record.name, "message": record.getMessage()}
        doc.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    """Human-readable lines; structured fields follow as ``key=value``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None) or {}
        extra = "".join(f" {k}={json.dumps(v, default=str)}" for k, v in fields.items())
        return super().format(record) + extra


def _suffixless(name: str) -> str:
    return name.removesuffix("_total")


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.alert_state = Gauge(names.AGENT_ALERT_STATE, "1 for each alert's current state.",
                                 ["alert", "state"], registry=r)
        self.alert_value = Gauge(names.AGENT_ALERT_VALUE, "The value each rule last compared.", ["alert"],
                                 registry=r)
        self.remediations = Counter(_suffixless(names.AGENT_REMEDIATIONS), "Remediation steps by result.",
                                    ["alert", "action", "result"], registry=r)
        self.vram = Gauge(names.AGENT_VRAM_USED_RATIO, "Used VRAM fraction (fullest GPU) and its source.",
                          ["source", "device"], registry=r)
        self.engine_up = Gauge(names.AGENT_ENGINE_UP, "1 when the engine's control socket answers.",
                               registry=r)
        self.policy_version = Gauge(names.AGENT_POLICY_VERSION, "The engine's live policy version.",
                                    registry=r)
        self.config_reloads = Counter(_suffixless(names.AGENT_CONFIG_RELOADS), "Config file reloads.",
                                      ["result"], registry=r)
        for alert in ALERTS:
            self.set_state(alert, AlertState.INACTIVE)

    def set_state(self, alert: str, state: AlertState) -> None:
        for s in AlertState:
            self.alert_state.labels(alert=alert, state=s.value).set(1 if s is state else 0)

    def set_value(self, alert: str, value: float | None) -> None:
        if value is not None:
            self.alert_value.labels(alert=alert).set(value)
            return
        try:
            self.alert_value.remove(alert)  # no data: no sample (a 0 would read as a real value)
        except KeyError:
            pass

    def set_vram(self, source: str, device: str, fraction: float | None) -> None:
        self.vram.clear()
        if fraction is not None:
            self.vram.labels(source=source, device=device).set(fraction)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def serve_http(host: str, port: int, metrics: AgentMetrics,
               health: Callable[[], tuple[bool, dict[str, Any]]]) -> ThreadingHTTPServer:
    """``/metrics`` and ``/health`` in a daemon thread; ``server_address`` of the result has the port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?")[0]
            if path == "/metrics":
                self._send(200, metrics.render(), CONTENT_TYPE_LATEST)
            elif path in ("/health", "/healthz", "/ready"):
                ok, body = health()
                self._send(200 if ok else 503, json.dumps(body).encode(), "application/json")
            else:
                self._send(404, b'{"error": "not found"}', "application/json")

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - probes are not news
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="confkv-agent-http", daemon=True).start()
    return server


class KubeRecorder:
    """Events and the last-remediation annotation; ``enabled`` False outside a pod."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        self.pod, self.namespace = env.get("POD_NAME", ""), env.get("POD_NAMESPACE", "")
        self.deployment = env.get("CONFKV_DEPLOYMENT", "")
        self.enabled = False
        self.reason = ""
        if not (self.pod and self.namespace):
            self.reason = "POD_NAME/POD_NAMESPACE not set (not running in a pod)"
            return
        try:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
                api = client.ApiClient()
            except config.ConfigException:  # not in a pod's service account: KUBECONFIG (tests, local runs)
                api = config.new_client_from_config(config_file=env.get("KUBECONFIG"))
            self.core = client.CoreV1Api(api)
            self.custom = client.CustomObjectsApi(api)
        except Exception as err:
            self.reason = f"no Kubernetes credentials: {err}"
            return
        self.enabled = True
        self._targets: list[dict[str, Any]] | None = None

    def _involved(self) -> list[dict[str, Any]]:
        if self._targets is None:
            pod = self.core.read_namespaced_pod(self.pod, self.namespace, _request_timeout=5)
            targets = [{"apiVersion": "v1", "kind": "Pod", "name": self.pod, "namespace": self.namespace,
                        "uid": pod.metadata.uid}]
            if self.deployment:
                cr = self.custom.get_namespaced_custom_object(CR_GROUP, CR_VERSION, self.namespace, CR_PLURAL,
                                                              self.deployment, _request_timeout=5)
                targets.append({"apiVersion": f"{CR_GROUP}/{CR_VERSION}", "kind": CR_KIND,
                                "name": self.deployment, "namespace": self.namespace,
                                "uid": cr["metadata"]["uid"]})
            self._targets = targets
        return self._targets

    def event(self, now: float, reason: str, message: str, warning: bool = False) -> None:
        if not self.enabled:
            return
        stamp = utc_iso(now).split(".")[0] + "Z"
        try:
            for target in self._involved():
                body = {
                    "apiVersion": "v1", "kind": "Event",
                    "metadata": {"name": f"{target['name']}.{uuid.uuid4().hex[:16]}",
                                 "namespace": self.namespace},
                    "involvedObject": target, "reason": reason, "message": message[:1024],
                    "type": "Warning" if warning else "Normal", "count": 1,
                    "firstTimestamp": stamp, "lastTimestamp": stamp,
                    "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
                    "reportingInstance": self.pod,
                }
                self.core.create_namespaced_event(self.namespace, body, _request_timeout=5)
        except Exception as err:
            log.warning("could not post Event %s: %s", reason, err)

    def annotate(self, record: dict[str, str]) -> None:
        if not self.enabled:
            return
        value = json.dumps(record, sort_keys=True)
        patch = {"metadata": {"annotations": {LAST_REMEDIATION_ANNOTATION: value}}}
        try:
            self.core.patch_namespaced_pod(self.pod, self.namespace, patch, _request_timeout=5)
        except Exception as err:
            log.warning("could not annotate pod %s: %s", self.pod, err)
