"""POST /generate and /abort_request: token ids in, token ids and logprobs out, in SGLang's shape, for
RL rollouts (slime, SkyRL's SGLang path; frontend process, HTTP server). Routed with
`--enable-rl-endpoints`, behind the API key.

`input_ids` is one prompt (a list of ids: the answer is one object) or several (a list of lists: a
list, completion j of input i at i * n + j). `sampling_params` takes SGLang's names; a field it does
not know is a 400 naming it. Each answer: `text`, `output_ids`, and `meta_info` with SGLang's
`output_token_logprobs` ([logprob, token id, null] per token, with `return_logprob`),
`output_top_logprobs` (with `top_logprobs_num`), `weight_version`, `finish_reason`, token counts
(`output_token_logprobs` also as plain floats at the top level, coreserve's first shape). `stream`
(one input, n = 1): SGLang's cumulative chunks, each the whole answer so far, then `[DONE]`.
`no_stop_trim` keeps a matched stop string in the text; `custom_params.return_top_p_token_ids` (slime's
top-p replay) adds each token's sampling support as meta_info.top_p_token_ids / top_p_token_offsets.
`rid`
names the request for `/abort_request` (`{"rid"}` or `{"abort_all": true}`), which ends it with what it
generated and finish_reason `abort`, as SGLang does.
"""

from __future__ import annotations

import base64
import itertools
from typing import Annotated

import numpy as np
from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from coreserve.frontend.outputs import CompletionOutput, RequestOutput
from coreserve.frontend.server.common.accumulate import merge_piece
from coreserve.frontend.server.common.errors import APIError
from coreserve.frontend.server.common.fields import Int64, NonNegativeInt64, SharedSamplingFields, StrictBody
from coreserve.frontend.server.common.generation import Generation, PromptInput
from coreserve.frontend.server.common.inputs import check_prompts, start_checked
from coreserve.frontend.server.common.logprob_json import JSONBytesResponse, sglang_columns, sglang_fields
from coreserve.frontend.server.common.sampling import build_sampling_params, field_refusal, same_name_fields
from coreserve.frontend.server.common.transport import sse_response, until_disconnected
from coreserve.frontend.server.state import ServerState
from coreserve.protocol.sampling_params import LogprobsMode, SamplingParams

GENERATE_PATH = "/generate"
# SGLang's names for SamplingParams' fields; the others it shares by name (common/sampling.py)
_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed",
            "no_stop_trim": "include_stop_str_in_output"}


class TopPCustomParams(StrictBody):
    """The custom_params key slime sends (its patched SGLang's); any other key is a 400 naming it."""

    return_top_p_token_ids: bool = False


class GenerateSamplingParams(SharedSamplingFields):
    """SGLang's sampling fields that coreserve implements (its defaults: 128 new tokens)."""

    max_new_tokens: Annotated[int, Field(ge=1, le=2**63 - 1)] = 128
    min_new_tokens: NonNegativeInt64 = 0
    sampling_seed: Int64 | None = None
    no_stop_trim: bool = False  # keep a matched stop string in the text (vLLM's include_stop_str_in_output)
    # slime's top-p replay: {"return_top_p_token_ids": true} returns each token's support (the ids the
    # sampler drew from) as meta_info.top_p_token_ids and top_p_token_offsets (CSR)
    custom_params: TopPCustomParams | None = None


class GenerateRequest(StrictBody):
    input_ids: Annotated[list[Int64], Field(min_length=1)] | Annotated[list[list[Int64]], Field(min_length=1)]
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    return_logprob: bool = False
    top_logprobs_num: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0  # with return_logprob: top-k a token
    logprobs_mode: LogprobsMode | None = None  # vLLM's names; None: the engine's (--logprobs-mode)
    model: str | None = None
    stream: bool = False  # one input and n = 1
    rid: str | None = None  # SGLang's request id, for /abort_request
    weight_version: NonNegativeInt64 | None = None  # pinned weights: another version is an error
    # slime's routing replay: meta_info.routed_experts, SGLang's base64 of int32 [tokens - 1, layers, top_k]
    return_routed_experts: bool = False
    routed_experts_start_len: Annotated[int, Field(ge=0, le=0)] = 0  # every position: only 0 here


class AbortRequest(StrictBody):
    rid: str | None = None
    abort_all: bool = False


async def generate(request: Request, body: GenerateRequest) -> Response:
    server: ServerState = request.app.state.server
    lora = server.check_model(body.model)
    if body.logprobs_mode is not None and not body.return_logprob:
        raise APIError(400, "logprobs_mode needs return_logprob: true", "logprobs_mode")
    is_batch = isinstance(body.input_ids[0], list)
    prompts = [PromptInput(None, list(ids)) for ids in (body.input_ids if is_batch else [body.input_ids])]
    check_prompts(prompts, server.facts, body.sampling_params.max_new_tokens, "input_ids")
    params = _sampling_params(body)
    if body.stream and (is_batch or params.n > 1):
        raise APIError(400, "stream: one input with n = 1 streams (SGLang's chunks are one answer's)", "stream")
    if body.rid is not None and body.rid in server.live:
        raise APIError(400, f"rid: a request {body.rid!r} is already running", "rid")
    request_id = body.rid or server.new_request_id("gen")
    generation = Generation(server.engine, request_id, prompts, params, server.metrics, server.admission, lora)
    server.live[request_id] = generation
    if body.stream:
        try:
            await start_checked(generation, body)
        except BaseException:
            server.live.pop(request_id, None)
            raise
        return sse_response(_chunks(generation, body), lambda: _close(generation, server))
    try:
        return await until_disconnected(request, _respond(generation, body, is_one=not is_batch and params.n == 1))
    finally:
        server.live.pop(request_id, None)


