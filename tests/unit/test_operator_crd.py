"""The CRD schema (crds/) and the pydantic DeploymentSpec must describe the same fields, both ways:
names, types, enums, ranges, patterns, nullability and defaults; and the API server's structural
defaulting of an empty spec must equal the model's defaults."""

from __future__ import annotations

import copy
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from annotated_types import Ge, Gt, Le
from pydantic import BaseModel

from confkv_api.config import ConfKVConfig
from confkv_api.deployment import (
    ENGINE_DEPLOYMENT_FIELDS,
    OPERATOR_OWNED_FIELDS,
    DeploymentSpec,
    load_deployment_spec,
)

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "confkvdeployments.confkv.io.yaml"


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="module")
def version(crd: dict[str, Any]) -> dict[str, Any]:
    (only,) = crd["spec"]["versions"]
    return only


@pytest.fixture(scope="module")
def spec_schema(version: dict[str, Any]) -> dict[str, Any]:
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return annotation, False


_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _check_type(annotation: Any, schema: dict[str, Any], where: str, problems: list[str]) -> None:
    origin = typing.get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        _compare(annotation, schema, where, problems)
    elif origin is typing.Literal:
        values = list(typing.get_args(annotation))
        if schema.get("enum") != values:
            problems.append(f"{where}: enum {schema.get('enum')} != model {values}")
        expected = "integer" if isinstance(values[0], int) else "string"
        if schema.get("type") != expected:
            problems.append(f"{where}: type {schema.get('type')} != {expected}")
    elif origin is list:
        if schema.get("type") != "array":
            problems.append(f"{where}: CRD type {schema.get('type')} is not array")
        else:
            _check_type(typing.get_args(annotation)[0], schema["items"], f"{where}[]", problems)
    elif origin is dict and typing.get_args(annotation)[1] is Any:
        # core/v1 objects passed through (affinity, volumes, a partial pod template): the operator's
        # model checks them; the CRD keeps them as they are
        if schema.get("type") != "object" or schema.get("x-kubernetes-preserve-unknown-fields") is not True:
            problems.append(f"{where}: expected an object that preserves unknown fields")
    elif origin is dict:
        if schema.get("type") != "object" or schema.get("additionalProperties") != {"type": "string"}:
            problems.append(f"{where}: expected a string map")
    elif schema.get("type") != _SCALARS.get(annotation):
        problems.append(f"{where}: CRD type {schema.get('type')} != model {annotation}")


def _check_constraints(info: Any, schema: dict[str, Any], where: str, problems: list[str]) -> None:
    wanted: dict[str, Any] = {}
    for meta in info.metadata:
        if isinstance(meta, Ge):
            wanted["minimum"] = meta.ge
        elif isinstance(meta, Le):
            wanted["maximum"] = meta.le
        elif isinstance(meta, Gt):
            wanted["minimum"], wanted["exclusiveMinimum"] = meta.gt, True
        elif getattr(meta, "pattern", None):
            wanted["pattern"] = meta.pattern
    for key in ("minimum", "maximum", "exclusiveMinimum"):
        if schema.get(key) != wanted.get(key):
            problems.append(f"{where}: {key} {schema.get(key)} != model {wanted.get(key)}")
    if "pattern" in wanted and schema.get("pattern") != wanted["pattern"]:
        problems.append(f"{where}: pattern {schema.get('pattern')} != model {wanted['pattern']}")


def _check_default(info: Any, nullable: bool, schema: dict[str, Any], where: str,
                   problems: list[str]) -> None:
    if info.is_required():
        return
    default = info.get_default(call_default_factory=True)
    if isinstance(default, BaseModel):
        return  # object defaults are checked by the whole-spec defaulting test
    if default is None:
        if "default" in schema or not nullable:
            problems.append(f"{where}: optional field must be nullable without a CRD default")
    elif schema.get("default") != default:
        problems.append(f"{where}: CRD default {schema.get('default')!r} != model {default!r}")


