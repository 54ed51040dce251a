"""Crash consistency of the disk store: a writer process is SIGKILLed at random moments, then a fresh
store rebuilds from what it left and must serve only records exactly as they were written.

The trials share one directory, so later writers also start from (and may be killed inside) the
rebuild of earlier wreckage. Seeded: the kill moments are the same on every run, what the writer has
done by then depends on the machine.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import confkv_engine
from confkv_engine.cache.disk.store import DiskStore
from tests.engine.disk_crash_writer import CAPACITY, block_key, block_parent, block_payload, block_tokens

ROOT = Path(__file__).resolve().parents[2]
TRIALS = 24
SEED = 20261201
MAX_KILL_DELAY_S = 0.25


def start_writer(directory: Path, seed: int) -> subprocess.Popen[str]:
    engine_dir = Path(confkv_engine.__file__).resolve().parents[1]
    paths = [str(engine_dir), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    cmd = [sys.executable, "-m", "tests.engine.disk_crash_writer", str(directory), str(seed)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != "ready":
        proc.kill()
        raise AssertionError(f"writer did not start: {line!r} {proc.communicate()[1]}")
    return proc


def check_served(store: DiskStore, totals: Counter[str]) -> None:
    """Read back every record; each one served must be exactly what was written for its key."""
    for key in store.keys():
        rec = store.get(key)
        if rec is None:
            totals["dropped on read"] += 1
            continue
        seed, i = rec.meta["seed"], rec.meta["i"]
        assert key == block_key(seed, i)
        assert rec.payload == block_payload(seed, i), f"corrupt payload served for {seed}/{i}"
        assert (rec.parent, list(rec.token_ids)) == (block_parent(seed, i), block_tokens(seed, i))
        totals["served"] += 1
        totals[f"seed {seed}"] = 1


def test_sigkill_at_random_moments_never_serves_a_corrupt_block(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    totals: Counter[str] = Counter()
    for trial in range(TRIALS):
        proc = start_writer(tmp_path, SEED + trial)
        # A quarter of the kills land right after start-up (inside the first puts), the rest later.
        delay = 0.0 if rng.random() < 0.25 else rng.uniform(0.0, MAX_KILL_DELAY_S)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, f"writer died by itself: {err}"
        with DiskStore(tmp_path, CAPACITY, admit=lambda uses: True) as store:
            report = store.last_rebuild
            totals["skipped"] += report.skipped
            totals["orphans"] += report.orphans
            totals["records after rebuild"] += report.records
            check_served(store, totals)
            assert store.stats().bytes_used <= CAPACITY
    seeds = sum(1 for k in totals if k.startswith("seed "))
    print(f"\n{TRIALS} SIGKILL trials: {totals['records after rebuild']} records after rebuilds, "
          f"{totals['served']} served and verified, {totals['dropped on read']} dropped on read, "
          f"{totals['skipped']} skipped by rebuilds, {totals['orphans']} orphaned temp files removed, "
          f"records from {seeds} writers")
    assert totals["served"] > 0 and seeds > 1
    # A kill cannot tear a renamed record file, so nothing may fail verification either.
    assert totals["skipped"] == 0 and totals["dropped on read"] == 0
