"""POST /get_sequence_logprobs/: scoring existing token sequences for a trainer, in the shape TRL's
`VLLMClient.get_sequence_logprobs` returns (frontend process, HTTP server). Routed with
`--enable-rl-endpoints`, behind the API key.

Each sequence (prompt + completion ids) is one engine request that generates a single token, dropped,
and asks for prompt logprobs at `temperature` (`SamplingParams.prompt_logprobs_temperature`): the
scored distribution is log_softmax(logits / temperature). Only positions from `prompt_lengths[i]` on
are returned: row j scores `sequences[i][prompt_lengths[i] + j]` given the ids before it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from coreserve.frontend.server.common.errors import APIError
from coreserve.frontend.server.common.fields import Int64, StrictBody
from coreserve.frontend.server.common.generation import Generation, PromptInput
from coreserve.frontend.server.common.inputs import check_logprobs, check_prompts, collect_prompt_logprobs
from coreserve.frontend.server.common.logprob_json import JSONBytesResponse, trl_sequence_answer
from coreserve.frontend.server.common.sampling import build_sampling_params, field_refusal
from coreserve.frontend.server.common.transport import until_disconnected
from coreserve.frontend.server.state import ServerState

SEQUENCE_LOGPROBS_PATH = "/get_sequence_logprobs"


class SequenceLogprobsRequest(StrictBody):
    """TRL's arguments: the sequences, where each one's completion starts, k, and the temperature."""

    sequences: Annotated[list[Annotated[list[Int64], Field(min_length=1)]], Field(min_length=1)]
    prompt_lengths: list[Int64]
    top_logprobs: Annotated[int, Field(ge=1, le=2**63 - 1)] = 100
    temperature: Annotated[float, Field(gt=0.0)] = 1.0
    model: str | None = None


async def get_sequence_logprobs(request: Request, body: SequenceLogprobsRequest) -> Response:
    server: ServerState = request.app.state.server
    lora = server.check_model(body.model)
    _check_lengths(body)
    prompts = [PromptInput(None, list(ids)) for ids in body.sequences]
    check_prompts(prompts, server.facts, 1, "sequences")
    check_logprobs("top_logprobs", body.top_logprobs, server.facts)
    fields = {"max_tokens": 1, "prompt_logprobs": body.top_logprobs, "prompt_logprobs_temperature": body.temperature}
    params = build_sampling_params(fields, field_refusal("temperature"))
    generation = Generation(server.engine, server.new_request_id("score"), prompts, params, server.metrics, server.admission,
                            lora)
    return await until_disconnected(request, _respond(generation, body))


def _check_lengths(body: SequenceLogprobsRequest) -> None:
    if len(body.prompt_lengths) != len(body.sequences):
        raise APIError(
            400,
            f"prompt_lengths has {len(body.prompt_lengths)} entries for {len(body.sequences)} sequences",
            "prompt_lengths",
        )
    for i, (sequence, length) in enumerate(zip(body.sequences, body.prompt_lengths)):
        if not 1 <= length <= len(sequence):
            raise APIError(
                400,
                f"prompt_lengths[{i}] is {length}; it must be in [1, {len(sequence)}] (the first token of a "
                "sequence has nothing before it to be scored from)",
                "prompt_lengths",
            )


async def _respond(generation: Generation, body: SequenceLogprobsRequest) -> Response:
    positions = await collect_prompt_logprobs(generation, body)
    answers = [
        trl_sequence_answer(rows or [], sequence, length, body.top_logprobs)
        for rows, sequence, length in zip(positions, body.sequences, body.prompt_lengths)
    ]
    return JSONBytesResponse({key: [answer[key] for answer in answers] for key in answers[0]})

