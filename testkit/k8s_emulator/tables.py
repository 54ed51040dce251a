"""Server-side printing: `meta.k8s.io/v1 Table` answers for `kubectl get`.

Columns are Name, a CRD's additionalPrinterColumns (simple JSONPath: `.a.b`, `[N]`, and
`[?(@.key=="value")]` filters) and Age. Built-in types get Name and Age only.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

from .registry import ResourceType

_STEP = re.compile(r'\.([\w-]+)|\[(\d+)\]|\[\?\(@\.([\w-]+)\s*==\s*["\']([^"\']*)["\']\)\]')


def wants_table(accept: str) -> bool:
    return "as=Table" in accept


def json_path(obj: Any, path: str) -> Any:
    """Evaluate the JSONPath subset printer columns use; None when any step is missing."""
    value = obj
    position = 0
    path = path.strip()
    while position < len(path):
        match = _STEP.match(path, position)
        if match is None:
            return None
        field, index, filter_key, filter_value = match.groups()
        if field is not None:
            value = value.get(field) if isinstance(value, dict) else None
        elif index is not None:
            value = value[int(index)] if isinstance(value, list) and int(index) < len(value) else None
        else:
            value = (
                next(
                    (
                        item
                        for item in value or []
                        if isinstance(item, dict) and str(item.get(filter_key)) == filter_value
                    ),
                    None,
                )
                if isinstance(value, list)
                else None
            )
        if value is None:
            return None
        position = match.end()
    return value


def _age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    created = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = max(int((datetime.datetime.now(datetime.UTC) - created).total_seconds()), 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _cell(value: Any, column_type: str) -> Any:
    if value is None:
        return None
    if column_type == "date":
        return _age(str(value))
    if isinstance(value, dict | list):
        return str(value)
    return value


def table(rtype: ResourceType, items: list[dict[str, Any]], resource_version: int | None) -> dict[str, Any]:
    columns = [
        {
            "name": "Name",
            "type": "string",
            "format": "name",
            "priority": 0,
            "description": "Name must be unique within a namespace.",
        }
    ]
    for column in rtype.printer_columns:
        columns.append(
            {
                "name": column["name"],
                "type": column.get("type", "string"),
                "format": column.get("format", ""),
                "priority": column.get("priority", 0),
                "description": column.get("description", ""),
            }
        )
    columns.append(
        {"name": "Age", "type": "string", "format": "", "priority": 0, "description": "Time since creation."}
    )
    rows = []
    for obj in items:
        meta = obj.get("metadata") or {}
        cells = [meta.get("name")]
        cells += [
            _cell(json_path(obj, c.get("jsonPath", "")), c.get("type", "string"))
            for c in rtype.printer_columns
        ]
        cells.append(_age(meta.get("creationTimestamp")))
        rows.append({"cells": cells, "object": obj})
    metadata = {} if resource_version is None else {"resourceVersion": str(resource_version)}
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": metadata,
        "columnDefinitions": columns,
        "rows": rows,
    }
