"""The RL control endpoints under vLLM's and SGLang's names (frontend process, HTTP server): new weights
from a checkpoint on disk, pause and resume, sleep and wake, the prefix-cache reset, and the state they
leave (docs/rl.md, docs/serving.md). Routed only with `--enable-rl-endpoints`; behind the API key when
one is set (the key middleware covers RL_PATHS). Each call runs on the AsyncLLM's engine thread, so the
event loop keeps serving while an update waits for running requests.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from coreserve.frontend.server.common.errors import engine_call
from coreserve.frontend.server.common.fields import NonNegativeInt64
from coreserve.frontend.server.common.logprob_json import JSONBytesResponse
from coreserve.frontend.server.rl.sglang_control import SGLANG_PATHS
from coreserve.frontend.server.rl.sglang_control import register as register_sglang_names

RL_PATHS = frozenset(
    ("/update_weights_from_disk", "/update_weights", "/reset_prefix_cache", "/pause", "/resume", "/is_paused",
     "/sleep", "/wake_up", "/is_sleeping", "/get_weight_version")
) | SGLANG_PATHS

PauseMode = Literal["abort", "wait", "keep"]


class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's body: `model_path`, a safetensors file or a folder of them (HF names, whole or part), and
    the fields slime sends: `weight_version` (the trainer's: the version the weights take; SGLang's is a
    string, here an integer written either way), `load_format` (only auto), `abort_all_requests` (mode
    abort), `flush_cache` (the prefix cache is always flushed: its KV came from the old weights)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # an unknown field is a 400 naming it

    model_path: str
    mode: PauseMode = "wait"  # what running requests do first (docs/rl.md)
    weight_version: Annotated[str, Field(pattern=r"^[0-9]{1,18}$")] | NonNegativeInt64 | None = None
    load_format: Literal["auto"] | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class UpdateWeightsRequest(BaseModel):
    """prime-rl's body (its filesystem broadcast: `weight_dir`, a folder of safetensors, marker files
    beside them); it pauses with mode keep around the call, so running requests go on under the new
    weights, as its own server's update does."""

    model_config = ConfigDict(extra="forbid", strict=True)

    weight_dir: str


def rl_router() -> APIRouter:
    router = APIRouter()
    router.post("/update_weights_from_disk")(update_weights_from_disk)
    router.post("/update_weights")(update_weights)
    router.post("/reset_prefix_cache")(reset_prefix_cache)
    router.post("/pause")(pause)
    router.post("/resume")(resume)
    router.get("/is_paused")(is_paused)
    router.post("/sleep")(sleep)
    router.post("/wake_up")(wake_up)
    router.get("/is_sleeping")(is_sleeping)
    router.get("/get_weight_version")(get_weight_version)
    register_sglang_names(router)
    return router


async def update_weights_from_disk(request: Request, body: UpdateWeightsFromDiskRequest) -> Response:
    engine = request.app.state.server.engine
    mode = "abort" if body.abort_all_requests else body.mode
    target = None if body.weight_version is None else int(body.weight_version)
    version = await engine_call("model_path", engine.update_weights(body.model_path, mode, True, target))
    message = f"weights loaded from {body.model_path}; weight_version {version}"
    return JSONBytesResponse(
        {"success": True, "message": message, "weight_version": version, "num_paused_requests": 0}
    )


async def update_weights(request: Request, body: UpdateWeightsRequest) -> Response:
    engine = request.app.state.server.engine
    version = await engine_call("weight_dir", engine.update_weights(body.weight_dir, "keep"))
    message = f"weights loaded from {body.weight_dir}; weight_version {version}"
    return JSONBytesResponse({"success": True, "message": message, "weight_version": version})


async def reset_prefix_cache(request: Request) -> Response:
    await engine_call(None, request.app.state.server.engine.reset_prefix_cache())
    return Response(status_code=200)


async def pause(request: Request, mode: str = "abort", clear_cache: bool = False) -> Response:
    """vLLM's `POST /pause?mode=abort|wait|keep&clear_cache=false`: nothing new is scheduled until
    /resume (a bad mode is the engine's ValueError, a 400 naming `mode`); `clear_cache=true` also
    forgets the prefix cache once paused."""
    engine = request.app.state.server.engine
    await engine_call("mode", engine.pause_generation(mode))
    if clear_cache:
        await engine_call(None, engine.reset_prefix_cache())
    return Response(status_code=200)


async def resume(request: Request) -> Response:
    await engine_call(None, request.app.state.server.engine.resume_generation())
    return Response(status_code=200)


async def is_paused(request: Request) -> Response:
    state = await engine_call(None, request.app.state.server.engine.control_state())
    return JSONBytesResponse({"is_paused": state.is_paused})


async def sleep(request: Request, level: int = 1) -> Response:
    """vLLM's `POST /sleep?level=1|2`: 1 frees the KV cache, 2 drops the weights too."""
    await engine_call("level", request.app.state.server.engine.sleep(level))
    return Response(status_code=200)


async def wake_up(
    request: Request, tags: Annotated[list[str] | None, Query()] = None, model_path: str | None = None
) -> Response:
    """vLLM's `POST /wake_up?tags=weights&tags=kv_cache` (none: both). After level 2 the weights come
    back from `model_path` (a checkpoint), or from an /update_weights_from_disk holding every weight."""
    engine = request.app.state.server.engine
    await engine_call("tags", engine.wake_up(tags, model_path))
    return Response(status_code=200)


async def is_sleeping(request: Request) -> Response:
    state = await engine_call(None, request.app.state.server.engine.control_state())
    return JSONBytesResponse({"is_sleeping": state.sleep_level > 0, "level": state.sleep_level})


async def get_weight_version(request: Request) -> Response:
    state = await engine_call(None, request.app.state.server.engine.control_state())
    return JSONBytesResponse({"weight_version": state.weight_version})
