"""RequestStream: what `AsyncLLM.generate` returns, one request's deltas as an async iterator (frontend
process, event loop).

Not an async generator, on purpose: a generator's `finally` runs only when it is closed, and a generator
left by `break` is closed later, by a task the garbage collector's hook schedules, so its request id
would still look in flight to the next `generate` on the same loop. This object frees its id
synchronously, the moment the stream ends in any way: its last delta, an error, `aclose()`, a cancelled
`__anext__`, or the object being dropped (CPython drops the iterator of an `async for` left by `break`
at once). Outputs are routed by a submission key, so an id reused at once never sees the old request's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from coreserve.frontend.outputs import RequestOutput

# start() submits the request and returns its key and the queue its deltas (or an exception) arrive on;
# release(key, is_finished) forgets the key, and aborts the request in the engine unless it finished.
StartFn = Callable[[], Awaitable[tuple[str, asyncio.Queue]]]
ReleaseFn = Callable[[str, bool], None]


class RequestStream:
    """`async for out in stream` yields RequestOutput deltas until the one with `finished`; the request
    is submitted at the first `__anext__` (as a generator would start), and refused there with a
    ValueError when its input is bad."""

    def __init__(self, start: StartFn, release: ReleaseFn) -> None:
        self._key: str | None = None
        self._queue: asyncio.Queue | None = None
        self._is_done = False
        self._start, self._release_fn = start, release

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._is_done:
            raise StopAsyncIteration
        if self._queue is None:
            try:
                key, queue = await self._start()
            except BaseException:
                self._is_done = True
                raise
            if self._is_done:  # closed while it started (its adapter fetched): withdrawn at once
                self._release_fn(key, False)
                raise StopAsyncIteration
            self._key, self._queue = key, queue
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled while waiting: the stream ends, as a generator's would
            self._release(is_finished=False)
            raise
        if isinstance(item, BaseException):
            self._release(is_finished=True)  # nothing of it is left in the engine to abort
            raise item
        if item.finished:
            self._release(is_finished=True)
        return item

    async def aclose(self) -> None:
        """Ends the stream; an unfinished request is aborted and its id is free on return."""
        self._release(is_finished=False)

    def close(self) -> None:
        """`aclose` without awaiting, for synchronous code."""
        self._release(is_finished=False)

    def __del__(self) -> None:
        self._release(is_finished=False)

    def _release(self, is_finished: bool) -> None:
        self._is_done = True
        key, self._key = self._key, None
        if key is not None:
            self._release_fn(key, is_finished)
