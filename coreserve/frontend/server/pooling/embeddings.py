"""`POST /v1/embeddings` (OpenAI's, what the openai client's `embeddings.create` calls), `POST /pooling` and
`POST /classify` (vLLM's) on a pooling server (frontend process, HTTP server): each input one request, its
vector as floats or base64 (`encoding_format`), a classifier's probabilities with the top label's name.
"""

from __future__ import annotations

import time

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from coreserve.frontend.server.common.logprob_json import JSONBytesResponse
from coreserve.frontend.server.pooling.runs import encoded, pool, pooling_inputs, pooling_params, usage
from coreserve.frontend.server.pooling.schemas import ClassificationRequest, EmbeddingRequest, PoolingRequest
from coreserve.frontend.server.state import ServerState


async def create_embedding(request: Request, body: EmbeddingRequest) -> Response:
    server: ServerState = request.app.state.server
    prompts = await pooling_inputs(server, body.input, body.add_special_tokens, body.truncate_prompt_tokens)

    def answer(vectors: list[np.ndarray]) -> Response:
        data = [{"index": i, "object": "embedding", "embedding": encoded(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        return _listed(server, "embd", data, usage(prompts))

    return await pool(request, server, body, prompts, pooling_params(body, body.dimensions), "embed", answer)


async def create_pooling(request: Request, body: PoolingRequest) -> Response:
    server: ServerState = request.app.state.server
    prompts = await pooling_inputs(server, body.input, body.add_special_tokens, body.truncate_prompt_tokens)
    task = body.task or server.facts.pooling.tasks[0]

    def answer(vectors: list[np.ndarray]) -> Response:
        data = [{"index": i, "object": "pooling", "data": encoded(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        return _listed(server, "pool", data, usage(prompts))

    return await pool(request, server, body, prompts, pooling_params(body, body.dimensions), task, answer)


async def create_classification(request: Request, body: ClassificationRequest) -> Response:
    server: ServerState = request.app.state.server
    prompts = await pooling_inputs(server, body.input, body.add_special_tokens, body.truncate_prompt_tokens)
    labels = server.facts.pooling.labels

    def answer(vectors: list[np.ndarray]) -> Response:
        data = [{"index": i, "label": labels[int(np.argmax(v))] if labels else None, "probs": v.tolist(),
                 "num_classes": len(v)} for i, v in enumerate(vectors)]
        return _listed(server, "classify", data, usage(prompts))

    return await pool(request, server, body, prompts, pooling_params(body), "classify", answer)


def _listed(server: ServerState, prefix: str, data: list[dict], used: dict) -> Response:
    """vLLM's list answer: {id, object "list", created, model, data, usage}."""
    return JSONBytesResponse({"id": server.new_request_id(prefix), "object": "list", "created": int(time.time()),
                              "model": server.served_model_name, "data": data, "usage": used})
