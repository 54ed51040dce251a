"""What the API server does with a CR before storing it, reproduced from the CRD's openAPIV3Schema:

1. structural validation (types, enums, ranges, patterns) with ``jsonschema``. The CRD schema is
   OpenAPI 3.0, which JSON Schema draft 4 matches (boolean ``exclusiveMinimum``) except for
   ``nullable`` and the ``x-kubernetes-*`` extensions, which ``to_json_schema`` translates;
   unknown fields are errors, as with ``kubectl apply --validate=strict``;
2. defaulting (``default`` at every level, recursing into defaulted objects);
3. the CEL rules (``x-kubernetes-validations``) with ``cel-python``, each with ``self`` bound to the
   defaulted value at the rule's node; absent optional nodes are skipped, as the API server does.
   Null values are dropped first, so ``has(self.x)`` is false for ``x: null`` (pydantic's reading of
   None as unset); the examples and the rule table below set no nulls.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema

Schema = dict[str, Any]


@dataclass(frozen=True)
class CelFailure:
    path: str
    rule: str
    message: str


def version_schema(crd: dict[str, Any], version: str = "v1alpha1") -> Schema:
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return ver["schema"]["openAPIV3Schema"]


def to_json_schema(node: Schema) -> Schema:
    """Translate an OpenAPI v3 (Kubernetes structural) schema into JSON Schema draft 4."""
    out: Schema = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = to_json_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [to_json_schema(sub) for sub in value]
        elif key == "not":
            out[key] = to_json_schema(value)
        elif key.startswith("x-kubernetes-") or key in ("nullable", "default", "description", "example"):
            continue
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    preserve = node.get("x-kubernetes-preserve-unknown-fields", False)
    closed = "properties" in out and "additionalProperties" not in out and not preserve
    if out.get("type") == "object" and closed:
        # Strict field validation: a typo'd field is an error (the server would otherwise prune it silently).
        # metadata is the exception: its schema here is just {type: object}.
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def structural_errors(schema: Schema, obj: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(to_json_schema(schema))
    return sorted(
        f"{'.'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
        for err in validator.iter_errors(obj)
    )


def apply_defaults(schema: Schema, value: Any) -> Any:
    """A copy of ``value`` with the schema's defaults filled in (absent fields only, like the API server)."""
    value = copy.deepcopy(value)
    return _default(schema, value)


def _default(schema: Schema, value: Any) -> Any:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = _default(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in value:
                if name not in schema.get("properties", {}):
                    value[name] = _default(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_default(schema["items"], item) for item in value]
    return value


def cel_rules(schema: Schema, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, rule) for every x-kubernetes-validations entry, paths like ``.spec.confkv``."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path or ".", rule
    for name, sub in schema.get("properties", {}).items():
        yield from cel_rules(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from cel_rules(schema["items"], f"{path}[*]")


def _values_at(obj: Any, path: str) -> Iterator[Any]:
    parts = [p for p in path.replace("[*]", ".[*]").split(".") if p]
    current = [obj]
    for part in parts:
        nxt = []
        for item in current:
            if part == "[*]" and isinstance(item, list):
                nxt.extend(item)
            elif isinstance(item, dict) and item.get(part) is not None:
                nxt.append(item[part])
        current = nxt
    yield from current


@functools.cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def cel_failures(schema: Schema, obj: dict[str, Any]) -> list[CelFailure]:
    """Evaluate every CEL rule on the defaulted object; a rule that errors fails (as on the server)."""
    defaulted = _drop_nulls(apply_defaults(schema, obj))
    failures = []
    for path, rule in cel_rules(schema):
        if "oldSelf" in rule["rule"]:
            continue  # transition rules need an update; none of the table's cases is one
        for value in _values_at(defaulted, path):
            try:
                ok = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
            except celpy.CELEvalError as err:
                ok = err
            if ok is not True and not (isinstance(ok, celpy.celtypes.BoolType) and bool(ok)):
                message = rule.get("message", rule["rule"])
                if not isinstance(ok, celpy.celtypes.BoolType):
                    message += f" (evaluation error: {ok})"
                failures.append(CelFailure(path, rule["rule"], message))
    return failures
