"""The budget schedule on the real paged cache: it acts, holds the fixed budget's average over the
decisions within its slack and stays inside the reservation admission makes for it."""

from __future__ import annotations

import torch

from confkv_engine.cache.kv_cache import CacheSpec, KVCache
from confkv_engine.retention.budget import BudgetSchedule
from confkv_engine.retention.manager import RetentionManager
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.tiers import TierConfig
from testkit.drivers.offline import run_sequence
from testkit.drivers.tiny_model import tiny_model


def test_schedule_on_the_paged_cache_holds_the_average_and_the_reservation() -> None:
    model = tiny_model()
    toks = torch.randint(0, 300, (640,), generator=torch.Generator().manual_seed(3)).tolist()
    runs = {}
    for name, sched in (("fixed", None), ("entropy", BudgetSchedule(strength=0.6, slack=2.0))):
        cache = KVCache(CacheSpec(2, 2, 16, 16, torch.float32, torch.device("cpu")), 200)
        cfg = RetentionConfig(policy="conf-kv", tiers=TierConfig(window=32), budget=0.25, schedule=sched)
        manager = RetentionManager(cache, 4, cfg, 32)
        runs[name] = (run_sequence(model, cache, manager, cfg, toks, 32), manager, cfg)
    fixed_run, manager, cfg = runs["fixed"]
    sched_run, _, sched_cfg = runs["entropy"]
    assert sched_run.held_bytes != fixed_run.held_bytes  # the schedule acted
    # Summed over its decisions the scheduled run holds the fixed budget's targets within the slack.
    state = manager.new_state(cfg)
    targets = [state.decision_target(n, False) for n in sched_run.lengths]
    slack, pair = sched_cfg.schedule.slack, 2 * manager.cache.spec.block_bytes
    assert abs(sum(sched_run.held_bytes) - sum(targets)) <= slack * targets[-1] + pair
    # The peak stays inside what admission reserves for the scheduled config.
    reserved = manager.reserve_blocks(sched_cfg, len(toks)) * manager.cache.spec.block_bytes
    assert sched_run.peak_bytes <= reserved
