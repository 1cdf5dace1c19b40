"""One pooling route's engine requests (frontend process, HTTP server): its inputs to token ids (OpenAI's
forms, truncated as the body asks: -1 keeps the whole context, a pooling prompt needing no room to
generate), one `AsyncLLM.generate` stream a prompt carrying its PoolingParams, under the admission's bound,
each prompt's vector back or a 400 naming the body's field; the usage; a vector as JSON floats or base64.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np

from coreserve.frontend.pooling_verbs import pooling_sampling_params
from coreserve.frontend.server.common.errors import APIError, bad_request_from_value_error
from coreserve.frontend.server.common.generation import PromptInput
from coreserve.frontend.server.common.inputs import as_bad_request, tokenize
from coreserve.frontend.server.common.transport import until_disconnected
from coreserve.frontend.server.pooling.schemas import Input, PoolingBody
from coreserve.protocol.pooling_params import PoolingParams
from coreserve.protocol.request_rules import RequestLimits, check_prompt


async def pooling_inputs(server, value: Input, add_special_tokens: bool, truncate: int | None,
                         param: str = "input") -> list[PromptInput]:
    """A text, texts, token ids or lists of token ids: each one prompt, checked against the context."""
    items = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else list(value)
    if not items:
        raise APIError(400, f"{param} must not be empty", param)
    prompts = []
    for item in items:
        if isinstance(item, str):
            token_ids = await tokenize(server, item, add_special_tokens, None, param)
            prompts.append(PromptInput(item, _truncated(token_ids, truncate, server.facts.max_model_len)))
        else:
            prompts.append(PromptInput(None, _truncated(list(item), truncate, server.facts.max_model_len)))
    limits = RequestLimits.of(server.facts)
    for prompt in prompts:
        with as_bad_request():
            check_prompt(prompt.token_ids, limits, param, is_pooling=True)
    return prompts


def _truncated(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    if keep is None:
        return token_ids
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens must be at least 1, or -1", "truncate_prompt_tokens")
    return token_ids[-(max_model_len if keep == -1 else keep):]


def pooling_params(body: PoolingBody, dimensions: int | None = None) -> PoolingParams:
    try:
        return PoolingParams(use_activation=body.use_activation, dimensions=dimensions)
    except ValueError as exc:
        raise APIError(400, str(exc), "dimensions" if dimensions is not None else None) from exc


async def pool(request, server, body: PoolingBody, prompts: list[PromptInput], params: PoolingParams, task: str,
               answer) -> object:
    """Each prompt's vector ([size] float32), handed to `answer(vectors)` for the response; the engine's
    refusal a 400 naming the body's field; a client that leaves aborts them all."""
    server.check_model(body.model)  # a 404 for a name not served (no adapters on a pooling request)
    return await until_disconnected(request, _pool(server, body, prompts, params, task, answer))


async def _pool(server, body: PoolingBody, prompts: list[PromptInput], params: PoolingParams, task: str, answer):
    request_id = body.request_id or server.new_request_id(task)
    sampling = pooling_sampling_params(params, task)
    server.admission.admit(len(prompts))
    streams = [server.engine.generate(p.token_ids, sampling, f"{request_id}-{i}") for i, p in enumerate(prompts)]
    tasks = [asyncio.ensure_future(_vector(stream)) for stream in streams]
    try:
        vectors = await asyncio.gather(*tasks)
    except ValueError as exc:
        raise bad_request_from_value_error(exc, frozenset(type(body).model_fields)) from exc
    finally:  # a refusal, an error or a client gone: the others end too, their requests aborted
        server.admission.release(len(prompts))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
    return answer(vectors)


async def _vector(stream) -> np.ndarray:
    last = None
    async for output in stream:
        last = output
    return last.outputs.data


def usage(prompts: list[PromptInput]) -> dict:
    """vLLM's UsageInfo of a pooling answer: every token a prompt token."""
    num_prompt = sum(len(p.token_ids) for p in prompts)
    return {"prompt_tokens": num_prompt, "total_tokens": num_prompt, "completion_tokens": 0,
            "prompt_tokens_details": None}


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: floats, or base64 of the float32 little-endian bytes (what its client decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.tolist()
