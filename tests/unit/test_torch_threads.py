"""Only the engine thread runs torch ops in parallel: helper threads opt out (``core.threads``)."""

from __future__ import annotations

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
