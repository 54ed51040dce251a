"""Fault injection for tests of the engine's and the agent's OOM handling: OFF unless an environment
variable asks.

- ``CONFKV_FAULT_OOM_EVERY=N`` (a positive integer) makes every N-th engine pass that has work raise
  ``torch.OutOfMemoryError`` before the model runs (a retry after an OOM is a pass of its own).
- ``CONFKV_FAULT_OOM_TOKENS=N`` makes every pass that computes more than N tokens raise it: a
  stand-in for an activation bound, so a step of several sequences fails where each fits alone,
  and a sequence whose own chunk is over N fails even alone.

Either way the engine's own OOM recovery (``core.oom``: retry with fewer sequences, fail a
sequence that runs out of memory alone) runs on a CPU as it would on a GPU that ran out of memory.

They are environment variables, not config keys, on purpose: a ConfigMap, a CR or a Helm value can
never switch them on, and no default does. Anything but a positive integer is refused at start (a
typo must not silently inject nothing, or inject something), and an enabled switch is logged as a
warning at start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

OOM_EVERY_ENV = "CONFKV_FAULT_OOM_EVERY"
OOM_TOKENS_ENV = "CONFKV_FAULT_OOM_TOKENS"

log = logging.getLogger("confkv.engine")


def _positive(environ: Mapping[str, str], name: str, meaning: str) -> int:
    """The variable's positive integer value; 0 when unset."""
    text = environ.get(name, "").strip()
    if not text:
        return 0
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name} must be a positive integer ({meaning}), got {text!r}; unset it to "
                         f"run without fault injection")
    log.warning("FAULT INJECTION ON: %s=%s (%s)", name, text, meaning)
    return int(text)


class OomFault:
    """Counts the passes that reach the model; raises on every ``every``-th (0: never) and on every
    one over ``max_tokens`` tokens (0: no bound)."""

    def __init__(self, every: int = 0, max_tokens: int = 0) -> None:
        if every < 0 or max_tokens < 0:
            raise ValueError(f"{OOM_EVERY_ENV} and {OOM_TOKENS_ENV} must be positive integers, "
                             f"got {every} and {max_tokens}")
        self.every = every
        self.max_tokens = max_tokens
        self._steps = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> OomFault:
        return cls(_positive(environ, OOM_EVERY_ENV, "every N-th engine pass raises an out-of-memory error"),
                   _positive(environ, OOM_TOKENS_ENV, "a pass over N tokens raises an out-of-memory error"))

    def before_model(self, num_tokens: int = 0) -> None:
        """Call once per pass with work (``num_tokens``: the tokens it computes), before the forward."""
        if self.max_tokens and num_tokens > self.max_tokens:
            raise torch.OutOfMemoryError(f"injected by {OOM_TOKENS_ENV}={self.max_tokens} "
                                         f"(a pass of {num_tokens} tokens)")
        if not self.every:
            return
        self._steps += 1
        if self._steps % self.every == 0:
            raise torch.OutOfMemoryError(f"injected by {OOM_EVERY_ENV}={self.every} (step {self._steps})")
