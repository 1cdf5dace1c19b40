"""vLLM's response shapes: the keys its OpenAI response models write even when unset, null (or their
default), so that code written against vLLM reads them as attributes on coreserve too
(`choice.token_ids is None` on the official openai client, where a missing key is an AttributeError)
(frontend process, HTTP server).

vLLM writes a whole answer with every field of its pydantic models (`model_dump`), and a completions
chunk likewise; a chat chunk only with the fields it set (`exclude_unset`): every choice's `logprobs`,
`finish_reason` and `token_ids`, each first chunk's `prompt_token_ids`, every delta's
`reasoning_content` (its validator copies `reasoning` there). The tables below are those keys; the
routes write their own keys first and `with_defaults` adds what is missing, so nothing coreserve writes
beyond them (`raw_text`, `routed_experts`, a chunk's `stop_reason`) is lost. docs/serving.md, "What
responses always carry".
"""

from __future__ import annotations

from collections.abc import Mapping

# ChatCompletionResponse's own fields beyond id, object, created, model, choices and usage
CHAT_COMPLETION = {
    "service_tier": None,
    "system_fingerprint": None,
    "prompt_logprobs": None,
    "prompt_token_ids": None,
    "kv_transfer_params": None,
}
CHAT_CHOICE = {"logprobs": None, "finish_reason": "stop", "stop_reason": None, "token_ids": None}
# ChatMessage's: `reasoning` is vLLM's name since 0.11, `reasoning_content` the one before (both written)
CHAT_MESSAGE = {
    "content": None,
    "refusal": None,
    "annotations": None,
    "audio": None,
    "function_call": None,
    "tool_calls": [],
    "reasoning": None,
    "reasoning_content": None,
}
CHAT_CHUNK_CHOICE = {"logprobs": None, "finish_reason": None, "token_ids": None}
CHAT_DELTA = {"reasoning_content": None}
COMPLETION = {"service_tier": None, "system_fingerprint": None, "kv_transfer_params": None}
COMPLETION_CHOICE = {
    "logprobs": None,
    "finish_reason": None,
    "stop_reason": None,
    "token_ids": None,
    "prompt_logprobs": None,
    "prompt_token_ids": None,
}
COMPLETION_CHUNK = {"usage": None}
COMPLETION_CHUNK_CHOICE = {
    "logprobs": None,
    "finish_reason": None,
    "stop_reason": None,
    "prompt_token_ids": None,
    "token_ids": None,
}


def with_defaults(json_object: dict, defaults: Mapping[str, object]) -> dict:
    """`json_object` (changed in place and returned) with each key of `defaults` it lacks, after its own;
    a list default is a new list each time."""
    for key, value in defaults.items():
        if key not in json_object:
            json_object[key] = list(value) if isinstance(value, list) else value
    return json_object


def chat_message(message: dict) -> dict:
    """A whole answer's message as vLLM's ChatMessage: the reasoning under both of vLLM's names."""
    if message.get("reasoning_content") is not None:
        message.setdefault("reasoning", message["reasoning_content"])
    return with_defaults(message, CHAT_MESSAGE)


def chat_delta(delta: dict) -> dict:
    """A streamed delta as vLLM's DeltaMessage: `reasoning_content` always, `reasoning` beside it where
    there is some."""
    if delta.get("reasoning_content") is not None:
        delta.setdefault("reasoning", delta["reasoning_content"])
    return with_defaults(delta, CHAT_DELTA)
