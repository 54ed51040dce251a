"""Counting the host<->device synchronisations of engine steps on a CPU.

A decode step on a GPU waits on the host each time a tensor's value is read back: ``.item()``,
``bool()``/``int()`` of a tensor (all ``aten._local_scalar_dense``), ``.tolist()``, ``.numpy()``,
``.cpu()`` and device-to-host copies. On this CPU every tensor already lives on the host, so
``.tolist()``, ``.numpy()`` and ``.cpu()`` are counted at the Python level (patched for the
duration), whatever the tensor's device: an upper bound of what a GPU would pay, since a host-built
tensor read back there costs nothing. Each event is recorded with the engine source line it came from.

Explicit waits are counted too: ``retention.scoring.host_copies_done`` (a stream synchronisation on
CUDA, a no-op here) is patched to record a ``wait``.

Host-to-device copies are counted apart (``h2d``): ``torch.tensor(data, device=...)`` with a device
given, the engine's way of sending step metadata, which on CUDA is a copy from pageable memory that
waits for the stream (pinned buffers and ``non_blocking`` copies would not).
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from confkv_engine.retention import scoring

_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
_READ_BACKS = ("tolist", "numpy", "cpu")


def _engine_frame() -> str:
    """file:line of the innermost engine frame on the stack (where the read-back was asked for)."""
    for frame in reversed(traceback.extract_stack()):
        if "confkv_engine" in frame.filename:
            return f"{frame.filename.split('confkv_engine/')[-1]}:{frame.lineno}"
    return "?"


class SyncCounter(TorchDispatchMode):
    """Records every read-back to the host as (kind, engine line)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []
        self._saved: dict[str, Callable[..., Any]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default:
            self.events.append(("item", _engine_frame()))
        elif func in _COPIES and isinstance(out, torch.Tensor) and out.device.type == "cpu" \
                and isinstance(args[-1 if func is torch.ops.aten.copy_.default else 0], torch.Tensor) \
                and args[-1 if func is torch.ops.aten.copy_.default else 0].device.type != "cpu":
            self.events.append(("d2h", _engine_frame()))
        return out

    def __enter__(self) -> SyncCounter:
        for name in _READ_BACKS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._recording(name, original))
        self._saved["tensor"] = torch.tensor
        torch.tensor = self._sending(torch.tensor)
        self._saved["wait"] = scoring.host_copies_done
        scoring.host_copies_done = self._waiting(scoring.host_copies_done)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        torch.tensor = self._saved.pop("tensor")
        scoring.host_copies_done = self._saved.pop("wait")
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def _waiting(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wait(*args: Any, **kwargs: Any) -> Any:
            self.events.append(("wait", _engine_frame()))
            return original(*args, **kwargs)
        return wait

    def _sending(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def send(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("device") is not None:
                self.events.append(("h2d", _engine_frame()))
            return original(*args, **kwargs)
        return send

    def syncs(self) -> list[tuple[str, str]]:
        """Read-backs to the host (what the decode bounds count)."""
        return [e for e in self.events if e[0] != "h2d"]

    def sends(self) -> list[tuple[str, str]]:
        return [e for e in self.events if e[0] == "h2d"]

    def _recording(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def read_back(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.events.append((name, _engine_frame()))
            return original(tensor, *args, **kwargs)
        return read_back

    def by_line(self) -> Counter[tuple[str, str]]:
        return Counter(self.events)
