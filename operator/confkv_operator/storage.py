"""Pure builders of the PersistentVolumeClaims a spec asks the operator to create (``createClaim`` under
``modelStorage`` or ``cacheStorage``).

A claim is created when absent and never patched afterwards (``Kube.ensure_absent_only``): a bound
claim's spec is immutable, and the data on it (a 65 GB download) outlives spec edits. A claim with
``retainOnDelete`` (the default) carries no ownerReference, so deleting the CR keeps it; without it, the
claim is owned by the CR and goes with it.
"""

from __future__ import annotations

from typing import Any

from confkv_api.cluster import ClaimSpec
from confkv_api.deployment import DeploymentSpec

from . import names as n

Obj = dict[str, Any]


def _claim(owner: str, claim_name: str, size: str, claim: ClaimSpec) -> Obj:
    spec: dict[str, Any] = {"accessModes": [claim.access_mode], "resources": {"requests": {"storage": size}}}
    if claim.storage_class_name:
        spec["storageClassName"] = claim.storage_class_name
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim_name, "labels": n.common_labels(owner)}, "spec": spec}


def build_claims(name: str, spec: DeploymentSpec) -> list[tuple[Obj, bool]]:
    """(claim, owned by the CR) for each claim to create."""
    out = []
    for storage in (spec.model_storage, spec.cache_storage):
        claim = storage.create_claim
        if claim is not None and storage.claim_name and storage.size:
            out.append((_claim(name, storage.claim_name, storage.size, claim), not claim.retain_on_delete))
    return out
