"""The engine's OOM fault switches (``core.faults``): off unless CONFKV_FAULT_OOM_EVERY or
CONFKV_FAULT_OOM_TOKENS is set to N >= 1."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.core.faults import OOM_EVERY_ENV, OOM_TOKENS_ENV, OomFault


def test_off_by_default_never_raises() -> None:
    fault = OomFault.from_env({})
    for _ in range(100):
        fault.before_model()
    assert fault.every == 0


def test_every_third_step_raises_an_out_of_memory_error() -> None:
    fault = OomFault.from_env({OOM_EVERY_ENV: "3"})
    raised = []
    for step in range(1, 10):
        try:
            fault.before_model()
        except torch.OutOfMemoryError:
            raised.append(step)
    assert raised == [3, 6, 9]


@pytest.mark.parametrize("text", ["0", "-2", "yes", "1.5", "3x"])
def test_anything_but_a_positive_integer_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=OOM_EVERY_ENV):
        OomFault.from_env({OOM_EVERY_ENV: text})


def test_a_token_bound_raises_for_passes_over_it_only() -> None:
    fault = OomFault.from_env({OOM_TOKENS_ENV: "12"})
    fault.before_model(12)
    with pytest.raises(torch.OutOfMemoryError, match=OOM_TOKENS_ENV):
        fault.before_model(13)
    with pytest.raises(ValueError, match=OOM_TOKENS_ENV):
        OomFault.from_env({OOM_TOKENS_ENV: "0"})
