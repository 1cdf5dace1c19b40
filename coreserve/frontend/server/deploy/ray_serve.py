"""coreserve as a Ray Serve application (the optional extra `ray`; frontend process, inside Ray actors).

    from coreserve.frontend.server.deploy.ray_serve import build_ray_app
    serve.run(build_ray_app("path/to/model", num_replicas=2, engine_args={"num_threads": 1}))

Two deployments. `CoreserveReplica`: one coreserve engine a replica (its own engine-core process),
serving the OpenAI routes of `coreserve serve` in process (the same FastAPI app, reached through an
ASGI transport: the same fields, checks, errors and numbers). Ray Serve picks the replica of each
request; with `prefix_affinity` (the default) its `PrefixCacheAffinityRouter` (Ray Serve LLM's) sends
requests that share a prompt prefix to the replica that cached it. `CoreserveIngress`: the HTTP routes
`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`, and the RL control verbs fanned
out to every replica: `/update_weights` (all or none, below), `/pause`, `/resume`, `/sleep`,
`/wake_up`, `/reset_prefix_cache`, `/get_weight_version` (each replica's).

Why not Ray Serve LLM's `LLMConfig(server_cls=...)`: its OpenAI models import vLLM's or SGLang's
protocol classes, so `ray.serve.llm` does not import without one of those engines installed; this
application needs `ray[serve]` alone. Its routing is Ray Serve's own (no coreserve router).

**One weight version across replicas.** `/update_weights` (`{"model_path"}`, SGLang's name) runs the
several-daemon frontend's policy (`update_all_or_none`, coreserve/frontend/clients/multi_core_control.py): every
replica checks the checkpoint at once (names and shapes, nothing copied), and only when every replica
accepts does every replica take it; a refusal anywhere changes no replica and fails naming it. Should
a replica fail after every check passed (its disk, say) while others took the update, the call fails
naming which took it: the replicas serve different weights until the next update.

Streaming (`stream: true`) is refused by name here (the replica call returns whole responses); serve
streams from `coreserve serve` behind a router instead (docs/serving.md). Ray's actor calls carry
their arguments with Ray's own serialization; the payloads coreserve passes are JSON-shaped dicts.
"""


import asyncio
import os
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse

from coreserve.frontend.clients.multi_core_control import update_all_or_none
from coreserve.frontend.server.common.errors import error_response

PREFIX_ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"


@dataclass
class RoutedCompletion:
    """A completions request on its way to a replica; `prompt` is what the prefix router reads."""

    path: str
    body: dict
    prompt: str | list | None = None


@dataclass
class RoutedChat:
    """A chat request on its way to a replica; `messages` is what the prefix router reads."""

    path: str
    body: dict
    messages: list | None = None


@dataclass
class ReplicaAnswer:
    status: int
    body: dict = field(default_factory=dict)


@serve.deployment
class CoreserveReplica:
    def __init__(self, model: str, engine_args: dict, served_model_name: str) -> None:
        from coreserve.frontend.async_llm import AsyncLLM
        from coreserve.frontend.server.app import build_app
        from coreserve.frontend.server.state import ServerState

        self.engine = AsyncLLM(model, **engine_args)
        self.state = ServerState(self.engine, served_model_name)
        transport = httpx.ASGITransport(app=build_app(self.state))
        self.client = httpx.AsyncClient(transport=transport, base_url="http://replica", timeout=None)

    async def __call__(self, request: RoutedCompletion | RoutedChat) -> ReplicaAnswer:
        response = await self.client.post(request.path, json=request.body)
        return ReplicaAnswer(response.status_code, response.json())

    async def models(self) -> dict:
        return (await self.client.get("/v1/models")).json()

    async def weight_version(self) -> int:
        return (await self.engine.control_state()).weight_version

    async def check_weights(self, path: str) -> dict:
        """{} or {"error": why this replica would refuse `path`}; nothing copied."""
        try:
            await self.engine.check_weights(path)
            return {}
        except (ValueError, OSError) as exc:
            return {"error": str(exc)}

    async def try_update_weights(self, path: str) -> dict:
        """{"weight_version": the new one} or {"error": why this replica refused (its weights kept)}."""
        try:
            return {"weight_version": await self.engine.update_weights(path)}
        except (ValueError, OSError) as exc:
            return {"error": str(exc)}

    # The control verbs, one plain method each, named as the ingress's routes (CONTROL_ROUTES)
    async def pause(self, kwargs: dict) -> None:
        await self.engine.pause_generation(**kwargs)

    async def resume(self, kwargs: dict) -> None:
        await self.engine.resume_generation(**kwargs)

    async def sleep(self, kwargs: dict) -> None:
        await self.engine.sleep(**kwargs)

    async def wake_up(self, kwargs: dict) -> None:
        await self.engine.wake_up(**kwargs)

    async def reset_prefix_cache(self, kwargs: dict) -> None:
        await self.engine.reset_prefix_cache(**kwargs)

    def check_health(self) -> None:
        if self.engine.is_dead:
            raise RuntimeError("the engine is not running")


