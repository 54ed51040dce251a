"""Fault injection for tests of the agent's OOM remedies: OFF unless one environment variable asks.

``CONFKV_FAULT_OOM_EVERY=N`` (a positive integer) makes every N-th engine step that has work raise
``torch.OutOfMemoryError`` before the model runs, so the engine's own OOM recovery (count, drop the
step's caches, requeue for recompute) runs on a CPU as it would on a GPU that ran out of memory.

It is an environment variable, not a config key, on purpose: a ConfigMap, a CR or a Helm value can
never switch it on, and no default does. Anything but a positive integer is refused at start (a
typo must not silently inject nothing, or inject something), and an enabled switch is logged as a
warning at start. A request stepped in more than ``MAX_OOM_RETRIES`` injected OOMs finishes with
finish_reason 'error', exactly as after real ones: keep N above a request's number of steps / 2.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

OOM_EVERY_ENV = "CONFKV_FAULT_OOM_EVERY"

log = logging.getLogger("confkv.engine")


class OomFault:
    """Counts the steps that reach the model; raises on every ``every``-th (0: never)."""

    def __init__(self, every: int = 0) -> None:
        if every < 0:
            raise ValueError(f"{OOM_EVERY_ENV} must be a positive integer, got {every}")
        self.every = every
        self._steps = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> OomFault:
        text = environ.get(OOM_EVERY_ENV, "").strip()
        if not text:
            return cls()
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{OOM_EVERY_ENV} must be a positive integer (inject an OOM every N-th "
                             f"step), got {text!r}; unset it to run without fault injection")
        log.warning("FAULT INJECTION ON: %s=%s, every %s-th engine step raises an out-of-memory error",
                    OOM_EVERY_ENV, text, text)
        return cls(int(text))

    def before_model(self) -> None:
        """Call once per step with work, before the forward pass."""
        if not self.every:
            return
        self._steps += 1
        if self._steps % self.every == 0:
            raise torch.OutOfMemoryError(f"injected by {OOM_EVERY_ENV}={self.every} (step {self._steps})")
