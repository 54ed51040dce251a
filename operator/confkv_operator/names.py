"""Names, labels and annotation keys shared by builders, status and handlers (pure constants)."""

from __future__ import annotations

# The CR's identity and the agent's annotation are shared with the agent (re-exported here).
from confkv_api.resources import CR_GROUP as GROUP  # noqa: F401
from confkv_api.resources import CR_KIND as KIND  # noqa: F401
from confkv_api.resources import CR_PLURAL as PLURAL  # noqa: F401
from confkv_api.resources import CR_VERSION as VERSION  # noqa: F401
from confkv_api.resources import LAST_REMEDIATION_ANNOTATION  # noqa: F401

MANAGED_BY = "confkv-operator"

#: On the pod template: hash of the restart-only fields (model, engine) that live only in confkv.json.
RESTART_CHECKSUM_ANNOTATION = "confkv.io/restart-checksum"
#: Kopf progress and diff-base storage prefix on the CR.
KOPF_PREFIX = "confkv.io"
#: Kopf's finalizer on the CR (removed by the operator on deletion; children go by ownerReferences).
FINALIZER = "confkv.io/operator"

CONFIG_DIR = "/etc/confkv"
CONFIG_FILE = "confkv.json"
SOCKET_DIR = "/var/run/confkv"
ENGINE_CONTAINER = "confkv-engine"
AGENT_CONTAINER = "confkv-agent"
FETCH_CONTAINER = "fetch-model"
RUN_AS_USER = 10001
#: The agent's projected service account token: the path the kubernetes client's in-cluster loader reads.
API_TOKEN_VOLUME = "kube-api-access"
API_TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
API_TOKEN_SECONDS = 3607  # the kubelet's own default for automounted tokens (refreshed before expiry)


def config_map_name(name: str) -> str:
    return f"{name}-config"


def metrics_service_name(name: str) -> str:
    return f"{name}-metrics"


def agent_account_name(name: str) -> str:
    return f"{name}-agent"


def selector_labels(name: str) -> dict[str, str]:
    """Stable pod selector (never changes for the life of a CR: Deployment selectors are immutable)."""
    return {"app.kubernetes.io/name": "confkv", "app.kubernetes.io/instance": name}


def common_labels(name: str) -> dict[str, str]:
    return {**selector_labels(name), "app.kubernetes.io/managed-by": MANAGED_BY,
            "app.kubernetes.io/part-of": "confkv"}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))
