"""Operator settings, read from the environment once at start-up.

| variable | default | meaning |
|---|---|---|
| CONFKV_NAMESPACES | "" (cluster-wide) | comma-separated namespaces (globs allowed) to watch |
| CONFKV_WATCH_SCOPE | cluster | ``namespace``: only the exact CONFKV_NAMESPACES, no cluster-scoped reads |
| CONFKV_HOST_PATH_PREFIXES | "" (none) | comma-separated node directories a CR's hostPath cache may use |
| CONFKV_RESYNC_SECONDS | 30 | timer: drift correction, re-creation of deleted children, status |
| CONFKV_ENGINE_IMAGE | ghcr.io/confkv/confkv:0.1.0 | default engine image (spec.image.engine overrides) |
| CONFKV_ENGINE_CUDA_IMAGE | ghcr.io/confkv/confkv:0.1.0-cuda | engine image of GPU pods (image.engine wins) |
| CONFKV_AGENT_IMAGE | the engine image | default agent image (spec.image.agent overrides) |
| CONFKV_MONITORING_LABELS | "" | k=v,... labels on each ServiceMonitor/PrometheusRule (release=...) |
| CONFKV_AGENT_PORT | 9100 | the agent's HTTP port (/health, /metrics) |
| CONFKV_LIVENESS_PORT | 8080 | Kopf liveness endpoint port (0 disables it) |
| CONFKV_PEERING_PRIORITY | 0 | Kopf peering priority; only used when CONFKV_PEERING_NAME is set |
| CONFKV_PEERING_NAME | "" | Kopf peering object; empty = standalone (one operator replica) |
| CONFKV_LOG_LEVEL | INFO | Python log level |

``CONFKV_WATCH_SCOPE=namespace`` is the chart's namespaced install (a Role, not a ClusterRole): Kopf's
cluster-wide scans of CRDs and namespaces are switched off, so the namespaces must be exact names.
``CONFKV_HOST_PATH_PREFIXES`` is empty by default, which refuses every ``cacheStorage.type: hostPath``;
each prefix must be canonical (``confkv_api.deployment.HOST_PATH_PATTERN``) and "/" is never allowed.

More than one operator replica needs the Kopf peering CRD (shipped in the chart), a peering name, and a
distinct CONFKV_PEERING_PRIORITY per replica: equal priorities make Kopf operators pause each other.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from confkv_api.deployment import HOST_PATH_PATTERN

ENV_PREFIX = "CONFKV_"


class SettingsError(ValueError):
    """Bad operator settings; the message names the environment variable."""


class OperatorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    namespaces: tuple[str, ...] = ()
    watch_scope: Literal["cluster", "namespace"] = "cluster"
    host_path_prefixes: tuple[str, ...] = ()
    resync_seconds: float = Field(default=30.0, gt=0.0, le=86_400.0)
    engine_image: str = Field(default="ghcr.io/confkv/confkv:0.1.0", min_length=1)
    engine_cuda_image: str = Field(default="ghcr.io/confkv/confkv:0.1.0-cuda", min_length=1)
    agent_image: str = ""
    monitoring_labels: dict[str, str] = Field(default_factory=dict)
    agent_port: int = Field(default=9100, ge=1, le=65535)
    liveness_port: int = Field(default=8080, ge=0, le=65535)
    peering_priority: int = 0
    peering_name: str = ""
    log_level: str = "INFO"

    @field_validator("namespaces", "host_path_prefixes", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("monitoring_labels", mode="before")
    @classmethod
    def _labels(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        labels = {}
        for part in (p.strip() for p in value.split(",")):
            if not part:
                continue
            key, sep, val = part.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"{part!r} is not key=value")
            labels[key.strip()] = val.strip()
        return labels

    @field_validator("host_path_prefixes")
    @classmethod
    def _canonical_prefixes(cls, prefixes: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for prefix in prefixes:
            # One trailing slash is a harmless spelling ("/mnt/nvme/"); "/" itself becomes "" and fails.
            trimmed = prefix[:-1] if prefix.endswith("/") else prefix
            if not trimmed:
                raise ValueError("'/' would allow mounting the node's root filesystem")
            if not re.fullmatch(HOST_PATH_PATTERN, trimmed):
                raise ValueError(f"{prefix!r} is not an absolute path without '.', '..' or empty segments")
            out.append(trimmed)
        return tuple(out)

    @model_validator(mode="after")
    def _namespace_scope(self) -> OperatorSettings:
        if self.watch_scope == "namespace":
            if not self.namespaces:
                raise ValueError("CONFKV_WATCH_SCOPE=namespace needs CONFKV_NAMESPACES")
            globs = [ns for ns in self.namespaces if any(c in ns for c in "*?![]")]
            if globs:
                raise ValueError(f"CONFKV_WATCH_SCOPE=namespace needs exact namespaces, got {globs}")
        return self

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        if value.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR")
        return value.upper()

    @property
    def scans_cluster(self) -> bool:
        """Whether Kopf may list/watch CRDs and namespaces (cluster-scoped reads)."""
        return self.watch_scope == "cluster"

    @property
    def standalone(self) -> bool:
        return not self.peering_name

    @property
    def agent_image_or_default(self) -> str:
        return self.agent_image or self.engine_image

    @property
    def liveness_endpoint(self) -> str | None:
        return f"http://0.0.0.0:{self.liveness_port}/healthz" if self.liveness_port else None


def load_settings(environ: Mapping[str, str] | None = None) -> OperatorSettings:
    """Read ``CONFKV_*`` variables; unknown ``CONFKV_`` names are not an error (the engine has its own)."""
    environ = os.environ if environ is None else environ
    raw = {}
    for name in OperatorSettings.model_fields:
        key = ENV_PREFIX + name.upper()
        if key in environ:
            raw[name] = environ[key]
    try:
        return OperatorSettings.model_validate(raw)
    except ValidationError as err:
        problems = "; ".join(
            f"{ENV_PREFIX}{str(e['loc'][0]).upper()}: {e['msg']}" if e["loc"] else e["msg"]
            for e in err.errors()
        )
        raise SettingsError(f"invalid operator settings: {problems}") from None
