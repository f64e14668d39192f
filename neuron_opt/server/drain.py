"""Graceful shutdown: on SIGTERM (or SIGINT) the server drains before it exits.

Design decisions
- Draining keeps the listening socket open, so a client that arrives meanwhile gets an answer instead of a refused
  connection: every route but `/metrics` is a 503 with Retry-After (`/health` too, so a load balancer takes the
  server out of rotation), while the requests already in flight, streams included, run to their end.
- The process exits once no request is in flight, or `serve --shutdown-timeout` seconds after the signal, whichever
  comes first (uvicorn then gives what still runs SHUTDOWN_GRACE_S more before cancelling it, and the engine
  stops); the exit code is 0 either way. A second signal exits at once.
- The signal is handled, not re-raised after the drain (uvicorn's own handler re-raises it, which would make the
  exit status "killed by SIGTERM"): a drained shutdown is a clean exit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

SHUTDOWN_GRACE_S = 1.0  # after the drain: what uvicorn waits for open responses before cancelling them


class Drain:
    """The HTTP requests in flight, and whether the server is draining (event-loop thread only)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.deadline: float | None = None  # monotonic time the drain ends at; None: not draining

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def begin(self, timeout_s: float) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + timeout_s

    def done(self) -> bool:
        """Draining, and nothing is left to wait for."""
        return self.deadline is not None and (self.in_flight == 0 or time.monotonic() >= self.deadline)


class DrainMiddleware:
    """Counts the HTTP requests in flight (a stream until its last byte) and refuses new ones while draining with
    `refusal()`, an ASGI response (plain ASGI: streaming responses pass through untouched)."""

    def __init__(self, app: Any, drain: Drain, refusal: Callable[[], Any]) -> None:
        self.app, self.drain, self.refusal = app, drain, refusal

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and scope["path"] != "/metrics":
            await self.refusal()(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM/SIGINT starts a drain of `drain` (up to `timeout_s`) instead of exiting
    at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float) -> None:
        config.timeout_graceful_shutdown = SHUTDOWN_GRACE_S  # the drain has waited already
        super().__init__(config)
        self.drain, self.timeout_s = drain, timeout_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining:  # a second signal: stop waiting; a third: not even for the grace period
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        self.drain.begin(self.timeout_s)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.done():
            self.should_exit = True
        return await super().on_tick(counter)
