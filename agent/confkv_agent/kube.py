"""Kubernetes recording: Events and the pod annotation the operator summarises into the CR status.

On when the agent runs in a pod (``POD_NAME``/``POD_NAMESPACE`` from the downward API, in-cluster
credentials; ``KUBECONFIG`` is honoured for tests and local runs). It is best effort: an API error is
logged and never stops the control loop. Events go to the pod and, when ``CONFKV_DEPLOYMENT`` names
it, to the ConfKVDeployment.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from typing import Any

from confkv_api.resources import (
    CR_API_VERSION,
    CR_GROUP,
    CR_KIND,
    CR_PLURAL,
    CR_VERSION,
    LAST_REMEDIATION_ANNOTATION,
)

from .logs import utc_iso

log = logging.getLogger("confkv.agent.kube")

COMPONENT = "confkv-agent"


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
                targets.append({"apiVersion": CR_API_VERSION, "kind": CR_KIND,
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
