"""How a generation reaches its client, and how a client that leaves ends it (frontend process, HTTP).

Streams are server-sent events through sse-starlette's EventSourceResponse. FastAPI (0.123+) has SSE of
its own, but only for a path operation that is itself a generator: these endpoints stream or answer
one JSON body depending on the request's `stream` field, and must answer a refused request with a 400
before the stream begins. sse-starlette takes any async iterator as a response and cancels it when the
client disconnects, which closes the engine streams (an abort in the core). A whole-body response races
the generation against a watcher of the connection instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import anyio
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from coreserve.frontend.errors import EngineDeadError
from coreserve.frontend.server.common.errors import error_body
from coreserve.frontend.server.common.logprob_json import to_json

logger = logging.getLogger(__name__)
T = TypeVar("T")

DISCONNECT_POLL_S = 0.2
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away; nobody reads it


async def until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response, or `work` cancelled (its engine requests aborted) once the client is gone."""
    try:
        return await unless_disconnected(request, work)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)


class ClientGone(Exception):
    """The client left while its request was still being prepared (its chat template rendering)."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or `work` cancelled and ClientGone raised once the client is gone: for what runs
    before a response exists (a chat template's render, stopped with its task)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    """The body is read, so the next ASGI message is the disconnect (uvicorn sends it when the client
    goes, or once the response is complete); anything else is waited out, never spun on."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(DISCONNECT_POLL_S)


def sse_response(chunks: AsyncIterator[dict], on_close) -> EventSourceResponse:
    """Each chunk as `data: {json}`, then `data: [DONE]`; `on_close()` runs however the stream ends: from
    the events' own cleanup, and as the response's background task for a client gone before the first
    event (an iterator never started has no cleanup to run). Closing twice is harmless."""
    events = _events(chunks, on_close)
    return EventSourceResponse(events, sep="\n", ping=15, background=BackgroundTask(on_close))


async def _events(chunks: AsyncIterator[dict], on_close) -> AsyncIterator[dict]:
    try:
        async for chunk in chunks:
            yield {"data": to_json(chunk).decode()}
    except EngineDeadError as exc:  # the status line is gone: the error travels as an event
        yield {
            "data": to_json(error_body(503, f"the engine is not running: {exc}", code="engine_dead")).decode()
        }
    finally:
        with anyio.CancelScope(shield=True):  # a disconnect cancels this task; the aborts must still go out
            await on_close()
    yield {"data": "[DONE]"}
