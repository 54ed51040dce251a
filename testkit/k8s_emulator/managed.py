"""Server-side apply's field ownership, as far as a client that applies whole objects needs it.

The real API server records, per field manager, the set of fields its last apply contained
(``metadata.managedFields``, ``fieldsType: FieldsV1``). When the same manager applies again, fields it
owned before and no longer applies are removed from the object, then the applied object is merged in.
That is what lets a controller drop a nodeSelector or an init container by applying an object without it.

What this emulates:
- ``FieldsV1`` sets: ``f:<name>`` for map keys, ``k:{"<key>":<value>}`` for items of associative lists
  (merge keys as in ``patching``; container ports by ``containerPort`` and ``protocol``, Service ports by
  ``port`` and ``protocol``), ``.`` for the item itself; other lists are atomic (one leaf).
- One ``Apply`` entry per manager in ``metadata.managedFields``; removal of the fields the manager's
  previous apply owned and the new one does not (then strategic merge of the applied object).
- Maps and lists a removal leaves empty are dropped (the real server leaves such an empty parent
  only when another manager owns it; no other manager is tracked here).

What it does not: ownership by ``Update`` operations (PUT, merge/strategic/JSON patches), conflicts
between managers (every apply behaves as ``force=true``), ``x-kubernetes-list-type`` of CRDs (lists of
custom resources are atomic unless their field name is a known merge key).
"""

from __future__ import annotations

import copy
import datetime
import json
from typing import Any

Path = tuple[str, ...]
Obj = dict[str, Any]

#: Associative lists: field name -> the item fields that identify an item.
_LIST_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",), "initContainers": ("name",), "ephemeralContainers": ("name",),
    "env": ("name",), "volumes": ("name",), "volumeMounts": ("mountPath",),
    "imagePullSecrets": ("name",), "ownerReferences": ("uid",), "conditions": ("type",),
}
_PORT_KEYS = (("containerPort", "protocol"), ("port", "protocol"))
_SKIPPED_META = ("managedFields", "resourceVersion", "uid", "creationTimestamp", "generation")


def _item_keys(field: str, items: list[Any]) -> tuple[str, ...] | None:
    if not items or not all(isinstance(item, dict) for item in items):
        return None
    if field == "ports":
        return next((keys for keys in _PORT_KEYS if all(keys[0] in item for item in items)), None)
    keys = _LIST_KEYS.get(field)
    return keys if keys and all(keys[0] in item for item in items) else None


def _item_segment(item: Obj, keys: tuple[str, ...]) -> str:
    ident = {key: item.get(key, "TCP" if key == "protocol" else None) for key in keys}
    return "k:" + json.dumps(ident, separators=(",", ":"), sort_keys=True)


def field_paths(value: Any, prefix: Path = ()) -> set[Path]:
    """The FieldsV1 leaves of an applied object: every field it sets, as paths of segments."""
    paths: set[Path] = set()
    if isinstance(value, dict):
        for key, sub in value.items():
            if not prefix and key == "metadata" and isinstance(sub, dict):
                sub = {k: v for k, v in sub.items() if k not in _SKIPPED_META}
            here = (*prefix, f"f:{key}")
            keys = _item_keys(key, sub) if isinstance(sub, list) else None
            if keys:
                for item in sub:
                    item_path = (*here, _item_segment(item, keys))
                    paths.add((*item_path, "."))
                    paths |= field_paths(item, item_path)
            elif isinstance(sub, dict) and sub:
                paths |= field_paths(sub, here)
            else:
                paths.add(here)
    return paths


def to_fields_v1(paths: set[Path]) -> Obj:
    tree: Obj = {}
    for path in sorted(paths):
        node = tree
        for segment in path:
            node = node.setdefault(segment, {})
    return tree


def from_fields_v1(tree: Obj, prefix: Path = ()) -> set[Path]:
    paths: set[Path] = set()
    for segment, sub in tree.items():
        here = (*prefix, segment)
        paths |= from_fields_v1(sub, here) if sub else {here}
    return paths


def _matches(item: Any, segment: str) -> bool:
    ident = json.loads(segment[2:])
    return isinstance(item, dict) and all(item.get(k, "TCP" if k == "protocol" else None) == v
                                          for k, v in ident.items())


def _remove(node: Any, path: Path) -> None:
    """Remove one leaf (or list item, for a ``.`` leaf) and prune the parents it leaves empty."""
    segment, rest = path[0], path[1:]
    if isinstance(node, dict) and segment.startswith("f:"):
        key = segment[2:]
        if key not in node:
            return
        if not rest:
            del node[key]
            return
        _remove(node[key], rest)
        if node[key] in ({}, []):
            del node[key]
    elif isinstance(node, list) and segment.startswith("k:"):
        index = next((i for i, item in enumerate(node) if _matches(item, segment)), None)
        if index is None:
            return
        if rest == (".",):
            node.pop(index)
            return
        _remove(node[index], rest)


def prune(obj: Obj, stale: set[Path]) -> Obj:
    """``obj`` without the stale paths; a removed list item takes its fields with it."""
    out = copy.deepcopy(obj)
    # Whole items first (their key fields identify them), then the remaining fields, deepest first.
    items = sorted((p for p in stale if p[-1] == "."), key=len, reverse=True)
    fields = sorted((p for p in stale if p[-1] != "."), key=len, reverse=True)
    for path in [*items, *fields]:
        _remove(out, path)
    return out


def owned(obj: Obj, manager: str) -> set[Path]:
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply":
            return from_fields_v1(entry.get("fieldsV1") or {})
    return set()


def record(obj: Obj, manager: str, applied: Obj) -> Obj:
    """``obj`` with ``manager``'s Apply entry set to the fields of ``applied``."""
    fields = to_fields_v1(field_paths(applied))
    out = copy.deepcopy(obj)
    meta = out.setdefault("metadata", {})
    if any(e.get("manager") == manager and e.get("operation") == "Apply" and e.get("fieldsV1") == fields
           for e in meta.get("managedFields") or []):
        return out  # same fields: a no-op apply must not rewrite the entry (its time would bump the object)
    entries = [e for e in meta.get("managedFields") or []
               if not (e.get("manager") == manager and e.get("operation") == "Apply")]
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    entries.append({"manager": manager, "operation": "Apply", "apiVersion": applied.get("apiVersion", ""),
                    "time": stamp, "fieldsType": "FieldsV1",
                    "fieldsV1": fields})
    meta["managedFields"] = entries
    return out