def _compare(model: type[BaseModel], schema: dict[str, Any], where: str, problems: list[str]) -> None:
    props = schema.get("properties", {})
    section = where.split(".")[-1] if where else ""
    fields = {(info.alias or name): info for name, info in model.model_fields.items()
              if (section, info.alias or name) not in OPERATOR_OWNED_FIELDS}
    for key in sorted(set(props) - set(fields)):
        problems.append(f"{where}.{key}: in the CRD, not in {model.__name__}")
    for key in sorted(set(fields) - set(props)):
        problems.append(f"{where}.{key}: in {model.__name__}, not in the CRD")
    required = sorted(k for k, info in fields.items() if info.is_required())
    if sorted(schema.get("required", [])) != required:
        problems.append(f"{where}: required {schema.get('required')} != model {required}")
    for key in sorted(set(fields) & set(props)):
        info, sub, path = fields[key], props[key], f"{where}.{key}" if where else key
        annotation, nullable = _unwrap(info.annotation)
        if bool(sub.get("nullable")) != nullable:
            problems.append(f"{path}: nullable {sub.get('nullable')} != model {nullable}")
        _check_type(annotation, sub, path, problems)
        _check_constraints(info, sub, path, problems)
        _check_default(info, nullable, sub, path, problems)


def apply_structural_defaults(schema: dict[str, Any], value: Any) -> Any:
    """The API server's defaulting: missing properties with a default get it, recursively."""
    if schema.get("type") == "object" and isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_structural_defaults(sub, value[key])
    elif schema.get("type") == "array" and isinstance(value, list):
        return [apply_structural_defaults(schema["items"], item) for item in value]
    return value


def _model_dump(spec: DeploymentSpec) -> dict[str, Any]:
    doc = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    for section, key in OPERATOR_OWNED_FIELDS:
        doc.get(section, {}).pop(key, None)
    return doc


def test_crd_identity(crd: dict[str, Any], version: dict[str, Any]) -> None:
    assert crd["metadata"]["name"] == "confkvdeployments.confkv.io"
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("ConfKVDeployment", "confkvdeployments",
                                                                     ["ckv"])
    assert crd["spec"]["scope"] == "Namespaced" and version["name"] == "v1alpha1"
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Model", "Replicas", "Ready", "Phase", "Age"]


def test_every_field_matches_the_model_both_ways(spec_schema: dict[str, Any]) -> None:
    problems: list[str] = []
    _compare(DeploymentSpec, spec_schema, "", problems)
    assert problems == []


def test_confkv_json_sections_are_in_the_spec() -> None:
    """Each confkv.json section is in the spec as is; only the engine adds deployment-only fields."""
    for name in ConfKVConfig.model_fields:
        in_spec = DeploymentSpec.model_fields[name].annotation
        in_file = ConfKVConfig.model_fields[name].annotation
        assert isinstance(in_spec, type) and issubclass(in_spec, in_file)
        added = set(in_spec.model_fields) - set(in_file.model_fields)
        assert added == (set(ENGINE_DEPLOYMENT_FIELDS) if name == "engine" else set()), name


def test_structural_defaults_equal_model_defaults(spec_schema: dict[str, Any]) -> None:
    defaulted = apply_structural_defaults(spec_schema, {})
    assert defaulted == _model_dump(DeploymentSpec())
    assert _model_dump(load_deployment_spec(defaulted)) == defaulted


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_default_like_the_model(spec_schema: dict[str, Any], example: Path) -> None:
    spec = yaml.safe_load(example.read_text())["spec"]
    defaulted = apply_structural_defaults(spec_schema, copy.deepcopy(spec))
    assert _model_dump(load_deployment_spec(spec)) == defaulted


def test_cel_rules_cover_the_model_validators(spec_schema: dict[str, Any]) -> None:
    rules = yaml.safe_dump(spec_schema)
    for fragment in ("self.high > self.medium", "self.tiers.all", "self.k >= 1", "has(self.budgetTokens)",
                     "self.prefillChunk <= self.maxNumBatchedTokens", "has(self.claimName)",
                     "has(self.hostPath)", "!has(self.hostPath)", "self.model.source.startsWith",
                     "!has(self.createClaim)", "self.maxReplicas >= self.minReplicas"):
        assert fragment in rules
