"""Patch formats: JSON merge patch, JSON patch, and approximations of strategic merge and apply.

Approximations (documented because tests may depend on them):
- strategic merge patch = JSON merge patch, except that lists of objects under the well-known keys
  below are merged item by item on their merge key (`name` for containers/env/volumes, ...);
  `$patch`, `$setElementOrder/...`, `$retainKeys` and `$deleteFromPrimitiveList/...` directives are
  dropped rather than honoured, except `$patch: delete` on a list item, which removes that item.
- server-side apply (`application/apply-patch+yaml`): `app` removes the fields the manager owned and no
  longer applies (`managed`), then strategic merge of the applied manifest; no conflicts.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import jsonpointer
import yaml

from .errors import ApiError, bad_request, invalid

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"
PATCH_TYPES = (MERGE, JSON_PATCH, STRATEGIC, APPLY)

# Merge keys of list fields in the built-in types we serve (from the Kubernetes OpenAPI
# `x-kubernetes-patch-merge-key`). Lists of objects elsewhere are replaced as a whole.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
    "ports": None,  # containerPort for containers, port for services: chosen from the items
    "conditions": "type",
    "ownerReferences": "uid",
    "tolerations": None,
}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch; returns a new value, inputs are not modified."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: dict[str, Any], ops: Any) -> dict[str, Any]:
    """RFC 6902 JSON patch; a failed `test` or a bad path is 422 Invalid, as in the real API server."""
    if not isinstance(ops, list):
        raise bad_request("json patch must be a list of operations")
    try:
        return jsonpatch.apply_patch(target, ops, in_place=False)
    except jsonpatch.InvalidJsonPatch as exc:
        raise bad_request(f"invalid json patch: {exc}") from exc
    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
        raise invalid(f"the server rejected our request due to an error in our request: {exc}") from exc


def _list_merge_key(field: str, items: list[Any]) -> str | None:
    if field not in _MERGE_KEYS or not items or not all(isinstance(i, dict) for i in items):
        return None
    key = _MERGE_KEYS[field]
    if key is None:
        for candidate in ("containerPort", "port", "key", "name"):
            if all(candidate in i for i in items):
                return candidate
        return None
    return key if all(key in i or i.get("$patch") == "delete" for i in items) else None


def _merge_list(current: Any, patch: list[Any], key: str) -> list[Any]:
    result = [copy.deepcopy(i) for i in current] if isinstance(current, list) else []
    for item in patch:
        index = next(
            (n for n, old in enumerate(result) if isinstance(old, dict) and old.get(key) == item.get(key)),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                result.pop(index)
        elif index is None:
            result.append(strategic_merge({}, item))
        else:
            result[index] = strategic_merge(result[index], item)
    return result


def strategic_merge(target: Any, patch: Any) -> Any:
    """Approximate strategic merge patch (see module docstring)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue  # directives: ordering/retain hints the emulator does not need
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and (merge_key := _list_merge_key(key, value)):
            result[key] = _merge_list(result.get(key), value, merge_key)
        else:
            result[key] = strategic_merge(result.get(key), value)
    return result


def decode_patch(content_type: str, raw: bytes) -> Any:
    """Parse a PATCH body according to its content type (apply patches are YAML, a JSON superset)."""
    try:
        if content_type == APPLY:
            return yaml.safe_load(raw.decode())
        return json.loads(raw)
    except (ValueError, yaml.YAMLError) as exc:
        raise bad_request(f"cannot decode {content_type} body: {exc}") from exc


def apply_patch(content_type: str, current: dict[str, Any], patch: Any) -> dict[str, Any]:
    if content_type == JSON_PATCH:
        return json_patch(current, patch)
    if not isinstance(patch, dict):
        raise bad_request(f"{content_type} body must be a JSON object")
    if content_type == MERGE:
        return merge_patch(current, patch)
    if content_type in (STRATEGIC, APPLY):
        return strategic_merge(current, patch)
    raise ApiError(
        415,
        f"the body of the request was in an unknown format - accepted media types include: "
        f"{', '.join(PATCH_TYPES)}",
    )
