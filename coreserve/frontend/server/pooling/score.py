"""vLLM's pooling `POST /score` and `POST /rerank` (`/v1/rerank`, `/v2/rerank`) on a pooling server, and the
one `POST /v1/score` that serves both it and SGLang's label scoring (frontend process, HTTP server).

An embedding model scores a pair by the cosine of the two embeddings; a cross-encoder (a classifier of one
label) by its probability of the two texts tokenized together. `/v1/score` is vLLM's pooling score where the
body names `text_1` or `text_2` (and the server pools), SGLang's label scoring (coreserve/frontend/server/
scoring/label_scores.py) otherwise (and the server generates): the two bodies share no required field, and
each kind of server refuses the other's body by name.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from coreserve.frontend.pooling_verbs import cosine
from coreserve.frontend.server.common.errors import APIError
from coreserve.frontend.server.common.generation import PromptInput
from coreserve.frontend.server.common.logprob_json import JSONBytesResponse
from coreserve.frontend.server.pooling.runs import pool, pooling_inputs, pooling_params, usage
from coreserve.frontend.server.pooling.schemas import PoolingBody, RerankRequest, ScoreRequest
from coreserve.frontend.server.scoring.label_scores import SglangScoreRequest, sglang_score
from coreserve.frontend.server.state import ServerState

POOLING_SCORE_FIELDS = frozenset({"text_1", "text_2"})


async def create_score(request: Request, body: ScoreRequest) -> Response:
    server: ServerState = request.app.state.server
    firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not seconds or len(firsts) not in (1, len(seconds)):
        raise APIError(400, f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as "
                       "many as text_2 (pair by pair)", "text_1")

    def answer(scores: list[float], prompts: list[PromptInput]) -> Response:
        data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
        return JSONBytesResponse({"id": server.new_request_id("score"), "object": "list", "created": int(time.time()),
                                  "model": server.served_model_name, "data": data, "usage": usage(prompts)})

    return await _scored(request, server, body, firsts, seconds, answer)


async def create_rerank(request: Request, body: RerankRequest) -> Response:
    server: ServerState = request.app.state.server
    if not body.documents:
        raise APIError(400, "documents must not be empty", "documents")

    def answer(scores: list[float], prompts: list[PromptInput]) -> Response:
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
        results = [{"index": i, "document": {"text": body.documents[i]}, "relevance_score": scores[i]} for i in order]
        return JSONBytesResponse({"id": server.new_request_id("rerank"), "model": server.served_model_name,
                                  "usage": {"total_tokens": usage(prompts)["total_tokens"]}, "results": results})

    return await _scored(request, server, body, [body.query], body.documents, answer)


async def _scored(request: Request, server: ServerState, body: PoolingBody, firsts: list[str], seconds: list[str],
                  answer) -> Response:
    """Each pair's score (one first text against every second, or pair by pair), then `answer(scores,
    prompts)`: an embedding model's cosine, a cross-encoder's probability."""
    facts = server.facts.pooling
    if facts.tasks == ["embed"]:
        prompts = await pooling_inputs(server, [*firsts, *seconds], True, body.truncate_prompt_tokens, "text_1")

        def cosines(vectors: list[np.ndarray]) -> Response:
            left, right = vectors[: len(firsts)], vectors[len(firsts) :]
            pairs = zip(left * len(right) if len(left) == 1 else left, right)
            return answer([cosine(a, b) for a, b in pairs], prompts)

        return await pool(request, server, body, prompts, pooling_params(body), "embed", cosines)
    if facts.output_size != 1:
        raise APIError(400, f"score and rerank need an embedding model or a cross-encoder (a classifier of one "
                       f"label); this classifier has {facts.output_size} labels: use /classify", "model")
    firsts = firsts * len(seconds) if len(firsts) == 1 else firsts
    tokenizer = server.tokenizer
    pairs = await asyncio.to_thread(lambda: [tokenizer(a, text_pair=b).input_ids for a, b in zip(firsts, seconds)])
    prompts = await pooling_inputs(server, [list(p) for p in pairs], False, body.truncate_prompt_tokens, "text_2")
    return await pool(request, server, body, prompts, pooling_params(body), "classify",
                      lambda vectors: answer([float(v[0]) for v in vectors], prompts))


async def score_v1(request: Request) -> Response:
    """`/v1/score`: vLLM's pooling score (text_1, text_2) on a pooling server, SGLang's label scoring on a
    generating one; each refuses the other's body by name."""
    server: ServerState = request.app.state.server
    raw = await request.body()
    try:
        fields = json.loads(raw)
    except ValueError:
        fields = None
    is_pooling_server = server.facts.runner == "pooling"
    if not isinstance(fields, dict):  # not a JSON object: the server's own body model says what is wrong
        _validated(ScoreRequest if is_pooling_server else SglangScoreRequest, raw)
    is_pooling_body = bool(POOLING_SCORE_FIELDS & fields.keys())
    if is_pooling_body and not is_pooling_server:
        raise APIError(400, "vLLM's pooling score (text_1, text_2) needs a pooling model (--runner pooling); this "
                       "server generates: its /v1/score is SGLang's label scoring (query, items, label_token_ids)",
                       "text_1")
    if is_pooling_server and not is_pooling_body:
        raise APIError(400, "SGLang's label scoring (query, items, label_token_ids) needs a generation model; this "
                       "server pools: its /v1/score is vLLM's pooling score (text_1, text_2)", "items")
    if is_pooling_body:
        return await create_score(request, _validated(ScoreRequest, raw))
    return await sglang_score(request, _validated(SglangScoreRequest, raw))


def _validated(model: type[BaseModel], raw: bytes):
    """The body as `model`, its errors the 400 FastAPI's own validation gives."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
