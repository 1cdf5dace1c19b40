"""SGLang's names for the RL control verbs, as slime calls them (frontend process, HTTP server; routed
with the other RL endpoints, control.py): slime/backends/sglang_utils/sglang_engine.py brackets a
weight sync with `/pause_generation`, `GET /flush_cache`, `/update_weights_from_disk` and
`/continue_generation`, and frees memory around training with `/release_memory_occupation` and
`/resume_memory_occupation`. Each maps onto the engine's verb; docs/serving.md ("RL control endpoints").
"""

from __future__ import annotations

from typing import Literal

from starlette.requests import Request
from starlette.responses import Response

from coreserve.frontend.server.common.errors import engine_call
from coreserve.frontend.server.common.fields import StrictBody

SGLANG_PATHS = frozenset(
    ("/pause_generation", "/continue_generation", "/flush_cache", "/release_memory_occupation",
     "/resume_memory_occupation")
)
# SGLang's pause modes onto coreserve's: "in_place" keeps requests with their KV; "retract" (SGLang frees
# their KV and computes them again later) is kept in place too, the same tokens either way
_PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}

MemoryTag = Literal["weights", "kv_cache"]


class PauseGenerationRequest(StrictBody):
    mode: Literal["abort", "in_place", "retract"] = "abort"


class ContinueGenerationRequest(StrictBody):
    torch_empty_cache: bool = True  # a CUDA allocator hint: nothing is cached to empty here


class MemoryOccupationRequest(StrictBody):
    tags: list[MemoryTag] | None = None  # None: both


def register(router) -> None:
    router.post("/pause_generation")(pause_generation)
    router.post("/continue_generation")(continue_generation)
    router.get("/flush_cache")(flush_cache)
    router.post("/flush_cache")(flush_cache)
    router.post("/release_memory_occupation")(release_memory_occupation)
    router.post("/resume_memory_occupation")(resume_memory_occupation)


async def pause_generation(request: Request, body: PauseGenerationRequest | None = None) -> Response:
    mode = _PAUSE_MODES[(body or PauseGenerationRequest()).mode]
    await engine_call("mode", request.app.state.server.engine.pause_generation(mode))
    return Response(status_code=200)


async def continue_generation(request: Request, body: ContinueGenerationRequest | None = None) -> Response:
    await engine_call(None, request.app.state.server.engine.resume_generation())
    return Response(status_code=200)


async def flush_cache(request: Request) -> Response:
    """The prefix cache forgotten (slime polls this until it answers 200)."""
    await engine_call(None, request.app.state.server.engine.reset_prefix_cache())
    return Response("Cache flushed.", status_code=200)


async def release_memory_occupation(
    request: Request, body: MemoryOccupationRequest | None = None
) -> Response:
    """Sleep level 1: the KV cache freed. SGLang offloads the weights to host memory and brings them
    back on resume; coreserve has no offload (on the CPU the weights are in host memory already), so
    they stay, and a resume finds them as they were. A `weights` tag frees nothing more."""
    await engine_call("tags", request.app.state.server.engine.sleep(1))
    return Response(status_code=200)


async def resume_memory_occupation(request: Request, body: MemoryOccupationRequest | None = None) -> Response:
    """The tags' parts back (None: both): the KV cache is allocated again; the weights never left."""
    tags = (body or MemoryOccupationRequest()).tags
    await engine_call("tags", request.app.state.server.engine.wake_up(tags, None))
    return Response(status_code=200)
