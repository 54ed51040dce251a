"""Requests in progress, for a drain that keeps listening (pure ASGI middleware).

On SIGTERM the server keeps accepting connections while it drains (``server.DrainingServer``):
``/ready`` answers 503 so the pod leaves the Service's endpoints, new generation requests get 503 in
OpenAI's format (a client or gateway retries them elsewhere), and the requests that arrived before
the signal run to completion, streams included. ``RequestTracker`` counts those: the drain ends
when none is left (or at its deadline). While draining, every response carries ``Connection:
close``, so kept-alive clients reconnect, and land on another pod.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_CLOSE = (b"connection", b"close")


class RequestTracker:
    """HTTP requests admitted before the drain began and not finished yet (event-loop thread only)."""

    def __init__(self, draining: Callable[[], bool]) -> None:
        self.draining = draining
        self._admitted = 0

    @property
    def admitted(self) -> int:
        return self._admitted

    def begin(self) -> bool:
        """Count a request that starts now; False (not counted) once draining."""
        if self.draining():
            return False
        self._admitted += 1
        return True

    def end(self) -> None:
        self._admitted -= 1


class DrainMiddleware:
    def __init__(self, app: ASGIApp, tracker: RequestTracker) -> None:
        self.app = app
        self.tracker = tracker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        counted = self.tracker.begin()

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and self.tracker.draining():
                headers = list(message.get("headers", ()))
                if _CLOSE not in headers:
                    message = {**message, "headers": [*headers, _CLOSE]}
            await send(message)

        try:
            await self.app(scope, receive, send_closing)
        finally:
            if counted:
                self.tracker.end()
