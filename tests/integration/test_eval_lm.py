"""bench/eval_lm.py end to end: lm-eval's local-completions model against a real server, its
perplexities equal to the engine's in-process ones (needs the ``eval`` extra)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import eval_lm  # noqa: E402


def test_lm_eval_perplexity_matches_the_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(eval_lm, "RESULTS", tmp_path)
    # max_length 256: the longer documents are scored over several rolling windows
    status = eval_lm.main(["--docs", "3", "--max-chars", "1200", "--max-length", "256"])
    report = json.loads((tmp_path / "eval_lm.json").read_text())
    assert status == 0 and report["ok"], report
    assert report["documents"] == 3 and all(report["lm_eval"][m] > 1.0 for m in eval_lm.METRICS[:2])
    assert max(report["relative_difference"].values()) <= 1e-3
