"""What every benchmark suite shares: where the repository and each suite's results are, and writing
a report (pretty JSON and a line saying where).

Benchmarks run from the repository root as modules (``python -m bench.<suite>.<name>``), so the
checkout's packages are imported, and they never import ``tests`` (drivers both use live in
``testkit``).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SUITES = ("serving", "quality", "cache", "ops", "micro")


def results_dir(suite: str) -> Path:
    """``bench/results/<suite>``: where a suite's result files go (one folder per suite)."""
    if suite not in SUITES:
        raise ValueError(f"unknown benchmark suite {suite!r}; one of {', '.join(SUITES)}")
    return ROOT / "bench" / "results" / suite


def write_report(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


def load_results(path: Path) -> dict[str, Any]:
    """A checkpointed results file, or an empty one (``{"results": {}}``) when it does not exist yet."""
    return json.loads(path.read_text()) if path.exists() else {"results": {}}


def machine() -> str:
    """The CPU model and the SIMD features that decide kernel choices, for a report's ``machine`` field
    (``platform.processor()`` is empty on Linux)."""
    name, flags = platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name} ({', '.join(simd)})" if simd else name
