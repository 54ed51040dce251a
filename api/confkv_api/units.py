"""Units of ``confkv.json`` values: byte sizes (``"512Mi"``, ``"2G"``, ``"80%"``) and Prometheus-style
durations (``"5m"``). Pure parsing, no pydantic: the config models validate with these."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)
_DURATION_RE = re.compile(r"^(\d+)(ms|s|m|h)$")
_DURATION_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
# Largest byte size a config may name (1024Ti): far above any device, far below a float's overflow,
# so "1" followed by 400 zeros is refused here instead of overflowing when the pool is sized.
MAX_SIZE_BYTES = 2**50


def parse_size(value: str | int | float) -> tuple[str, float]:
    """Parse a cache size: ``"80%"`` -> ("fraction", 0.8); ``"512Mi"``/``1024`` -> ("bytes", n)."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}")
    if isinstance(value, (int, float)):
        if not 0 < value <= MAX_SIZE_BYTES:  # also refuses NaN and infinities
            raise ValueError(f"size must be in (0, {MAX_SIZE_BYTES}] bytes (1024Ti), got {value}")
        if isinstance(value, float) and value <= 1.0:
            return "fraction", value
        return "bytes", float(value)
    text = value.strip()
    if text.endswith("%"):
        pct = float(text[:-1])
        if not 0 < pct <= 100:  # also refuses NaN
            raise ValueError(f"percentage must be in (0, 100], got {text!r}")
        return "fraction", pct / 100.0
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"invalid size {value!r}: use bytes (e.g. 536870912, '512Mi', '2G') or '80%'")
    number = float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()]
    if number <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    if number > MAX_SIZE_BYTES:  # also refuses a digit string that overflowed to infinity
        raise ValueError(f"size {value[:40]!r} is larger than 1024Ti ({MAX_SIZE_BYTES} bytes)")
    return "bytes", number


def parse_duration(value: str) -> float:
    """Parse a Prometheus-style duration (``5m``, ``30s``, ``1h``, ``500ms``) into seconds."""
    match = _DURATION_RE.match(value.strip())
    if not match:
        raise ValueError(f"invalid duration {value!r}: use e.g. '30s', '5m', '1h'")
    return int(match.group(1)) * _DURATION_SECONDS[match.group(2)]
