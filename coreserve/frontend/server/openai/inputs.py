"""A completions or chat body's prompts and sampling fields to token ids and SamplingParams (frontend
process, HTTP server): OpenAI's prompt forms, the fields refused before anything runs, `logit_bias`'s
rules, and the body's fields under SamplingParams' names for the one builder (common/sampling.py),
with vLLM's prompt-scoring fields: `prompt_logprob_token_ids` (candidate ids scored at each prompt
position) and `prompt_logprobs_temperature` (the scored distribution is logits / T; docs/rl.md, "Scoring").
"""

from __future__ import annotations

from coreserve.frontend.server.common.errors import APIError, bad_request_from_value_error
from coreserve.frontend.server.common.generation import PromptInput
from coreserve.frontend.server.common.inputs import as_bad_request, tokenize, truncated
from coreserve.frontend.server.common.sampling import build_sampling_params, same_name_fields
from coreserve.frontend.server.openai.schemas import CompletionRequest, SamplingFields
from coreserve.frontend.server.openai.structured_fields import StructuredFields, structured_outputs_of
from coreserve.frontend.server.openai.unsupported import refuse_unsupported
from coreserve.protocol.request_rules import check_token_ids
from coreserve.protocol.sampling_params import SamplingParams

# SamplingParams' names whose values the handlers compute from the body (not copied by name)
_COMPUTED = frozenset(("max_tokens", "logprobs", "prompt_logprobs", "logit_bias", "structured_outputs"))


async def completion_prompts(server, body: CompletionRequest) -> list[PromptInput]:
    """`prompt` as OpenAI allows it: a string, strings, token ids, or lists of token ids. Texts are
    tokenized off the event loop, after a text that cannot fit the context is refused untokenized."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise APIError(  # vLLM's wording (prompt_embeds is not taken here: a prompt is needed)
            400, "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
        )
    prompts = []
    for p in prompt:
        if isinstance(p, str):
            token_ids = await tokenize(server, p, body.add_special_tokens, body.truncate_prompt_tokens)
            prompts.append(PromptInput(p, token_ids))
        else:
            prompts.append(PromptInput(None, truncated(list(p), body.truncate_prompt_tokens, server.facts)))
    return prompts


def check_body_fields(body: SamplingFields) -> None:
    """Refusals that need no engine facts: unsupported fields, stream_options without a stream."""
    refuse_unsupported(body)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's rules: keys are token ids written as strings, values in [-100, 100], ids in the vocabulary."""
    if not bias:
        return None
    result = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise APIError(
                400, f"logit_bias: key {key!r} is not a token id (a non-negative integer)", "logit_bias"
            )
        token_id = int(key)
        with as_bad_request():
            check_token_ids("logit_bias", [token_id], vocab_size)
        if not -100.0 <= value <= 100.0:
            raise APIError(
                400, f"logit_bias: the bias of {key} is {value}, outside [-100, 100]", "logit_bias"
            )
        result[token_id] = float(value)
    return result


def prompt_scoring_k(body: SamplingFields) -> int | None:
    """The k of the `prompt_logprobs` a choice shows: the body's, or 0 (the prompt token and the
    candidates) when only candidates were asked for; None: no prompt logprobs in the answer."""
    if body.prompt_logprobs is not None:
        return body.prompt_logprobs
    return 0 if body.prompt_logprob_token_ids is not None else None


def check_prompt_scoring(body: SamplingFields, prompt_logprobs: int | None) -> None:
    """The candidate ids and prompt temperature go into SamplingParams with the body's other fields
    (sampling_params below); a temperature with no prompt logprobs to scale is a 400 in the body's terms."""
    if body.prompt_logprobs_temperature is not None and prompt_logprobs is None:
        raise bad_request_from_value_error(
            ValueError("prompt_logprobs_temperature needs prompt_logprobs (or, in a completion, echo with logprobs)"),
            frozenset(type(body).model_fields),
        )


def sampling_params(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    vocab_size: int,
    overrides: dict | None = None,
) -> SamplingParams:
    """SamplingParams from the body's fields (unset ones keep vLLM's defaults), with the prompt-scoring
    fields and what the handler decided in `overrides` (a tool choice's grammar); a value SamplingParams
    refuses is a 400 naming its field."""
    check_prompt_scoring(body, prompt_logprobs)
    fields = {
        **same_name_fields(body, computed=_COMPUTED),
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "logit_bias": logit_bias(body.logit_bias, vocab_size),
        "structured_outputs": structured_outputs_of(body) if isinstance(body, StructuredFields) else None,
        **(overrides or {}),
    }
    names = frozenset(type(body).model_fields)
    return build_sampling_params(fields, lambda exc: bad_request_from_value_error(exc, names))
