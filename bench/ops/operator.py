"""Operator benchmark against the in-process API emulator.

The operator runs as its own process (the real ``confkv-operator`` entry point, settings from env), so
its memory is measured alone. Measures the time from a CR's creation until all its children exist, for
1 CR and for a burst of N CRs (default 100), and the operator's RSS at idle, after the burst, and peak.

    .venv/bin/python -m bench.ops.operator [--count 100]

Prints a table and writes bench/results/ops/operator.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from bench.common import ROOT, results_dir
from testkit.k8s_emulator import KubeEmulator
from testkit.operator_harness import cr, install_crds

NS = "default"
CHILDREN = [("v1", "configmaps", "{}-config"), ("v1", "serviceaccounts", "{}-agent"),
            ("rbac.authorization.k8s.io/v1", "roles", "{}-agent"),
            ("rbac.authorization.k8s.io/v1", "rolebindings", "{}-agent"), ("apps/v1", "deployments", "{}"),
            ("v1", "services", "{}"), ("policy/v1", "poddisruptionbudgets", "{}")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _complete(api: KubeEmulator, name: str) -> bool:
    return all(api.get(version, plural, pattern.format(name), NS) for version, plural, pattern in CHILDREN)


def _start_operator(api: KubeEmulator, liveness_port: int, log: Any) -> subprocess.Popen[bytes]:
    env = {**os.environ, "KUBECONFIG": api.kubeconfig_path, "CONFKV_RESYNC_SECONDS": "30",
           "CONFKV_LIVENESS_PORT": str(liveness_port), "CONFKV_LOG_LEVEL": "WARNING",
           "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("api", "operator"))}
    proc = subprocess.Popen([sys.executable, "-m", "confkv_operator.main"], env=env,
                            stdout=log, stderr=subprocess.STDOUT)  # a file: a full pipe would block it
    url = f"http://127.0.0.1:{liveness_port}/healthz"

    def alive() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"operator exited with {proc.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    KubeEmulator.wait_for(alive, timeout=60, interval=0.1, message="operator liveness endpoint")
    return proc


def _burst(api: KubeEmulator, names: list[str], timeout: float) -> list[float]:
    """Create the CRs back to back; return each one's creation-to-complete latency in seconds."""
    started: dict[str, float] = {}
    for name in names:
        api.create(cr(name, {"confkv": {"eviction": {"k": 3}}}))
        started[name] = time.perf_counter()
    done: dict[str, float] = {}
    deadline = time.perf_counter() + timeout
    while len(done) < len(names):
        for name in names:
            if name not in done and _complete(api, name):
                done[name] = time.perf_counter() - started[name]
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(names) - len(done)} CRs incomplete after {timeout}s")
        time.sleep(0.005)
    return [done[name] for name in names]


def _summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {"count": len(ordered), "p50_s": statistics.median(ordered),
            "p95_s": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], "max_s": ordered[-1]}


def run(count: int) -> dict[str, Any]:
    log_path = Path(tempfile.gettempdir()) / "confkv-bench-operator.log"
    with KubeEmulator() as api, log_path.open("wb") as log:
        install_crds(api)
        proc = _start_operator(api, _free_port(), log)
        try:
            operator = psutil.Process(proc.pid)
            idle_rss = operator.memory_info().rss
            single = _burst(api, ["single"], timeout=60)
            burst_start = time.perf_counter()
            burst = _burst(api, [f"cr-{i:03d}" for i in range(count)], timeout=600)
            burst_wall = time.perf_counter() - burst_start
            after_rss = operator.memory_info().rss
            uss = operator.memory_full_info().uss
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return {
        "single_cr": _summary(single),
        "burst": {**_summary(burst), "wall_s": burst_wall, "crs_per_s": count / burst_wall},
        "rss_mib": {"idle": idle_rss / 2**20, "after_burst": after_rss / 2**20},
        "uss_mib_after_burst": uss / 2**20,
        "children_per_cr": len(CHILDREN),
        "environment": {"python": platform.python_version(), "cpus": os.cpu_count(),
                        "load_avg_1m": os.getloadavg()[0], "resync_seconds": 30},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=100, help="CRs in the burst (default 100)")
    parser.add_argument("--out", type=Path, default=results_dir("ops") / "operator.json")
    args = parser.parse_args()
    result = run(args.count)
    single, burst, rss = result["single_cr"], result["burst"], result["rss_mib"]
    rows = [
        ("1 CR: creation -> all children", f"{single['p50_s'] * 1000:.0f} ms"),
        (f"{args.count} CRs: p50 latency", f"{burst['p50_s'] * 1000:.0f} ms"),
        (f"{args.count} CRs: p95 latency", f"{burst['p95_s'] * 1000:.0f} ms"),
        (f"{args.count} CRs: all children present",
         f"{burst['wall_s']:.2f} s ({burst['crs_per_s']:.1f} CR/s)"),
        ("operator RSS idle", f"{rss['idle']:.1f} MiB"),
        (f"operator RSS after {args.count} CRs", f"{rss['after_burst']:.1f} MiB"),
    ]
    width = max(len(label) for label, _ in rows)
    print(f"{'metric'.ljust(width)}  value")
    print(f"{'-' * width}  {'-' * 24}")
    for label, value in rows:
        print(f"{label.ljust(width)}  {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
