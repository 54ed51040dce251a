"""Per-rank KV usage on /metrics: each rank's pool, as the ranks last exchanged it (every step)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from confkv_engine.parallel.engine import LeaderEngine

RANK_KV_USED = "confkv_tp_rank_kv_used_bytes"
RANK_KV_TOTAL = "confkv_tp_rank_kv_capacity_bytes"
RANK_FREE_BLOCKS = "confkv_tp_rank_kv_free_blocks"


class RankKVCollector(Collector):
    def __init__(self, engine: LeaderEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rank = ["rank"]
        used = GaugeMetricFamily(RANK_KV_USED, "KV pool bytes used on each tensor-parallel rank", labels=rank)
        total = GaugeMetricFamily(RANK_KV_TOTAL, "KV pool size of each tensor-parallel rank", labels=rank)
        free = GaugeMetricFamily(RANK_FREE_BLOCKS, "free KV blocks of each tensor-parallel rank", labels=rank)
        for u in self.engine.usage_by_rank():
            used.add_metric([str(u.rank)], u.kv_bytes_used)
            total.add_metric([str(u.rank)], u.kv_bytes_total)
            free.add_metric([str(u.rank)], u.free_blocks)
        yield from (used, total, free)
