"""The probability of label tokens after a query and an item, as graders and rerankers ask for it
(frontend process, HTTP server): SGLang's `POST /v1/score` and vLLM's `POST /generative_scoring`.

Each item is one engine request: its prompt (the query and the item, combined as each server does) and
one placeholder token after it, with the labels as `prompt_logprob_token_ids`; the placeholder's row is
the distribution after the prompt, so each label's logprob is the full vocabulary's log-softmax of the
raw logits there, the bits a prompt-logprob request returns at that position. One token is generated
and dropped. The scores are computed from those logprobs in float64: exp(logprob), or with
`apply_softmax` the softmax over the labels' logprobs (the vocabulary's normaliser cancels).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Annotated

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from coreserve.frontend.server.common.errors import APIError
from coreserve.frontend.server.common.fields import Int64, StrictBody
from coreserve.frontend.server.common.generation import Generation, PromptInput
from coreserve.frontend.server.common.inputs import check_prompts, collect_prompt_logprobs, tokenize
from coreserve.frontend.server.common.logprob_json import JSONBytesResponse
from coreserve.frontend.server.common.sampling import build_sampling_params, field_refusal
from coreserve.frontend.server.common.transport import until_disconnected
from coreserve.frontend.server.state import ServerState
from coreserve.protocol.sampling_params import MAX_PROMPT_CANDIDATES, LoraRef

SGLANG_SCORE_PATH = "/v1/score"
VLLM_SCORE_PATH = "/generative_scoring"

Ids = list[Int64]


class SglangScoreRequest(StrictBody):
    """SGLang's ScoringRequest: texts are joined and tokenized together, ids are concatenated."""

    query: str | Ids | None = None
    items: str | list[str] | list[Ids] | None = None
    label_token_ids: Ids | None = None
    apply_softmax: bool = False
    item_first: bool = False
    model: str | None = None


class VllmScoreRequest(StrictBody):
    """vLLM's GenerativeScoringRequest: the query tokenized (with `add_special_tokens`), each item
    without special tokens, the ids concatenated; the score is the first label's."""

    query: str | Ids
    items: list[str] | list[Ids]
    label_token_ids: Ids
    apply_softmax: bool = True
    item_first: bool = False
    add_special_tokens: bool = True
    priority: Annotated[int, Field(ge=0, le=0)] = 0  # no priorities here: only the default
    request_id: str | None = None
    model: str | None = None


async def sglang_score(request: Request, body: SglangScoreRequest) -> Response:
    server: ServerState = request.app.state.server
    lora = server.check_model(body.model)
    if body.items is None:
        raise APIError(400, "items must be provided", "items")
    items = [body.items] if isinstance(body.items, str) else body.items
    if body.label_token_ids is None:
        raise APIError(
            400,
            "label_token_ids must be provided (the tokens whose probability is scored)",
            "label_token_ids",
        )
    if not items:
        return JSONBytesResponse(
            {"scores": [], "model": server.answer_name(lora), "usage": None, "object": "scoring"}
        )
    query = body.query if body.query is not None else ("" if isinstance(items[0], str) else [])
    prompts = []
    for item in items:
        if isinstance(query, str) != isinstance(item, str):
            raise APIError(400, "query and items must both be text or both be token ids", "items")
        if isinstance(item, str):
            text = item + query if body.item_first else query + item
            prompts.append(PromptInput(text, await tokenize(server, text, True, None, "items")))
        else:
            prompts.append(
                PromptInput(None, list(item) + list(query) if body.item_first else list(query) + list(item))
            )

    def answer(logprobs: list[list[float]]) -> dict:
        scores = [_scores(row, body.apply_softmax) for row in logprobs]
        return {
            "scores": scores,
            "model": server.answer_name(lora),
            "usage": _usage(prompts),
            "object": "scoring",
        }

    return await _score(request, server, prompts, body, answer, lora)


async def vllm_generative_scoring(request: Request, body: VllmScoreRequest) -> Response:
    server: ServerState = request.app.state.server
    lora = server.check_model(body.model)
    if not body.items:
        raise APIError(400, "items must contain at least one item.", "items")
    if isinstance(body.query, str):
        query = await tokenize(server, body.query, body.add_special_tokens, None, "query")
    else:
        query = list(body.query)
    prompts = []
    for item in body.items:
        item_ids = await tokenize(server, item, False, None, "items") if isinstance(item, str) else list(item)
        prompts.append(PromptInput(None, item_ids + query if body.item_first else query + item_ids))
    request_id = body.request_id or server.new_request_id("generative-scoring")

    def answer(logprobs: list[list[float]]) -> dict:
        data = [
            {"index": i, "object": "score", "score": _scores(row, body.apply_softmax)[0]}
            for i, row in enumerate(logprobs)
        ]
        return {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": server.answer_name(lora),
            "data": data,
            "usage": _usage(prompts),
        }

    return await _score(request, server, prompts, body, answer, lora)


async def _score(
    request: Request,
    server: ServerState,
    prompts: list[PromptInput],
    body: SglangScoreRequest | VllmScoreRequest,
    answer: Callable[[list[list[float]]], dict],
    lora: LoraRef | None = None,
) -> Response:
    """Scores each prompt's labels (their logprobs as the next token) and answers `answer(logprobs)`;
    `lora`: the adapter the request's "model" names."""
    labels = body.label_token_ids
    if not labels:
        raise APIError(400, "label_token_ids must not be empty", "label_token_ids")
    if len(set(labels)) > MAX_PROMPT_CANDIDATES:
        raise APIError(
            400, f"label_token_ids: at most {MAX_PROMPT_CANDIDATES} distinct ids", "label_token_ids"
        )
    vocab_size = server.facts.vocab_size
    for label in labels:
        if not 0 <= label < vocab_size:
            raise APIError(
                400, f"Token ID {label} is out of vocabulary (vocab size: {vocab_size})", "label_token_ids"
            )
    for i, prompt in enumerate(prompts):
        if not prompt.token_ids:
            raise APIError(400, f"item {i}: the query and the item make an empty prompt", "items")
    scored = [PromptInput(None, p.token_ids + [labels[0]]) for p in prompts]  # the placeholder token
    check_prompts(scored, server.facts, 1, "items")
    fields = {"max_tokens": 1, "prompt_logprobs": 0, "prompt_logprob_token_ids": sorted(set(labels))}
    params = build_sampling_params(fields, field_refusal("label_token_ids"))
    generation = Generation(
        server.engine, server.new_request_id("score"), scored, params, server.metrics, server.admission, lora
    )
    return await until_disconnected(request, _collect(generation, body, labels, answer))


async def _collect(
    generation: Generation, body: StrictBody, labels: list[int], answer: Callable[[list[list[float]]], dict]
) -> Response:
    positions = await collect_prompt_logprobs(generation, body)
    # each prompt's last row, the placeholder's: the distribution after the prompt
    rows = [[p[-1][label].logprob for label in labels] for p in positions]
    return JSONBytesResponse(answer(rows))


def _scores(logprobs: list[float], apply_softmax: bool) -> list[float]:
    if not apply_softmax:
        return [math.exp(lp) for lp in logprobs]
    top = max(logprobs)
    if top == -math.inf:
        return [1.0 / len(logprobs)] * len(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


def _usage(prompts: list[PromptInput]) -> dict:
    num_prompt = sum(len(p.token_ids) for p in prompts)
    return {"prompt_tokens": num_prompt, "completion_tokens": 0, "total_tokens": num_prompt}
