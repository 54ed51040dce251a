"""The partial pod-template override (``spec.pod.template``), merged over the rendered template.

The merge follows strategic merge patch for the lists a pod spec merges by key (containers, init
containers and volumes by name, env by name, volume mounts by mount path): an override item with the
key of a rendered item is merged into it, others are appended. Maps merge key by key; scalars and
other lists replace. What the override may touch is checked beforehand
(``confkv_api.cluster.check_template``), so the merge never has to decide whether it is allowed.
"""

from __future__ import annotations

import copy
from typing import Any

_LIST_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath", "imagePullSecrets": "name"}


def _merge_list(base: list[Any], extra: list[Any], key: str) -> list[Any]:
    out = [copy.deepcopy(item) for item in base]
    for item in extra:
        index = next((i for i, old in enumerate(out) if isinstance(old, dict) and isinstance(item, dict)
                      and old.get(key) == item.get(key)), None)
        if index is None:
            out.append(copy.deepcopy(item))
        else:
            out[index] = merge(out[index], item)
    return out


def merge(base: Any, extra: Any, field: str = "") -> Any:
    """``base`` with ``extra`` merged in (neither is modified)."""
    if isinstance(base, dict) and isinstance(extra, dict):
        out = copy.deepcopy(base)
        for key, value in extra.items():
            out[key] = merge(out[key], value, key) if key in out else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(extra, list) and field in _LIST_KEYS:
        return _merge_list(base, extra, _LIST_KEYS[field])
    return copy.deepcopy(extra)


def merge_template(template: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """The rendered pod template with the user's partial template merged over it."""
    return merge(template, override)
