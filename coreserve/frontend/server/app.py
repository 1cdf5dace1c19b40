"""The FastAPI application of one server: its routes, API-key check and error handlers (frontend
process, HTTP server). `build_app(ServerState)` makes it; nothing is global, so tests may build several.
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from coreserve.frontend.errors import EngineDeadError
from coreserve.frontend.server.common.errors import APIError, error_response, install_error_handlers
from coreserve.frontend.server.common.limits import BodyLimitMiddleware
from coreserve.frontend.server.common.logprob_json import JSONBytesResponse, token_text
from coreserve.frontend.server.deploy.drain import DrainMiddleware
from coreserve.frontend.server.deploy.router_probes import probe_router
from coreserve.frontend.server.lora import adapter_models, load_lora_adapter, unload_lora_adapter
from coreserve.frontend.server.openai.chat import create_chat_completion
from coreserve.frontend.server.openai.chat_prompt import render_messages
from coreserve.frontend.server.openai.completions import create_completion
from coreserve.frontend.server.openai.responses import create_response
from coreserve.frontend.server.openai.schemas import DetokenizeRequest, TokenizeRequest
from coreserve.frontend.server.pooling.routes import POOLING_PATHS, add_pooling_routes, for_generation
from coreserve.frontend.server.rl.control import RL_PATHS, rl_router
from coreserve.frontend.server.rl.inference_generate import INFERENCE_GENERATE_PATH, inference_generate
from coreserve.frontend.server.rl.token_generate import GENERATE_PATH, abort_request, generate
from coreserve.frontend.server.scoring.label_scores import VLLM_SCORE_PATH, vllm_generative_scoring
from coreserve.frontend.server.scoring.sequence_logprobs import SEQUENCE_LOGPROBS_PATH, get_sequence_logprobs
from coreserve.frontend.server.state import ServerState

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def build_app(server: ServerState, lifespan=None) -> FastAPI:
    """`lifespan`: the owner's startup and shutdown around serving (launch shuts the engine down in it)."""
    app = FastAPI(
        title="coreserve",
        docs_url=None,
        redoc_url=None,
        default_response_class=JSONBytesResponse,
        lifespan=lifespan,
    )
    app.state.server = server
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=server.max_request_bytes)
    if server.api_key:  # added last, so it runs first: a bad key is refused before the body is read
        rl_paths = (
            RL_PATHS | {GENERATE_PATH, "/abort_request", SEQUENCE_LOGPROBS_PATH}
            if server.enable_rl_endpoints
            else frozenset()
        ) | {INFERENCE_GENERATE_PATH, VLLM_SCORE_PATH} | POOLING_PATHS
        app.add_middleware(APIKeyMiddleware, api_key=server.api_key, extra_paths=rl_paths)
    app.add_middleware(DrainMiddleware, drain=server.drain)  # outermost: counts and refuses every request
    app.post("/v1/completions")(for_generation(server, "/v1/completions", create_completion))
    app.post("/v1/chat/completions")(for_generation(server, "/v1/chat/completions", create_chat_completion))
    app.post("/v1/responses")(for_generation(server, "/v1/responses", create_response))
    app.get("/v1/models")(list_models)
    app.get("/health")(health)
    app.get("/metrics")(metrics)
    app.post("/tokenize")(tokenize)
    app.post("/detokenize")(detokenize)
    app.get("/tokenizer_info")(tokenizer_info)
    app.include_router(probe_router())  # what routers and gateways read: /ready, /version, loads, info
    # vLLM's tokens in, tokens out (prime-rl)
    app.post(INFERENCE_GENERATE_PATH)(for_generation(server, INFERENCE_GENERATE_PATH, inference_generate))
    app.post(VLLM_SCORE_PATH)(for_generation(server, VLLM_SCORE_PATH, vllm_generative_scoring))
    # the pooling routes (pooling/routes.py; refused on a generating server), and /v1/score: SGLang's label
    # scoring (scoring/label_scores.py) or vLLM's pooling score, by the body
    add_pooling_routes(app, server)
    if server.enable_lora:  # vLLM's runtime adapter routes (coreserve/frontend/server/lora.py)
        app.post("/v1/load_lora_adapter")(load_lora_adapter)
        app.post("/v1/unload_lora_adapter")(unload_lora_adapter)
    if server.enable_rl_endpoints:  # off by default: without the flag these paths are a 404
        app.include_router(rl_router())
        app.post(GENERATE_PATH)(for_generation(server, GENERATE_PATH, generate))  # token ids in and out (rl/token_generate.py)
        app.post("/abort_request")(abort_request)  # SGLang's, for /generate requests
        logprobs = for_generation(server, SEQUENCE_LOGPROBS_PATH, get_sequence_logprobs)  # TRL's scoring
        app.post(SEQUENCE_LOGPROBS_PATH + "/")(logprobs)  # (scoring/sequence_logprobs.py)
        app.post(SEQUENCE_LOGPROBS_PATH)(logprobs)
    return app


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` on every /v1 route and on `extra_paths` (the RL control endpoints);
    as vLLM, /health, /metrics, /tokenize, /detokenize and /tokenizer_info stay open."""

    def __init__(self, app: ASGIApp, api_key: str, extra_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.extra_paths = extra_paths

    def is_protected(self, path: str) -> bool:
        return path.startswith("/v1") or path.rstrip("/") in self.extra_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.is_protected(scope["path"]) and scope["method"] != "OPTIONS":
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):
                message = (
                    "Incorrect API key provided."
                    if given
                    else "Missing API key: send Authorization: Bearer KEY."
                )
                await error_response(401, message, code="invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def list_models(request: Request) -> Response:
    server: ServerState = request.app.state.server
    model = {
        "id": server.served_model_name,
        "object": "model",
        "created": server.started_at,
        "owned_by": "coreserve",
        "root": server.engine.config.model,
        "parent": None,  # vLLM's: an adapter's names its base model
        "max_model_len": server.facts.max_model_len,
    }
    return JSONBytesResponse({"object": "list", "data": [model, *adapter_models(server)]})


async def health(request: Request) -> Response:
    engine = request.app.state.server.engine
    if engine.is_dead:
        return error_response(503, f"the engine is not running: {engine.dead_reason}", code="engine_dead")
    return Response(status_code=200)


async def metrics(request: Request) -> Response:
    server: ServerState = request.app.state.server
    try:
        text = await server.metrics.render(server.engine)
    except EngineDeadError:  # counters and histograms stay readable; the core's gauges keep their last values
        text = server.metrics.render_local()
    return Response(text, media_type=PROMETHEUS_TEXT)


async def tokenize(request: Request, body: TokenizeRequest) -> Response:
    """vLLM's shape: {"prompt"} or {"messages"} in; {"count", "max_model_len", "tokens", "token_strs"} out."""
    server: ServerState = request.app.state.server
    server.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "prompt")
    text, add_special_tokens = body.prompt, body.add_special_tokens
    if body.messages is not None:  # rendered as chat renders it; the template writes the special tokens
        text = await render_messages(server, [m.model_dump(exclude_none=True) for m in body.messages], body)
        add_special_tokens = False
    tokenizer = server.tokenizer  # off the event loop: any length is counted
    token_ids = await asyncio.to_thread(lambda: tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    strs = [token_text(server.table.decode_token(t)) for t in token_ids] if body.return_token_strs else None
    return JSONBytesResponse(
        {
            "count": len(token_ids),
            "max_model_len": server.facts.max_model_len,
            "tokens": list(token_ids),
            "token_strs": strs,
        }
    )


async def tokenizer_info(request: Request) -> Response:
    """vLLM's /tokenizer_info, the shape lm-eval's RemoteTokenizer reads (its special tokens as text, the
    chat template it renders itself), so a client needs no local tokenizer."""
    server: ServerState = request.app.state.server
    tokenizer = server.tokenizer
    special = {key: getattr(tokenizer, key, None) for key in ("eos_token", "bos_token", "pad_token", "unk_token")}
    return JSONBytesResponse({
        "tokenizer_class": type(tokenizer).__name__,
        **{key: value if isinstance(value, str) else None for key, value in special.items()},
        "chat_template": server.renderer.template,
        "model_max_length": server.facts.max_model_len,
        "vocab_size": server.facts.vocab_size,
    })


async def detokenize(request: Request, body: DetokenizeRequest) -> Response:
    server: ServerState = request.app.state.server
    server.check_model(body.model)
    vocab_size = server.facts.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(
            400, f"tokens: token id {bad} is out of vocabulary (valid ids are 0..{vocab_size - 1})", "tokens"
        )
    return JSONBytesResponse({"prompt": server.tokenizer.decode(body.tokens)})
