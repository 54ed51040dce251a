"""Latency histograms across the control plane: the engine copies a Prometheus histogram into the
``Histogram`` message of its status (``histogram_message``), the agent takes a quantile of the
increase between two statuses (``quantile``), the way PromQL's ``histogram_quantile`` reads
``rate(..._bucket[window])``, so the agent and a PrometheusRule compute the same p95.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from confkv_api.v1 import control_pb2 as pb


def histogram_message(registry: Any, name: str) -> pb.Histogram | None:
    """The cumulative buckets and sum of histogram ``name`` in a ``prometheus_client`` registry; None
    when the registry has no such histogram (or is not a registry)."""
    restricted = getattr(registry, "restricted_registry", None)
    if restricted is None:
        return None
    buckets: list[tuple[float, int]] = []
    total = 0.0
    for family in restricted([f"{name}_bucket", f"{name}_sum"]).collect():
        for sample in family.samples:
            if sample.name == f"{name}_bucket" and "le" in sample.labels:
                buckets.append((float(sample.labels["le"]), int(sample.value)))
            elif sample.name == f"{name}_sum":
                total = float(sample.value)
    if not buckets:
        return None
    buckets.sort()
    return pb.Histogram(upper_bounds=[b for b, _ in buckets], cumulative_counts=[c for _, c in buckets],
                        sum=total)


def quantile(q: float, upper_bounds: Sequence[float], cumulative: Sequence[float]) -> float | None:
    """``histogram_quantile`` of Prometheus: linear interpolation inside the bucket that holds rank
    ``q * total`` (the first bucket starts at 0); a rank in the +Inf bucket gives the largest finite
    bound. None when the histogram is empty (PromQL's NaN: no data)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    if len(upper_bounds) != len(cumulative) or not upper_bounds or not math.isinf(upper_bounds[-1]):
        raise ValueError("a histogram needs ascending upper bounds ending in +Inf, one count each")
    total = cumulative[-1]
    if total <= 0:
        return None
    if len(upper_bounds) == 1:
        return None  # only +Inf: nothing to interpolate (PromQL answers NaN as well)
    rank = q * total
    index = next(i for i, count in enumerate(cumulative) if count >= rank)
    if index == len(upper_bounds) - 1:
        return upper_bounds[-2]
    start = 0.0 if index == 0 else upper_bounds[index - 1]
    end = upper_bounds[index]
    if index == 0 and end <= 0:
        return end
    below = 0.0 if index == 0 else cumulative[index - 1]
    in_bucket = cumulative[index] - below
    return start + (end - start) * ((rank - below) / in_bucket if in_bucket > 0 else 1.0)
