"""The engine's live policy: one versioned owner of the ``confkv`` section and ``engine.maxBatchSize``.

Every change goes through ``PolicyStore.update``: the patch is merged into the current document,
validated with the shared pydantic models (``confkv_api.config``), diffed field by field, handed to
the engine's ``apply`` callback, and only then committed with version + 1. Any failure (invalid
document, version conflict, a field that cannot take effect live while ``require_live`` is set, an
``apply`` that raises) leaves the policy exactly as it was.

Patches are validated strictly (pydantic strict mode): ``"k": true`` or ``"high": "0.95"`` is a
refused update, never a silent coercion, since a remote caller's patch is not a hand-written file
(the config-file loader stays lenient). A patch is parsed by ``parse_patch``: invalid JSON, NaN or
Infinity literals, integers too long to convert, and nesting deeper than any policy document are
all ``PolicyInvalid`` (gRPC INVALID_ARGUMENT), never an internal error.

Which fields take effect live is the engine's to say (``live_fields``: dotted camelCase paths or
prefixes). The others are still stored in the policy document (the file is the source of truth and
a restarted engine reads it), and reported as deferred so nobody mistakes them for applied.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from confkv_api.config import ConfKVSection, EngineSection
from confkv_api.merge import merge_patch

log = logging.getLogger("confkv.policy")

# The confkv section is three objects deep (confkv.compression.bits); a few levels of slack for a
# mistaken but honest patch, and a clear refusal long before recursion could become the problem.
MAX_PATCH_DEPTH = 8
# No policy field needs more digits than this; longer integer literals are refused before Python
# converts them (its own limit would answer with advice about sys.set_int_max_str_digits).
MAX_INT_DIGITS = 40


class PolicyError(Exception):
    """A refused change; nothing was modified."""


class PolicyInvalid(PolicyError):
    """The merged document does not validate."""


class PolicyConflict(PolicyError):
    """``expected_version`` is not the current version."""


class PolicyNotLive(PolicyError):
    """``require_live`` was set and a changed field cannot take effect without a restart."""


@dataclass(frozen=True)
class PolicySnapshot:
    version: int
    confkv: ConfKVSection
    max_batch_size: int

    def document(self) -> dict[str, Any]:
        return {"confkv": self.confkv.model_dump(mode="json", by_alias=True),
                "engine": {"maxBatchSize": self.max_batch_size}}

    def to_json(self) -> str:
        return json.dumps(self.document(), sort_keys=True)


@dataclass(frozen=True)
class PolicyChange:
    snapshot: PolicySnapshot
    changed: list[str] = field(default_factory=list)
    live: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits is out of range")
    return int(text)


def _depth(doc: Any) -> int:
    """Nesting depth of a parsed JSON document (iterative: any depth is measured safely)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_patch(text: str) -> dict[str, Any] | None:
    """The ``confkv_json`` of an UpdatePolicy request: None when blank, else a JSON object no deeper
    than ``MAX_PATCH_DEPTH``; anything else is ``PolicyInvalid`` naming the problem."""
    if not text.strip():
        return None
    try:
        patch = json.loads(text, parse_constant=_refuse_constant, parse_int=_parse_int)
    except RecursionError:
        raise PolicyInvalid(f"confkv_json is nested deeper than {MAX_PATCH_DEPTH} levels") from None
    except ValueError as err:  # JSONDecodeError, NaN/Infinity, overlong integers
        raise PolicyInvalid(f"confkv_json is not valid JSON: {err}") from None
    if not isinstance(patch, dict):
        raise PolicyInvalid("the confkv patch must be a JSON object")
    if _depth(patch) > MAX_PATCH_DEPTH:
        raise PolicyInvalid(f"confkv_json is nested deeper than {MAX_PATCH_DEPTH} levels")
    return patch


def flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and scalars are leaves."""
    if not isinstance(doc, dict):
        return {prefix: doc}
    out: dict[str, Any] = {}
    for key, value in doc.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def _is_live(path: str, live: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in live)


def _validation_message(err: ValidationError, section: str) -> str:
    parts = []
    for item in err.errors():
        where = ".".join([section, *map(str, item["loc"])])
        unknown = item["type"] == "extra_forbidden"
        parts.append(f"unknown key '{where}'" if unknown else f"{where}: {item['msg']}")
    return "; ".join(parts)


class PolicyStore:
    """Thread-safe, versioned policy. ``apply(snapshot, changed)`` pushes a validated policy into the
    running engine (it must be all-or-nothing; raising aborts the update)."""

    def __init__(self, confkv: ConfKVSection, max_batch_size: int, live_fields: Iterable[str],
                 apply: Callable[[PolicySnapshot, list[str]], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._current = self._startup = PolicySnapshot(1, confkv, max_batch_size)
        self.live_fields = frozenset(live_fields)
        self._apply = apply

    @property
    def current(self) -> PolicySnapshot:
        with self._lock:
            return self._current

    @property
    def startup(self) -> PolicySnapshot:
        return self._startup

    def update(self, confkv_patch: dict[str, Any] | None = None, *, replace: bool = False,
               max_batch_size: int | None = None, expected_version: int = 0, require_live: bool = False,
               reason: str = "") -> PolicyChange:
        with self._lock:
            cur = self._current
            if expected_version and expected_version != cur.version:
                raise PolicyConflict(f"expected policy version {expected_version}, current is {cur.version}")
            candidate = self._validate(cur, confkv_patch, replace, max_batch_size)
            changed = sorted(k for k, v in flatten(candidate.document()).items()
                             if flatten(cur.document()).get(k) != v)
            live = [p for p in changed if _is_live(p, self.live_fields)]
            deferred = [p for p in changed if p not in live]
            if require_live and deferred:
                raise PolicyNotLive(f"this engine cannot apply these fields live: {', '.join(deferred)}; "
                                    f"nothing was changed")
            if not changed:
                return PolicyChange(cur)
            new = PolicySnapshot(cur.version + 1, candidate.confkv, candidate.max_batch_size)
            if self._apply is not None and live:
                self._apply(new, live)
            self._current = new
        log.info("policy version %d (%s): changed %s; live %s; deferred %s", new.version,
                 reason or "no reason", changed, live, deferred)
        return PolicyChange(new, changed, live, deferred)

    @staticmethod
    def _validate(cur: PolicySnapshot, patch: dict[str, Any] | None, replace: bool,
                  max_batch_size: int | None) -> PolicySnapshot:
        confkv = cur.confkv
        if patch is not None:
            if not isinstance(patch, dict):
                raise PolicyInvalid("the confkv patch must be a JSON object")
            base = {} if replace else cur.confkv.model_dump(mode="json", by_alias=True)
            try:
                confkv = ConfKVSection.model_validate(merge_patch(base, patch), strict=True)
            except ValidationError as err:
                raise PolicyInvalid(f"invalid policy: {_validation_message(err, 'confkv')}") from None
        batch = cur.max_batch_size
        if max_batch_size is not None:
            try:
                batch = EngineSection.model_validate({"maxBatchSize": max_batch_size},
                                                     strict=True).max_batch_size
            except ValidationError as err:
                raise PolicyInvalid(f"invalid policy: {_validation_message(err, 'engine')}") from None
        return PolicySnapshot(cur.version, confkv, batch)
