"""POST /inference/v1/generate: vLLM's tokens-in, tokens-out endpoint (its `ServingTokens`), which
prime-rl and SkyRL-style rollouts call (frontend process, HTTP server). Behind the API key.

Request: `token_ids` (one prompt), `sampling_params` (vLLM's `SamplingParams` fields by their names,
coreserve's SamplingParams: a field it does not implement is a 400 naming it), `stream`,
`stream_options`, `request_id`, `model`, `cache_salt` (here or in `sampling_params`, as prime-rl sends
it); `priority`, `kv_transfer_params` and `features` only at their no-op values. Answer: `choices` of
{index, token_ids, finish_reason, logprobs: {content: [{token: "token_id:N", logprob, top_logprobs}]}},
vLLM's `prompt_logprobs`, `usage`, and coreserve's `weight_version`; streamed, each chunk a choice's
new tokens, then usage (with `stream_options.include_usage`) and `[DONE]`. Leaving the connection aborts the request.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from coreserve.frontend.outputs import CompletionOutput
from coreserve.frontend.server.common.accumulate import WholeChoices
from coreserve.frontend.server.common.errors import APIError
from coreserve.frontend.server.common.fields import Int64, StreamOptions, StrictBody, same_json
from coreserve.frontend.server.common.generation import Generation, PromptInput
from coreserve.frontend.server.common.inputs import check_prompts, start_checked
from coreserve.frontend.server.common.logprob_json import (
    JSONBytesResponse,
    token_id_content,
    vllm_prompt_logprobs,
)
from coreserve.frontend.server.common.sampling import SAMPLING_FIELDS, build_sampling_params, field_refusal
from coreserve.frontend.server.common.transport import sse_response, until_disconnected
from coreserve.frontend.server.state import ServerState
from coreserve.protocol.sampling_params import SamplingParams

INFERENCE_GENERATE_PATH = "/inference/v1/generate"
_NO_OP = {"priority": 0, "kv_transfer_params": None, "features": None}
# sampling_params keys of vLLM's server that change nothing here (the answer always holds the token ids;
# one priority), as prime-rl's renderers client sends them (renderers/client.py: return_token_ids)
_NO_OP_SAMPLING = {"return_token_ids": (True, False), "priority": (0,)}


class TokensRequest(StrictBody):
    token_ids: Annotated[list[Int64], Field(min_length=1)]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    request_id: str | None = None
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict | None = None
    features: dict | None = None


async def inference_generate(request: Request, body: TokensRequest) -> Response:
    server: ServerState = request.app.state.server
    lora = server.check_model(body.model)
    for name, no_op in _NO_OP.items():
        if not same_json(getattr(body, name), no_op):
            raise APIError(400, f"{name}: not implemented by this server (only {no_op!r})", name)
    fields = dict(body.sampling_params)
    if body.cache_salt is not None:  # vLLM's top-level field; prime-rl puts it in sampling_params
        fields.setdefault("cache_salt", body.cache_salt)
    params = _sampling_params(fields, len(body.token_ids), server.facts.max_model_len)
    prompts = [PromptInput(None, list(body.token_ids))]
    check_prompts(prompts, server.facts, params.max_tokens, "token_ids")
    request_id = body.request_id or server.new_request_id("generate-tokens")
    generation = Generation(server.engine, request_id, prompts, params, server.metrics, server.admission, lora)
    if body.stream:
        await start_checked(generation, body)
        return sse_response(_chunks(generation, body, params), generation.close)
    return await until_disconnected(request, _whole(generation, body, params, server.answer_name(lora)))


def _sampling_params(fields: dict, num_prompt: int, max_model_len: int) -> SamplingParams:
    fields = dict(fields)
    for name, no_ops in _NO_OP_SAMPLING.items():
        value = fields.pop(name, no_ops[0])
        if not any(same_json(value, no_op) for no_op in no_ops):
            raise APIError(400, f"sampling_params.{name}: only {no_ops!r} (no-op values here)", "sampling_params")
    unknown = sorted(set(fields) - SAMPLING_FIELDS)
    if unknown:
        raise APIError(400, f"sampling_params.{unknown[0]} is not implemented by this server", "sampling_params")
    if fields.get("max_tokens") is None:  # vLLM's server: what the context leaves, not 16
        fields["max_tokens"] = max(1, max_model_len - num_prompt)
    return build_sampling_params(fields, field_refusal("sampling_params", "sampling_params: "))


async def _whole(generation: Generation, body: TokensRequest, params: SamplingParams, model: str) -> Response:
    merged = WholeChoices()
    prompt_logprobs, weight_version = None, 0
    try:
        await start_checked(generation, body)
        async for _, out in generation.deltas():
            prompt_logprobs = out.prompt_logprobs if out.prompt_logprobs is not None else prompt_logprobs
            weight_version = out.weight_version
            for completion in out.outputs:
                merged.add(_choice(completion, params))
    finally:
        await generation.close()
    choices = [merged.by_index[i] for i in sorted(merged.by_index)]
    num_tokens = sum(len(c["token_ids"]) for c in choices)
    return JSONBytesResponse({
        "request_id": generation.request_id,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "prompt_logprobs": _prompt_logprobs(prompt_logprobs, params),
        "usage": _usage(generation, num_tokens),
        "weight_version": weight_version,
    })


async def _chunks(generation: Generation, body: TokensRequest, params: SamplingParams):
    num_tokens = 0
    async for _, out in generation.deltas():
        for completion in out.outputs:
            if not completion.token_ids and completion.finish_reason is None:
                continue
            num_tokens += len(completion.token_ids)
            choice = _choice(completion, params)
            yield {"request_id": generation.request_id, "choices": [choice], "weight_version": out.weight_version}
    if body.stream_options is not None and body.stream_options.include_usage:
        yield {"request_id": generation.request_id, "choices": [], "usage": _usage(generation, num_tokens)}


def _choice(completion: CompletionOutput, params: SamplingParams) -> dict:
    logprobs = None
    if completion.logprobs is not None:
        logprobs = {"content": token_id_content(completion.token_ids, completion.logprobs, params.logprobs)}
    return {"index": completion.index, "token_ids": list(completion.token_ids), "logprobs": logprobs,
            "finish_reason": completion.finish_reason}


def _prompt_logprobs(positions: list | None, params: SamplingParams) -> list | None:
    """vLLM's rows: every entry the engine returned (the prompt token, the top k, the candidates)."""
    if positions is None:
        return None
    return vllm_prompt_logprobs(positions, params.prompt_logprobs or 0, params.prompt_logprob_token_ids)


def _usage(generation: Generation, num_tokens: int) -> dict:
    usage = generation.usage(num_tokens)
    usage.pop("prompt_tokens_details", None)  # vLLM's: only with --enable-prompt-tokens-details
    return usage
