"""What routers and gateways read from a server besides its answers (frontend process, HTTP server):
readiness (`/ready`), `/version`, the engine's load in SGLang's shapes (`/v1/loads`, and `/get_load`
which sgl-model-gateway polls), and the model and server facts the gateway asks for when a worker joins
(`/model_info`, `/server_info` and their older `/get_` names). vLLM's metric names (/metrics,
common/metrics.py) and the KV-cache events (coreserve/engine_core/kv_event_publisher.py) are the rest of a router's view;
docs/serving.md "More than one machine" says which router reads what.
"""

from __future__ import annotations

import asyncio
import datetime
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from coreserve.frontend.errors import EngineDeadError
from coreserve.frontend.server.common.errors import APIError, error_response
from coreserve.frontend.server.common.logprob_json import JSONBytesResponse
from coreserve.frontend.server.state import ServerState

try:
    VERSION = version("coreserve")
except PackageNotFoundError:  # run from a checkout that was not installed
    VERSION = "unknown"


READY_WAIT_S = 1.0  # the longest /ready waits for the engine's state: a command ahead of it means busy


def probe_router() -> APIRouter:
    router = APIRouter()
    router.get("/ready")(ready)
    router.get("/version")(version_info)
    router.get("/v1/loads")(loads)  # SGLang's; slime polls it until a server is idle
    router.get("/get_load")(get_load)  # SGLang's older one, which sgl-model-gateway's load policies read
    for path in ("/model_info", "/get_model_info"):
        router.get(path)(model_info)
    for path in ("/server_info", "/get_server_info"):
        router.get(path)(server_info)
    return router


async def ready(request: Request) -> Response:
    """200 while the engine takes new requests now; 503 saying why while it is dead, asleep, paused, or
    busy with a control command (a weight update, a sleep or wake) that holds its answer past
    READY_WAIT_S, so that a router sends its requests elsewhere meanwhile. While the server drains before
    it stops, drain.py's middleware answers the 503 instead (`shutting_down`)."""
    engine = request.app.state.server.engine
    try:
        if engine.is_dead:
            raise EngineDeadError(engine.dead_reason)
        state = await asyncio.wait_for(engine.control_state(), READY_WAIT_S)
    except EngineDeadError as exc:
        return error_response(503, f"the engine is not running: {exc}", code="engine_dead")
    except asyncio.TimeoutError:
        return error_response(503, "the engine is busy with a control command (a weight update, sleep or wake)",
                              code="not_ready")
    if state.sleep_level > 0:
        return error_response(503, f"the engine is asleep (level {state.sleep_level})", code="not_ready")
    if state.is_paused:
        return error_response(503, "the engine is paused", code="not_ready")
    return JSONBytesResponse({"status": "ready"})


async def version_info(request: Request) -> Response:
    return JSONBytesResponse({"version": VERSION})


LOAD_SECTIONS = ("core", "disagg", "queues", "memory", "all")  # SGLang's; the core fields are all served here


async def loads(request: Request, include: str | None = None) -> Response:
    """SGLang's `GET /v1/loads?include=core,queues`: one entry (this engine) with its running and waiting
    requests and KV-token use, the fields slime sums to see a server idle and sgl-model-gateway polls
    (with `include=core,disagg,queues,memory`; a section without fields here is simply empty)."""
    unknown = [name for name in (include or "core").split(",") if name.strip() not in LOAD_SECTIONS]
    if unknown:
        raise APIError(400, f"include: unknown sections {unknown}; known: {list(LOAD_SECTIONS)}", "include")
    server: ServerState = request.app.state.server
    stats = await server.engine.get_engine_stats()
    block_size = server.engine.config.block_size
    total = stats.num_kv_blocks * block_size
    used = (stats.num_kv_blocks - stats.num_free_kv_blocks) * block_size
    load = {
        "dp_rank": 0,
        "num_running_reqs": stats.num_running,
        "num_waiting_reqs": stats.num_waiting,
        "num_total_reqs": stats.num_running + stats.num_waiting,
        "num_used_tokens": used,
        "num_total_tokens": total,
        "max_total_num_tokens": total,
        "max_running_requests": server.engine.config.max_num_seqs,
        "token_usage": used / total if total else 0.0,
    }
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    return JSONBytesResponse({"timestamp": now, "version": VERSION, "dp_rank_count": 1, "loads": [load]})


async def get_load(request: Request) -> Response:
    """SGLang's `GET /get_load`: per data-parallel rank (one here), its requests (running and waiting),
    those waiting, and the KV tokens in use; a gateway's load is the sum of `num_tokens`."""
    server: ServerState = request.app.state.server
    stats = await server.engine.get_engine_stats()
    used = (stats.num_kv_blocks - stats.num_free_kv_blocks) * server.engine.config.block_size
    return JSONBytesResponse([{"dp_rank": 0, "num_reqs": stats.num_running + stats.num_waiting,
                               "num_waiting_reqs": stats.num_waiting, "num_tokens": used}])


async def model_info(request: Request) -> Response:
    """SGLang's model facts: the name requests give (a gateway's model id), generation only."""
    server: ServerState = request.app.state.server
    return JSONBytesResponse({"model_path": server.served_model_name, "tokenizer_path": None,
                              "is_generation": True, "preferred_sampling_params": None,
                              "weight_version": None, "model_type": None, "architectures": None})


async def server_info(request: Request) -> Response:
    """SGLang's server facts, those a gateway reads: the served name, the batch and KV limits."""
    server: ServerState = request.app.state.server
    config, facts = server.engine.config, server.facts
    return JSONBytesResponse({
        "served_model_name": server.served_model_name,
        "model_path": server.served_model_name,
        "version": VERSION,
        "dp_size": 1,
        "tp_size": config.tensor_parallel_size,
        "max_running_requests": config.max_num_seqs,
        "max_total_num_tokens": facts.num_kv_blocks * facts.block_size,
        "context_length": facts.max_model_len,
        "page_size": facts.block_size,
    })
