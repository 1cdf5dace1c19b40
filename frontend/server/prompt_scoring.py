"""vLLM's prompt-scoring fields on /v1/completions and /v1/chat/completions: `prompt_logprob_token_ids`
(candidate ids scored at each prompt position) and `prompt_logprobs_temperature` (the scored
distribution is logits / T), put into the request's SamplingParams (frontend process, HTTP server;
docs/rl.md, "Scoring").
"""

from __future__ import annotations

import msgspec

from frontend.server.errors import bad_request_from_value_error
from frontend.server.schemas import SamplingFields
from protocol.sampling_params import SamplingParams


def prompt_scoring_k(body: SamplingFields) -> int | None:
    """The k of the `prompt_logprobs` a choice shows: the body's, or 0 (the prompt token and the
    candidates) when only candidates were asked for; None: no prompt logprobs in the answer."""
    if body.prompt_logprobs is not None:
        return body.prompt_logprobs
    return 0 if body.prompt_logprob_token_ids is not None else None


def with_prompt_scoring(params: SamplingParams, body: SamplingFields) -> SamplingParams:
    """`params` with the body's candidate ids and prompt temperature; a value SamplingParams refuses is
    a 400 naming its field."""
    if body.prompt_logprob_token_ids is None and body.prompt_logprobs_temperature is None:
        return params
    if body.prompt_logprobs_temperature is not None and params.prompt_logprobs is None:
        raise bad_request_from_value_error(
            ValueError("prompt_logprobs_temperature needs prompt_logprobs (or, in a completion, echo with logprobs)"),
            frozenset(type(body).model_fields),
        )
    try:
        return msgspec.structs.replace(
            params,
            prompt_logprob_token_ids=body.prompt_logprob_token_ids,
            prompt_logprobs_temperature=body.prompt_logprobs_temperature,
        )
    except ValueError as exc:
        raise bad_request_from_value_error(exc, frozenset(type(body).model_fields)) from exc
