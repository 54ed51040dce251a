"""The eviction simulator's table: token hit rate of LRU, the paper's LRU-2, LRU-2 and LRU-3 (chain
history) on the seeded traces of ``testkit.traces`` at three cache sizes, and an unbounded cache
(the trace's ceiling). Writes ``bench/results/cache/prefix_cache_sim.json``.

    python -m bench.cache.prefix_sim
"""

from __future__ import annotations

import json
from dataclasses import asdict

from bench.common import results_dir
from testkit.traces import CACHE_BLOCKS, POLICIES, TRACES, block_keys, make_trace, simulate

RESULTS = results_dir("cache") / "prefix_cache_sim.json"


def run_table(seed: int = 0) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for name, cfg in TRACES.items():
        trace = make_trace(cfg, seed)
        unbounded = sum(len(block_keys(tokens, 16)) for tokens in trace)  # never evicts
        ceiling = round(simulate(trace, unbounded, POLICIES["LRU"]).hit_rate, 4)
        for capacity in CACHE_BLOCKS:
            row: dict[str, object] = {"trace": name, "cache_blocks": capacity, "unbounded": ceiling}
            for policy_name, factory in POLICIES.items():
                row[policy_name] = round(simulate(trace, capacity, factory).hit_rate, 4)
            rows.append(row)
    return rows


def main() -> None:
    rows = run_table()
    names = [*POLICIES, "unbounded"]
    print(f"{'trace':<15} {'blocks':>6} " + " ".join(f"{n:>11}" for n in names) + "   LRU-2 - LRU")
    for row in rows:
        rates = " ".join(f"{100 * float(row[n]):10.1f}%" for n in names)  # type: ignore[arg-type]
        gain = 100 * (float(row["LRU-2"]) - float(row["LRU"]))  # type: ignore[arg-type]
        print(f"{row['trace']:<15} {row['cache_blocks']:>6} {rates}   {gain:+5.1f} points")
    configs = {name: asdict(cfg) for name, cfg in TRACES.items()}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"seed": 0, "block_size": 16, "traces": configs, "rows": rows},
                                  indent=2) + "\n")


if __name__ == "__main__":
    main()
