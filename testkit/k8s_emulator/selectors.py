"""Label and field selectors (the query-string forms of `labelSelector` and `fieldSelector`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .errors import bad_request

Matcher = Callable[[dict[str, Any]], bool]

_SET_TERM = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQ_TERM = re.compile(r"^\s*([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)\s*$")
_EXISTS_TERM = re.compile(r"^\s*(!?)\s*([\w./-]+)\s*$")


def _split_terms(selector: str) -> list[str]:
    """Split on commas that are not inside `in (...)` value lists."""
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [t for t in terms if t.strip()]


def _label_term(term: str) -> Callable[[dict[str, str]], bool]:
    if match := _SET_TERM.match(term):
        key, op, raw = match.groups()
        values = {v.strip() for v in raw.split(",") if v.strip()}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if match := _EQ_TERM.match(term):
        key, op, value = match.groups()
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if match := _EXISTS_TERM.match(term):
        negate, key = match.groups()
        return (lambda labels: key not in labels) if negate else (lambda labels: key in labels)
    raise bad_request(f"unable to parse requirement: {term!r}")


def label_matcher(selector: str | None) -> Matcher:
    terms = [_label_term(t) for t in _split_terms(selector or "")]

    def matches(obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(term(labels) for term in terms)

    return matches


def _field_value(obj: dict[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def field_matcher(selector: str | None) -> Matcher:
    """Equality field selectors on any dotted path (the real server allows only a few per type)."""
    checks: list[tuple[str, bool, str]] = []
    for term in _split_terms(selector or ""):
        match = _EQ_TERM.match(term)
        if not match:
            raise bad_request(f"invalid field selector: {term!r}")
        path, op, value = match.groups()
        checks.append((path, op != "!=", value))

    def matches(obj: dict[str, Any]) -> bool:
        return all((_field_value(obj, path) == value) == equal for path, equal, value in checks)

    return matches


def selector_string(match_labels: dict[str, str]) -> str:
    """The string form of a `matchLabels` selector, as scale subresources report it."""
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
