"""Manifest builders for tests: a minimal CustomResourceDefinition of any shape."""

from __future__ import annotations

from typing import Any


def crd_manifest(
    group: str,
    version: str,
    kind: str,
    *,
    plural: str | None = None,
    short_names: tuple[str, ...] = (),
    scope: str = "Namespaced",
    status: bool = True,
    scale: bool = False,
    printer_columns: tuple[dict[str, Any], ...] = (),
) -> dict[str, Any]:
    """A CRD with a schema that accepts anything (the emulator does not validate schemas anyway)."""
    plural = plural or kind.lower() + "s"
    subresources: dict[str, Any] = {}
    if status:
        subresources["status"] = {}
    if scale:
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
        }
    names: dict[str, Any] = {"plural": plural, "singular": kind.lower(), "kind": kind}
    if short_names:
        names["shortNames"] = list(short_names)
    version_entry: dict[str, Any] = {
        "name": version,
        "served": True,
        "storage": True,
        "subresources": subresources,
        "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    }
    if printer_columns:
        version_entry["additionalPrinterColumns"] = list(printer_columns)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {"group": group, "scope": scope, "names": names, "versions": [version_entry]},
    }
