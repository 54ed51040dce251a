"""bench/quality/eval_lm.py end to end, run as the benchmark is (``python -m``, a subprocess, so the
tests never import the benchmarks): lm-eval's local-completions model against a real server, its
perplexities equal to the engine's in-process ones (needs the ``eval`` extra)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]


def test_lm_eval_perplexity_matches_the_engine(tmp_path: Path) -> None:
    out = tmp_path / "eval_lm.json"
    # max_length 256: the longer documents are scored over several rolling windows
    run = subprocess.run([sys.executable, "-m", "bench.quality.eval_lm", "--docs", "3", "--max-chars", "1200",
                          "--max-length", "256", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=850)
    report = json.loads(out.read_text())
    assert run.returncode == 0 and report["ok"], (report, run.stdout[-2000:], run.stderr[-2000:])
    assert report["documents"] == 3
    assert all(report["lm_eval"][m] > 1.0 for m in ("word_perplexity", "byte_perplexity"))
    assert max(report["relative_difference"].values()) <= 1e-3
