"""Turns a user's prompt and SamplingParams into a validated EngineCoreRequest (frontend process).

Every user error is a ValueError raised here, before anything leaves for the core; the rules against
the engine's limits are coreserve/protocol/request_rules.py's, the same the core applies on arrival.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from coreserve.frontend.engine.structured_outputs import check_structured_outputs
from coreserve.protocol.messages import EngineCoreRequest, HandshakeReply
from coreserve.protocol.request_rules import RequestLimits, check_request
from coreserve.protocol.sampling_params import SamplingParams

PromptType = str | Sequence[int]
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}  # vLLM's TextPrompt and TokensPrompt keys built


def cache_salt_of(prompt: PromptType) -> str | None:
    """A prompt dict's `cache_salt` (vLLM's key), which the request carries in SamplingParams."""
    return prompt.get("cache_salt") if isinstance(prompt, dict) else None


class InputProcessor:
    """`facts` are the core's, with this client's own limits applied (a smaller max_model_len or
    max_logprobs asked for when attaching to a daemon); `core_max_model_len` is the core's own."""

    def __init__(self, tokenizer, facts: HandshakeReply, core_max_model_len: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.facts = facts
        self.core_max_model_len = core_max_model_len or facts.max_model_len

    def process(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and its token ids, truncated as `params` asks
        (`truncate_prompt_tokens`: the last N), validated against the core's facts."""
        text, token_ids = self.tokenize(prompt)
        if isinstance(params, SamplingParams) and params.truncate_prompt_tokens is not None:
            keep = params.truncate_prompt_tokens
            room = 0 if params.pooling is not None else 1  # a pooling prompt may fill the context
            keep = self.facts.max_model_len - room if keep == -1 else keep  # -1: the most that leaves room
            token_ids = token_ids[-keep:]
        self.validate(token_ids, params)
        return text, token_ids

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and set(prompt) - _PROMPT_KEYS:
            raise ValueError(
                f"prompt dict keys {sorted(set(prompt) - _PROMPT_KEYS)} are not supported; "
                f"supported: {sorted(_PROMPT_KEYS)}"
            )
        if isinstance(prompt, dict) and "prompt" in prompt and "prompt_token_ids" not in prompt:
            prompt = prompt["prompt"]  # vLLM's TextPrompt
            if not isinstance(prompt, str):
                raise ValueError(f'a {{"prompt": ...}} dict holds a string, got {type(prompt).__name__}')
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:  # vLLM's TokensPrompt
            prompt = prompt["prompt_token_ids"]
        if not isinstance(prompt, Sequence) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise ValueError("a prompt must be a string or a list of token ids (ints)")
        return None, list(prompt)

    def make_request(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> EngineCoreRequest:
        """Callers validate once per user request (`validate`) before making its core requests. A
        client limit below the core's max_model_len caps max_tokens (the core stops there, "length")."""
        if self.facts.max_model_len < self.core_max_model_len and params.pooling is None:
            room = self.facts.max_model_len - len(prompt_token_ids)
            if params.max_tokens is None or params.max_tokens > room:
                params = msgspec.structs.replace(
                    params, max_tokens=room, min_tokens=min(params.min_tokens, room)
                )
        return EngineCoreRequest(req_id, prompt_token_ids, params, time.time())

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The engine's request rules (coreserve/protocol/request_rules.py) against this client's limits."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate()  # again: the object may have been changed since it was built
        check_request(prompt_token_ids, params, RequestLimits.of(self.facts))
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs)
