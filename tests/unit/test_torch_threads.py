"""Only the engine thread runs torch ops in parallel: helper threads opt out (``core.threads``)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from confkv_engine.core.threads import serial_torch_ops


def _in_thread(fn):
    box: dict[str, object] = {}
    t = threading.Thread(target=lambda: box.update(result=fn()))
    t.start()
    t.join()
    return box["result"]


@pytest.fixture
def two_threads():
    """The suite runs torch single-threaded (conftest); this test needs a parallel setting."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(saved)


def test_serial_torch_ops_is_per_thread(two_threads):
    before = torch.get_num_threads()
    assert before == two_threads

    def helper() -> tuple[bool, int, float]:
        found = serial_torch_ops()
        x = torch.randn(256, 256)
        return found, torch.get_num_threads(), float((x @ x).sum())

    found, helper_threads, _ = _in_thread(helper)
    assert found, "torch's OpenMP runtime was not found"
    assert helper_threads == 1
    # The calling thread, torch's global setting and threads started later keep theirs.
    assert torch.get_num_threads() == before
    assert _in_thread(torch.get_num_threads) == before


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux /proc")
def test_a_serial_thread_starts_no_thread_pool_even_through_mkl(two_threads):
    """The codec's maths (``log2`` goes to MKL's vector library where torch links MKL, and MKL sizes
    its own OpenMP region from the process-wide count) must run inline in a serial thread: a second
    team there halved the engine thread's decode speed."""
    x = torch.rand(64, 16, 3, 64) + 0.5

    def helper() -> tuple[int, int]:
        serial_torch_ops()
        before = _os_threads()
        torch.log2(x), torch.exp2(x), torch.log(x), torch.exp(x), x.amax(-1), x @ x.transpose(-1, -2)
        return before, _os_threads()

    before, after = _in_thread(helper)
    assert after == before
