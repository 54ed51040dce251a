"""``device: cuda`` without a usable CUDA device is an error that says what was found, never a CPU
fallback; ``auto`` device and dtype choose CUDA / bfloat16 only where CUDA is usable.

The subprocess test runs the real CLI on this machine (a CPU-only torch build). The driver and
visibility branches cannot happen on it, so those tests replace torch's CUDA probes (a mock where
no real part can run here); the CUDA-present tests are skipped without CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from confkv_engine.model import loader
from confkv_engine.model.loader import DeviceUnavailable, resolve_device, resolve_dtype

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without usable CUDA")
@pytest.mark.parametrize("argv", [["serve", "--device", "cuda"], ["serve", "--device=cuda", "--port", "1"]])
def test_serve_device_cuda_without_cuda_exits_with_the_reason(argv: list[str], tmp_path) -> None:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "confkv_engine.cli", *argv], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 3, proc.stderr
    line = [ln for ln in proc.stderr.splitlines() if "device cuda requested but" in ln]
    assert line and line[0].startswith("confkv: device cuda requested but"), proc.stderr
    if torch.version.cuda is None:
        assert "CPU-only build" in line[0]
    assert "CONF-KV engine starting" not in proc.stdout  # nothing was started


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without usable CUDA")
def test_config_file_device_cuda_is_the_same_error(tmp_path) -> None:
    config = tmp_path / "confkv.json"
    config.write_text('{"engine": {"device": "cuda"}}')
    proc = subprocess.run([sys.executable, "-m", "confkv_engine.cli", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and "device cuda requested but" in proc.stderr


def test_cpu_only_build_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(DeviceUnavailable, match=r"^device cuda requested but .*CPU-only build"):
        resolve_device("cuda")
    assert resolve_device("auto") == "cpu"  # auto never errors


def test_missing_driver_and_hidden_devices_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # mock: a CUDA build of torch with no usable device (this machine's torch is CPU-only)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(loader, "_nvidia_driver_present", lambda: False)
    with pytest.raises(DeviceUnavailable, match="no NVIDIA driver"):
        resolve_device("cuda")
    monkeypatch.setattr(loader, "_nvidia_driver_present", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceUnavailable, match="no CUDA device is visible"):
        resolve_device("cuda:0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(DeviceUnavailable, match="driver is present but no CUDA device"):
        resolve_device("cuda")


def test_device_index_beyond_the_visible_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # mock: one visible GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == "cuda:0" and resolve_device("auto") == "cuda"
    with pytest.raises(DeviceUnavailable, match="only 1 CUDA device"):
        resolve_device("cuda:1")


def test_auto_dtype_follows_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_dtype("auto", "cpu") is torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)  # mock: the device's answer
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_dtype("auto", "cuda:0") is torch.float16
    assert resolve_dtype("bfloat16", "cpu") is torch.bfloat16  # an explicit dtype is kept
