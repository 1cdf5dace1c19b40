"""Prompts to token ids, checked against the engine's facts so that each refusal is a 400 naming its
field, and a generation started or collected under the same rule (frontend process, HTTP server).

The rules against the engine's limits are coreserve/protocol/request_rules.py's, the engine's own, plus vLLM's
stricter length rule; the engine checks again on submission (its ValueError is a 400 too). Checking
here first names the body's field and refuses a multi-prompt request before any prompt reaches the core.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from coreserve.frontend.server.common.errors import APIError, bad_request_from_value_error
from coreserve.frontend.server.common.fields import StrictBody
from coreserve.frontend.server.common.generation import Generation, PromptInput
from coreserve.protocol.request_rules import (
    RequestLimits,
    RequestRuleError,
    check_max_tokens_fit,
    check_prompt,
)
from coreserve.protocol.request_rules import check_logprobs as rule_check_logprobs


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


def check_prompts(prompts: list[PromptInput], facts, max_tokens: int | None, param: str = "prompt") -> None:
    """The engine's prompt rules with vLLM's stricter length rule (prompt plus max_tokens fits
    max_model_len), each refusal a 400 naming its field."""
    limits = RequestLimits.of(facts)
    for prompt in prompts:
        with as_bad_request():
            check_prompt(prompt.token_ids, limits, param)
            check_max_tokens_fit(len(prompt.token_ids), max_tokens, limits, param)


def check_logprobs(name: str, k: int | None, facts) -> None:
    """The engine's logprobs rule, under the body's own name for the field (`top_logprobs` in chat)."""
    with as_bad_request():
        rule_check_logprobs(name, k, RequestLimits.of(facts))


@contextmanager
def as_bad_request() -> Iterator[None]:
    try:
        yield
    except RequestRuleError as exc:
        raise APIError(400, str(exc), exc.param) from exc


async def start_checked(generation: Generation, body: StrictBody) -> None:
    """Starts the generation; what the engine refuses is a 400 naming the field."""
    try:
        await generation.start()
    except ValueError as exc:
        raise bad_request_from_value_error(exc, frozenset(type(body).model_fields)) from exc


async def collect_prompt_logprobs(generation: Generation, body: StrictBody) -> list:
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
