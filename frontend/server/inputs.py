"""A request body's prompts and sampling fields to token ids and SamplingParams, checked against the
engine's facts so that each refusal is a 400 naming its field (frontend process, HTTP server).

The rules against the engine's limits are protocol/request_rules.py's, the engine's own, plus vLLM's
stricter length rule; the engine checks again on submission (its ValueError is a 400 too). Checking
here first names the body's field and refuses a multi-prompt request before any prompt reaches the core.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from frontend.server.errors import APIError, bad_request_from_value_error
from frontend.server.generation import Generation, PromptInput
from frontend.server.schemas import CompletionRequest, SamplingFields
from frontend.server.structured_fields import StructuredFields, structured_outputs_of
from frontend.server.unsupported import refuse_unsupported
from protocol.request_rules import (
    RequestLimits,
    RequestRuleError,
    check_max_tokens_fit,
    check_prompt,
    check_token_ids,
)
from protocol.request_rules import check_logprobs as rule_check_logprobs
from protocol.sampling_params import SamplingParams

_OPTIONAL_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "trace_decode_token_ids", "cache_salt",
)


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


async def tokenize(
    server, text: str, add_special_tokens: bool, truncate_prompt_tokens: int | None, param: str = "prompt"
) -> list[int]:
    """A text's token ids, tokenized in a worker thread (the tokenizer lets go of the GIL), so that a
    long prompt delays no other request's tokens."""
    if truncate_prompt_tokens is None:  # a truncated prompt may be any length the body limit allows
        server.prompt_bound.check(text, server.facts.max_model_len, param)
    tokenizer = server.tokenizer
    token_ids = await asyncio.to_thread(
        lambda: list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    )
    return truncated(token_ids, truncate_prompt_tokens, server.facts)


def truncated(token_ids: list[int], keep: int | None, facts) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens; -1: the most that leaves room to generate."""
    if keep is None:
        return token_ids
    if keep == 0 or keep < -1:
        raise APIError(
            400, f"truncate_prompt_tokens must be at least 1, or -1, got {keep}", "truncate_prompt_tokens"
        )
    keep = facts.max_model_len - 1 if keep == -1 else keep
    return token_ids[-keep:]


def check_request(body: SamplingFields) -> None:
    """Refusals that need no engine facts: unsupported fields, stream_options without a stream."""
    refuse_unsupported(body)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")


def check_prompts(prompts: list[PromptInput], facts, max_tokens: int | None, param: str = "prompt") -> None:
    """The engine's prompt rules with vLLM's stricter length rule (prompt plus max_tokens fits
    max_model_len), each refusal a 400 naming its field."""
    limits = RequestLimits.of(facts)
    for prompt in prompts:
        with _as_bad_request():
            check_prompt(prompt.token_ids, limits, param)
            check_max_tokens_fit(len(prompt.token_ids), max_tokens, limits, param)


def check_logprobs(name: str, k: int | None, facts) -> None:
    """The engine's logprobs rule, under the body's own name for the field (`top_logprobs` in chat)."""
    with _as_bad_request():
        rule_check_logprobs(name, k, RequestLimits.of(facts))


@contextmanager
def _as_bad_request() -> Iterator[None]:
    try:
        yield
    except RequestRuleError as exc:
        raise APIError(400, str(exc), exc.param) from exc


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
        with _as_bad_request():
            check_token_ids("logit_bias", [token_id], vocab_size)
        if not -100.0 <= value <= 100.0:
            raise APIError(
                400, f"logit_bias: the bias of {key} is {value}, outside [-100, 100]", "logit_bias"
            )
        result[token_id] = float(value)
    return result


def sampling_params(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    vocab_size: int,
) -> SamplingParams:
    """SamplingParams from the body's fields (unset ones keep vLLM's defaults); a value SamplingParams
    refuses is a 400 naming its field."""
    fields = {name: getattr(body, name) for name in _OPTIONAL_SAMPLING if getattr(body, name) is not None}
    try:
        return SamplingParams(
            n=body.n,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
            disable_spec_decode=body.disable_spec_decode,
            return_routed_experts=body.return_routed_experts,
            return_sampling_mask=body.return_sampling_mask,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias(body.logit_bias, vocab_size),
            allowed_token_ids=body.allowed_token_ids,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            structured_outputs=structured_outputs_of(body) if isinstance(body, StructuredFields) else None,
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


async def collect_prompt_logprobs(generation: Generation, body: SamplingFields) -> list:
    """Starts a scoring generation (a refusal: a 400 naming the field), gathers each prompt's prompt
    logprobs (None where a prompt gave none) and closes it."""
    positions: list = [None] * len(generation.prompts)
    try:
        await start_checked(generation, body)
        async for index, out in generation.deltas():
            if out.prompt_logprobs is not None:
                positions[index] = out.prompt_logprobs
    finally:
        await generation.close()
    return positions