app = FastAPI(title="coreserve on Ray Serve", docs_url=None, redoc_url=None)
# Routes fanned out to every replica, each to the replica's method of the same name
CONTROL_ROUTES = frozenset(("pause", "resume", "sleep", "wake_up", "reset_prefix_cache"))


@serve.deployment
@serve.ingress(app)
class CoreserveIngress:
    def __init__(self, replicas: DeploymentHandle, model: str) -> None:
        self.replicas = replicas
        self.checkpoint = model  # the weights every replica holds: the model, then the last update's
        self.lock = asyncio.Lock()

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> JSONResponse:
        return await self._route("/v1/completions", await request.json())

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> JSONResponse:
        return await self._route("/v1/chat/completions", await request.json())

    @app.get("/v1/models")
    async def models(self) -> JSONResponse:
        return JSONResponse(await self.replicas.models.remote())

    @app.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({})

    @app.get("/get_weight_version")
    async def get_weight_version(self) -> JSONResponse:
        versions = await self._each("weight_version")
        return JSONResponse({"weight_version": versions[0] if len(set(versions)) == 1 else None,
                             "replicas": versions})

    @app.post("/update_weights")
    async def update_weights(self, request: Request) -> JSONResponse:
        path = (await request.json()).get("model_path")
        if not isinstance(path, str):
            return error_response(400, "model_path: a checkpoint path (a safetensors file or folder) is required")
        async with self.lock:
            return await self._update_all(path)

    @app.post("/{verb}")
    async def control(self, verb: str, request: Request) -> JSONResponse:
        if verb not in CONTROL_ROUTES:
            return error_response(404, f"/{verb} is not a route of this application")
        kwargs = await request.json() if int(request.headers.get("content-length") or 0) else {}
        done = await self._each(verb, kwargs)
        return JSONResponse({"success": True, "replicas": len(done)})

    async def _route(self, path: str, body: dict) -> JSONResponse:
        if body.get("stream"):
            return error_response(400, "stream: streaming through the Ray Serve application is not built (serve "
                               "`coreserve serve` behind a router to stream)", "stream")
        if path == "/v1/completions":
            routed: RoutedCompletion | RoutedChat = RoutedCompletion(path, body, body.get("prompt"))
        else:
            routed = RoutedChat(path, body, body.get("messages"))
        answer: ReplicaAnswer = await self.replicas.remote(routed)
        return JSONResponse(answer.body, status_code=answer.status)

    async def _each(self, method: str, *args) -> list:
        """The method on every replica, in replica order."""
        return await asyncio.to_thread(self._broadcast, method, *args)

    def _broadcast(self, method: str, *args) -> list:
        """`_each` in the caller's thread (blocks until every replica answered)."""
        from ray.llm._internal.serve.utils.broadcast import broadcast

        return broadcast(self.replicas, method, list(args))

    async def _update_all(self, path: str) -> JSONResponse:
        outcome = await asyncio.to_thread(
            update_all_or_none,
            lambda: self._broadcast("check_weights", path),
            lambda: self._broadcast("try_update_weights", path),
            lambda result: result.get("error"),
        )
        results, refused = outcome.replies, outcome.refused
        if not refused:
            versions = sorted({result["weight_version"] for result in results})
            self.checkpoint = path
            return JSONResponse({"success": True, "weight_version": versions[0] if len(versions) == 1 else None,
                                 "replicas": len(results)})
        index, reason = refused[0], results[refused[0]]["error"]
        if outcome.is_split:
            took = [i for i in range(len(results)) if i not in refused]
            return error_response(400, f"update_weights passed every replica's checks, then replicas {took} took "
                                  f"{path} and {refused} refused it ({reason}): they now serve different weights; "
                                  "update again", "model_path")
        return error_response(400, f"update_weights: replica {index} refused {path} ({reason}); every replica holds "
                           f"{self.checkpoint}", "model_path")


def build_ray_app(
    model: str,
    num_replicas: int = 2,
    engine_args: dict | None = None,
    served_model_name: str | None = None,
    prefix_affinity: bool = True,
    num_cpus: float = 1.0,
):
    """The application: `num_replicas` coreserve engines (`num_cpus` Ray CPUs each) behind one ingress."""
    options: dict = {"num_replicas": num_replicas, "ray_actor_options": {"num_cpus": num_cpus}}
    if prefix_affinity:
        options["request_router_config"] = RequestRouterConfig(request_router_class=PREFIX_ROUTER)
    name = served_model_name or os.path.basename(model.rstrip("/"))
    replicas = CoreserveReplica.options(**options).bind(model, dict(engine_args or {}), name)
    return CoreserveIngress.options(ray_actor_options={"num_cpus": 0}).bind(replicas, model)
