"""``bench/gpu.py --tiny`` on this CPU: the GPU benchmark's four sections at tiny shapes, run as the
command a user runs, so it cannot rot before a GPU runs it. Checks what the sections must show
(parity, both peers measured, the scenario's budgets ordered, the memory readings present), never
how fast anything was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_bench_tiny_runs_every_section_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu-tiny.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), "--tiny", "--device", "cpu",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    assert [r["model"] for r in result["a"]] == ["tiny-llama", "tiny-qwen2"]
    for row in result["a"]:
        assert row["greedy_equal"] and row["max_logit_diff_rel"] < 1e-4, row
    assert [r["concurrent"] for r in result["b"]] == [1, 4]
    assert all(r["confkv_tok_s"] > 0 and r["transformers_tok_s"] > 0 for r in result["b"])
    peaks = {r["policy"]: r for r in result["c"]}
    assert all(r["generated"] == 240 for r in peaks.values())
    full, guide, quarter = peaks["full"], peaks["conf-kv 0.582"], peaks["conf-kv 0.25"]
    assert quarter["peak_kv_bytes"] < guide["peak_kv_bytes"] < full["peak_kv_bytes"]
    assert peaks["conf-kv+tiers 0.582"]["peak_kv_bytes"] < full["peak_kv_bytes"]
    assert full["concurrent_held"] < guide["concurrent_held"] < quarter["concurrent_held"]
    d = result["d"]
    assert any("memory plan on cpu" in line for line in d["plan"])
    for when in ("idle", "load"):
        assert d[when]["pool_bytes"] > 0 and d[when]["weights_bytes"] > 0 and d[when]["nvml"]
    assert d["load"]["pool_reclaimable_bytes"] < d["idle"]["pool_reclaimable_bytes"]  # the batch holds blocks
    skipped = "needs at least 2 GPUs; this machine has 0"
    assert result["e"] == [{"section": "tensor_parallel", "skipped": skipped}]
    assert "c  full" in proc.stdout and "e  tensor parallel" in proc.stdout and "wrote" in proc.stdout
