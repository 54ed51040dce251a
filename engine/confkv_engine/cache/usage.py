"""The per-request KV record reported in a response's ``usage`` (filled by retention, read by HTTP)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVUsage:
    """Peak pool bytes a request held and its tokens per tier (per (layer, KV head) unit).

    ``effective_kv_budget``: the bytes the request's budget allowed at its final length, as a fraction
    of the full cache's; above the requested budget when the floor (sinks + the minimal recent window)
    binds. None without a budget."""

    peak_kv_bytes: int = 0
    tokens_full: int = 0
    tokens_key_only: int = 0
    tokens_discarded: int = 0
    effective_kv_budget: float | None = None
    # Precision tiers (frozen or staged; not counted in tokens_full)
    tokens_int8: int = 0
    tokens_int4: int = 0
    tokens_k4v2: int = 0
    tokens_int2: int = 0