async def abort_request(request: Request, body: AbortRequest) -> Response:
    """SGLang's: ends the named request (or every /generate request) with what it generated so far."""
    server: ServerState = request.app.state.server
    names = list(server.live) if body.abort_all else [body.rid] if body.rid in server.live else []
    for name in names:
        generation = server.live[name]
        for index in range(len(generation.prompts)):
            await server.engine.abort(f"{name}-{index}")
    return JSONBytesResponse({"aborted": names})


async def _close(generation: Generation, server: ServerState) -> None:
    server.live.pop(generation.request_id, None)
    await generation.close()


async def _chunks(generation: Generation, body: GenerateRequest):
    answer = CompletionAnswer(body.top_logprobs_num)
    async for _, out in generation.deltas():
        answer.add(out.outputs[0], out)
        yield answer.json(generation, 0, body.return_logprob, body.top_logprobs_num)


def _sampling_params(body: GenerateRequest) -> SamplingParams:
    fields = {
        **same_name_fields(body.sampling_params, _RENAMES),
        "logprobs": body.top_logprobs_num if body.return_logprob else None,
        "logprobs_mode": body.logprobs_mode,
        "weight_version": body.weight_version,
        "return_routed_experts": body.return_routed_experts,
        "return_sampling_mask": _wants_top_p_ids(body),
    }
    return build_sampling_params(fields, field_refusal("sampling_params", "sampling_params: "))


def _wants_top_p_ids(body: GenerateRequest) -> bool:
    custom = body.sampling_params.custom_params
    return custom is not None and custom.return_top_p_token_ids


async def _respond(generation: Generation, body: GenerateRequest, is_one: bool) -> Response:
    """One object for one input and n = 1, else a list (input i's completion j at i * n + j)."""
    n = generation.params.n
    completions: list[list[CompletionAnswer]] = [
        [CompletionAnswer(body.top_logprobs_num) for _ in range(n)] for _ in generation.prompts
    ]
    try:
        await start_checked(generation, body)
        async for prompt_index, out in generation.deltas():
            for completion in out.outputs:
                completions[prompt_index][completion.index].add(completion, out)
    finally:
        await generation.close()
    answers = [
        answer.json(generation, prompt_index, body.return_logprob, body.top_logprobs_num)
        for prompt_index, answers in enumerate(completions)
        for answer in answers
    ]
    return JSONBytesResponse(answers[0] if is_one else answers)


class CompletionAnswer:
    """One completion's answer so far: its deltas' pieces merged (common/accumulate.py)."""

    def __init__(self, top_k: int = 0) -> None:
        self.top_k = top_k  # top_logprobs_num: the top-k rows are kept only when asked
        self.merged: dict = {"text": "", "output_ids": [], "finish_reason": None, "stop_reason": None}
        self.weight_version = 0

    def add(self, completion: CompletionOutput, out: RequestOutput) -> None:
        merge_piece(self.merged, self._piece(completion))
        self.weight_version = out.weight_version

    def _piece(self, completion: CompletionOutput) -> dict:
        piece = {"text": completion.text, "output_ids": list(completion.token_ids),
                 "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
        if completion.logprobs is not None:
            piece["logprobs"] = sglang_columns(completion.token_ids, completion.logprobs, bool(self.top_k))
        if completion.sampling_mask is not None:  # each token's support (the sampler's ids)
            mask = completion.sampling_mask
            piece["sampling_mask"] = [mask[i].tolist() for i in range(len(mask))]
        if completion.routed_experts is not None:  # [prompt + tokens - 1, layers, top_k], once finished
            piece["routed_experts"] = completion.routed_experts
        return piece

    def json(self, generation: Generation, prompt_index: int, has_logprobs: bool, k: int = 0) -> dict:
        """SGLang's answer; `finish_reason` its object: {"type"}, with "matched" (the stop token or
        string) or "length" (the tokens generated)."""
        merged = self.merged
        output_ids, finish_reason = merged["output_ids"], merged["finish_reason"]
        reason: dict = {"type": finish_reason}
        if merged["stop_reason"] is not None:
            reason["matched"] = merged["stop_reason"]
        if finish_reason == "length":
            reason["length"] = len(output_ids)
        answer = {"text": merged["text"], "output_ids": output_ids}
        top_fields, meta_fields = sglang_fields(merged.get("logprobs"), output_ids, k) if has_logprobs else ({}, {})
        answer.update(top_fields)
        answer["meta_info"] = {
            "id": f"{generation.request_id}-{prompt_index}",
            **meta_fields,
            "weight_version": self.weight_version,
            "finish_reason": reason,
            "prompt_tokens": len(generation.prompts[prompt_index].token_ids),
            "completion_tokens": len(output_ids),
            "cached_tokens": generation.num_cached_tokens[prompt_index],
        }
        if merged.get("routed_experts") is not None:  # SGLang's encoding, which slime decodes (utils/misc.py)
            data = np.ascontiguousarray(merged["routed_experts"], dtype="<i4").tobytes()
            answer["meta_info"]["routed_experts"] = base64.b64encode(data).decode("ascii")
        if "sampling_mask" in merged:  # slime's top-p replay: CSR, token i's ids at offsets[i]:offsets[i + 1]
            supports = merged["sampling_mask"]
            answer["meta_info"]["top_p_token_ids"] = [t for support in supports for t in support]
            answer["meta_info"]["top_p_token_offsets"] = [0, *itertools.accumulate(len(s) for s in supports)]
        return answer

