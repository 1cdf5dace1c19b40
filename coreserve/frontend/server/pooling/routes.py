"""Which routes a server answers by its runner (frontend process, HTTP server): a pooling server (--runner
pooling) answers the pooling routes and refuses each generation route by name, a generating server the
reverse; `/v1/score` is both's, by its body (coreserve/frontend/server/pooling/score.py).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from coreserve.frontend.server.common.errors import APIError
from coreserve.frontend.server.pooling.embeddings import (
    create_classification,
    create_embedding,
    create_pooling,
)
from coreserve.frontend.server.pooling.score import create_rerank, create_score, score_v1
from coreserve.frontend.server.scoring.label_scores import SGLANG_SCORE_PATH
from coreserve.frontend.server.state import ServerState

POOLING_ROUTES = {
    "/v1/embeddings": create_embedding,
    "/pooling": create_pooling,
    "/classify": create_classification,
    "/score": create_score,
    "/rerank": create_rerank,
    "/v1/rerank": create_rerank,
    "/v2/rerank": create_rerank,
}
POOLING_PATHS = frozenset(POOLING_ROUTES)
_SERVED = "/v1/embeddings, /pooling, /classify, /score (/v1/score) and /rerank"


def add_pooling_routes(app: FastAPI, server: ServerState) -> None:
    """The pooling routes (refused on a generating server) and /v1/score."""
    is_pooling = server.facts.runner == "pooling"
    for path, handler in POOLING_ROUTES.items():
        refused = _refusal(f"{path} needs a pooling model (--runner pooling); this server generates")
        app.post(path)(handler if is_pooling else refused)
    app.post(SGLANG_SCORE_PATH)(score_v1)  # /v1/score: SGLang's body or vLLM's, by the body


def for_generation(server: ServerState, path: str, handler: Callable) -> Callable:
    """`handler` on a generating server; on a pooling one, a 400 naming the route and what is served."""
    if server.facts.runner != "pooling":
        return handler
    return _refusal(f"{path} generates, and this server runs a pooling model (--runner pooling): it serves {_SERVED}")


def _refusal(message: str) -> Callable:
    async def refuse(request: Request) -> Response:
        raise APIError(400, message, None, "model_not_supported")

    return refuse
