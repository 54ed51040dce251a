"""JSON merge patch (RFC 7396), the one implementation the engine's policy store and the agent use.

Objects merge key by key, ``null`` removes a key (for a pydantic-validated section: its default
applies again), anything else (scalars, lists) replaces. Neither input is modified.
"""

from __future__ import annotations

from typing import Any


def merge_patch(target: Any, patch: Any) -> Any:
    """``target`` with ``patch`` applied; a non-object patch replaces the target as a whole."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out
