"""POST /generate: token ids in, token ids and logprobs out, in SGLang's shape, for RL rollouts
(frontend process, HTTP server). Routed with `--enable-rl-endpoints`, behind the API key.

`input_ids` is one prompt (a list of ids: the answer is one object) or several (a list of lists: a
list, completion j of input i at i * n + j). `sampling_params` takes SGLang's names; a field it does
not know is a 400 naming it. Each answer: `output_ids`, `output_token_logprobs` (the sampled tokens'
logprobs, with `return_logprob`), `text`, and `meta_info` with the weight version that computed it.
No streaming: the whole answer once every completion finished.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from frontend.outputs import CompletionOutput, RequestOutput
from frontend.server.errors import APIError
from frontend.server.generation import Generation, PromptInput
from frontend.server.inputs import check_prompts, start_checked
from frontend.server.json_response import JSONBytesResponse
from frontend.server.schemas import Int64, NonNegativeInt64, StrictBody, Text
from frontend.server.state import ServerState
from frontend.server.transport import until_disconnected
from protocol.sampling_params import LogprobsMode, SamplingParams

GENERATE_PATH = "/generate"
_SAME_NAME = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "n",
)


class GenerateSamplingParams(StrictBody):
    """SGLang's sampling fields that coreserve implements (its defaults: 128 new tokens)."""

    max_new_tokens: Annotated[int, Field(ge=1, le=2**63 - 1)] = 128
    min_new_tokens: NonNegativeInt64 = 0
    n: Annotated[int, Field(ge=1, le=2**63 - 1)] = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    sampling_seed: Int64 | None = None


class GenerateRequest(StrictBody):
    input_ids: Annotated[list[Int64], Field(min_length=1)] | Annotated[list[list[Int64]], Field(min_length=1)]
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    return_logprob: bool = False
    logprobs_mode: LogprobsMode | None = None  # vLLM's names; None: the engine's (--logprobs-mode)
    model: str | None = None
    stream: bool = False  # refused when true


async def generate(request: Request, body: GenerateRequest) -> Response:
    server: ServerState = request.app.state.server
    server.check_model(body.model)
    if body.stream:
        raise APIError(400, "stream: /generate answers once every completion finished", "stream")
    if body.logprobs_mode is not None and not body.return_logprob:
        raise APIError(400, "logprobs_mode needs return_logprob: true", "logprobs_mode")
    is_batch = isinstance(body.input_ids[0], list)
    prompts = [PromptInput(None, list(ids)) for ids in (body.input_ids if is_batch else [body.input_ids])]
    check_prompts(prompts, server.facts, body.sampling_params.max_new_tokens, "input_ids")
    params = _sampling_params(body)
    generation = Generation(server.engine, server.new_request_id("gen"), prompts, params, server.metrics, server.admission)
    return await until_disconnected(
        request, _respond(generation, body, is_one=not is_batch and params.n == 1)
    )


def _sampling_params(body: GenerateRequest) -> SamplingParams:
    fields = body.sampling_params
    same = {name: getattr(fields, name) for name in _SAME_NAME if getattr(fields, name) is not None}
    try:
        return SamplingParams(
            max_tokens=fields.max_new_tokens,
            min_tokens=fields.min_new_tokens,
            seed=fields.sampling_seed,
            logprobs=0 if body.return_logprob else None,
            logprobs_mode=body.logprobs_mode,
            **same,
        )
    except ValueError as exc:
        raise APIError(400, f"sampling_params: {exc}", "sampling_params") from exc


async def _respond(generation: Generation, body: GenerateRequest, is_one: bool) -> Response:
    """One object for one input and n = 1, else a list (input i's completion j at i * n + j)."""
    n = generation.params.n
    completions: list[list[CompletionAnswer]] = [
        [CompletionAnswer() for _ in range(n)] for _ in generation.prompts
    ]
    try:
        await start_checked(generation, body)
        async for prompt_index, out in generation.deltas():
            for completion in out.outputs:
                completions[prompt_index][completion.index].add(completion, out)
    finally:
        await generation.close()
    answers = [
        answer.json(generation, prompt_index, body.return_logprob)
        for prompt_index, answers in enumerate(completions)
        for answer in answers
    ]
    return JSONBytesResponse(answers[0] if is_one else answers)


class CompletionAnswer:
    """One completion's ids, logprobs and text as its deltas arrive."""

    def __init__(self) -> None:
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.weight_version = 0

    def add(self, completion: CompletionOutput, out: RequestOutput) -> None:
        self.output_ids.extend(completion.token_ids)
        self.text += completion.text
        if completion.logprobs is not None:
            self.logprobs.extend(p[t].logprob for p, t in zip(completion.logprobs, completion.token_ids))
        if completion.finish_reason is not None:
            self.finish_reason, self.stop_reason = completion.finish_reason, completion.stop_reason
        self.weight_version = out.weight_version

    def json(self, generation: Generation, prompt_index: int, has_logprobs: bool) -> dict:
        """SGLang's answer; `finish_reason` its object: {"type"}, with "matched" (the stop token or
        string) or "length" (the tokens generated)."""
        reason: dict = {"type": self.finish_reason}
        if self.stop_reason is not None:
            reason["matched"] = self.stop_reason
        if self.finish_reason == "length":
            reason["length"] = len(self.output_ids)
        answer = {"text": self.text, "output_ids": self.output_ids}
        if has_logprobs:
            answer["output_token_logprobs"] = self.logprobs
        answer["meta_info"] = {
            "id": f"{generation.request_id}-{prompt_index}",
            "weight_version": self.weight_version,
            "finish_reason": reason,
            "prompt_tokens": len(generation.prompts[prompt_index].token_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": generation.num_cached_tokens[prompt_index],
        }
        return answer
