"""Draining before the server stops (frontend process, HTTP server): what a rolling update needs. From
the first SIGTERM or SIGINT on, every new request and `/ready` is a 503 (a router sends elsewhere),
`/health` and `/metrics` still answer; the requests in flight finish for up to `--shutdown-timeout`
seconds, then those left are ended with an error by shutting the engine down, never left hanging.

`Drain` counts the requests in flight and holds the timeout; `DrainMiddleware` counts and refuses;
launch.py's `DrainingServer` starts `Drain.run` on the signal and lets uvicorn stop once it returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from coreserve.frontend.server.common.errors import error_response

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # vLLM's default is 0 (abort at once); a rolling update wants a drain
ANSWER_GRACE_S = 5.0  # once the engine is shut, the requests it ended write their error answers within this
POLL_S = 0.05
OPEN_PATHS = frozenset({"/health", "/metrics"})  # the process is alive and watched while it drains


class Drain:
    def __init__(self, timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.is_draining = False  # new requests are refused
        self.is_hurried = False  # a second signal: stop waiting for the requests in flight
        self.num_in_flight = 0  # HTTP requests taken and not yet answered in full (streams included)

    def begin(self) -> None:
        """Refuse new requests from now on; a plain flag, so a signal handler may call it."""
        self.is_draining = True

    def hurry(self) -> None:
        self.is_hurried = True

    async def run(self, abort: Callable[[], None]) -> None:
        """Refuses new requests, and returns once those in flight are answered: all of them within the
        timeout (unless hurried), else after `abort` (the engine's shutdown, on a thread: every open
        engine stream then fails, which its handler answers as an error) and a grace for those answers."""
        self.begin()
        logger.info("draining: %d requests in flight, for up to %g s", self.num_in_flight, self.timeout_s)
        if await self._wait_idle(self.timeout_s, can_hurry=True):
            return
        logger.warning("shutdown: ending the %d requests still in flight with an error", self.num_in_flight)
        await asyncio.to_thread(abort)
        if not await self._wait_idle(ANSWER_GRACE_S, can_hurry=False):
            logger.warning("shutdown: %d requests still unanswered; uvicorn cancels them", self.num_in_flight)

    async def _wait_idle(self, timeout_s: float, can_hurry: bool) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight:
            if time.monotonic() >= deadline or (can_hurry and self.is_hurried):
                return False
            await asyncio.sleep(POLL_S)
        return True


class DrainMiddleware:
    """Counts each HTTP request until its response has been sent in full; while draining, answers a new
    one (but /health and /metrics) with a 503 in OpenAI's error shape and closes its connection."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.is_draining and scope["path"] not in OPEN_PATHS:
            refusal = error_response(
                503, "the server is shutting down: send the request to another replica",
                code="shutting_down", headers={"Connection": "close"},
            )
            await refusal(scope, receive, send)
            return
        self.drain.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.num_in_flight -= 1
