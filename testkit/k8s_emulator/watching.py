"""Watch fan-out: an event history (for resuming from a resourceVersion) and per-stream queues."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Any

from .errors import ApiError


@dataclass(frozen=True)
class Event:
    rv: int
    type: str  # ADDED, MODIFIED or DELETED
    key: tuple[str, str]  # (group, plural)
    namespace: str | None
    obj: dict[str, Any]  # a committed snapshot: never mutated after the event is made
    old: dict[str, Any] | None = None


def _matches(event: Event, key: tuple[str, str], namespace: str | None) -> bool:
    return event.key == key and namespace in (None, event.namespace)


class Watcher:
    """One watch stream's queue; fed from any thread, drained on the server's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, str], namespace: str | None) -> None:
        self.loop = loop
        self.key = key
        self.namespace = namespace
        self.queue: asyncio.Queue[Event | None] = asyncio.Queue()

    def wants(self, event: Event) -> bool:
        return _matches(event, self.key, self.namespace)

    def push(self, event: Event | None) -> None:
        """Queue an event (None closes the stream); safe to call from any thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:
            pass  # the loop is closed: the stream is gone anyway


class Hub:
    """History of recent events plus live watchers. Callers hold the store lock."""

    def __init__(self, history: int = 20000) -> None:
        self._history: collections.deque[Event] = collections.deque(maxlen=history)
        self._watchers: set[Watcher] = set()

    def reset(self) -> None:
        self._history.clear()
        self.close_all()

    def emit(self, event: Event) -> None:
        self._history.append(event)
        for watcher in list(self._watchers):
            if watcher.wants(event):
                watcher.push(event)

    def since(self, key: tuple[str, str], namespace: str | None, rv: int) -> list[Event]:
        """Events after `rv`; 410 Expired when the history no longer reaches back that far."""
        if self._history and len(self._history) == self._history.maxlen and self._history[0].rv > rv + 1:
            raise ApiError(
                410, f"too old resource version: {rv} ({self._history[0].rv - 1})", reason="Expired"
            )
        return [e for e in self._history if e.rv > rv and _matches(e, key, namespace)]

    def add(self, watcher: Watcher) -> None:
        self._watchers.add(watcher)

    def remove(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def close_all(self) -> None:
        for watcher in list(self._watchers):
            watcher.push(None)
        self._watchers.clear()
