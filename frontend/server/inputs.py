"""A request body's prompts and sampling fields to token ids and SamplingParams, checked against the
engine's facts so that each refusal is a 400 naming its field (frontend process, HTTP server).

The engine checks again on submission (its ValueError is a 400 too); checking here first names the
field and refuses a multi-prompt request before any of its prompts reaches the core.
"""

from __future__ import annotations

from frontend.server.errors import APIError, bad_request_from_value_error
from frontend.server.generation import Generation, PromptInput
from frontend.server.schemas import SamplingFields
from protocol.sampling_params import SamplingParams

_OPTIONAL_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids",
)  # fmt: skip


def completion_prompts(tokenizer, prompt) -> list[PromptInput]:
    """`prompt` as OpenAI allows it: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    return [
        PromptInput(p, list(tokenizer(p).input_ids)) if isinstance(p, str) else PromptInput(None, list(p))
        for p in prompt
    ]


def check_prompts(prompts: list[PromptInput], facts, max_tokens: int | None, param: str = "prompt") -> None:
    """vLLM's rule: prompt plus max_tokens fits max_model_len; every id in the vocabulary."""
    for prompt in prompts:
        _check_ids(prompt.token_ids, facts.vocab_size, param)
        _check_length(len(prompt.token_ids), facts.max_model_len, max_tokens, param)


def _check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if not ids:
        raise APIError(400, f"{param} is empty: there is nothing to complete", param)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        message = f"{param}: token id {bad} is out of vocabulary (valid ids are 0..{vocab_size - 1})"
        raise APIError(400, message, param)


def _check_length(num_prompt: int, max_model_len: int, max_tokens: int | None, param: str) -> None:
    if num_prompt >= max_model_len:
        message = (
            f"This model's maximum context length is {max_model_len} tokens; the {param} has {num_prompt} "
            "tokens, leaving no room for a completion"
        )
        raise APIError(400, message, param)
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the {param}, {max_tokens} in the completion). "
            "Please reduce the length of the prompt or max_tokens."
        )
        raise APIError(400, message, "max_tokens")


def check_logprobs(name: str, k: int | None, facts) -> None:
    if k is not None and facts.max_logprobs != -1 and k > facts.max_logprobs:
        raise APIError(
            400, f"{name}={k} is more than this server's max_logprobs ({facts.max_logprobs})", name
        )


def sampling_params(
    body: SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    """SamplingParams from the body's fields (unset ones keep vLLM's defaults); a value SamplingParams
    refuses is a 400 naming its field."""
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported by this server", "logit_bias")
    fields = {name: getattr(body, name) for name in _OPTIONAL_SAMPLING if getattr(body, name) is not None}
    try:
        return SamplingParams(
            n=body.n,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            **fields,
        )
    except ValueError as exc:
        raise bad_request_from_value_error(exc, frozenset(type(body).model_fields)) from exc


async def start_checked(generation: Generation, body: SamplingFields) -> None:
    """Starts the generation; what the engine refuses is a 400 naming the field."""
    try:
        await generation.start()
    except ValueError as exc:
        raise bad_request_from_value_error(exc, frozenset(type(body).model_fields)) from exc
