"""Request fields of OpenAI's and vLLM's APIs that coreserve does not implement (frontend process, HTTP).

Each is declared (any JSON value) so that `refuse_unsupported` can answer a 400 naming it, with the
reason, rather than silently ignored. A field holding its no-op value (`use_beam_search: false`) asks for
nothing coreserve lacks and passes. Fields unknown to both APIs are refused by the schemas themselves
(`extra="forbid"`). docs/serving.md lists the fields and these decisions.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, create_model

from coreserve.frontend.server.common.errors import APIError
from coreserve.frontend.server.common.fields import same_json

_TOOLS = "OpenAI's deprecated functions are not taken: use tools and tool_choice"
_BEAM = "beam search is not implemented"
_MEDIA = "only text models are served"
_PD = "disaggregated prefill (KV transfer) is not implemented"

# field -> (no-op values that pass, why anything else is refused)
COMMON: dict[str, tuple[list, str]] = {
    "guided_decoding_backend": ([], "the grammar engine (xgrammar) is not chosen per request"),
    "guided_whitespace_pattern": ([], "whitespace patterns for JSON are not implemented"),
    "structural_tag": ([], "structural tags are not implemented"),
    "use_beam_search": ([False], _BEAM),
    "length_penalty": ([1.0], _BEAM),
    "bad_words": ([[]], "bad_words is not implemented"),
    "logits_processors": ([[]], "custom logits processors are not implemented"),
    "priority": ([0], "priority scheduling is not implemented (requests are served first come)"),
    "request_id": ([], "request ids are the server's own"),
    "kv_transfer_params": ([], _PD),
    "vllm_xargs": ([], "vllm_xargs (custom extensions) are not implemented"),
    "mm_processor_kwargs": ([], _MEDIA),
    "service_tier": (["auto", "default"], "there is one service tier"),
    "store": ([False], "completions are not stored"),
    # SGLang's names, which vllm-router and sglang-router write into every request they forward
    "no_stop_trim": ([False], "stop strings are trimmed from the text (include_stop_str_in_output keeps them)"),
}
COMPLETION_ONLY: dict[str, tuple[list, str]] = {
    "prompt_embeds": ([], "prompts are text or token ids; embeddings are not taken"),
}
CHAT_ONLY: dict[str, tuple[list, str]] = {
    "functions": ([[]], _TOOLS),
    "function_call": (["none"], _TOOLS),
    "audio": ([], _MEDIA),
    "modalities": ([["text"]], _MEDIA),
    "media_io_kwargs": ([], _MEDIA),
    "prediction": ([], "predicted outputs are not implemented"),
    # SGLang's: the reasoning parser (--reasoning-parser) always separates and streams it apart
    "separate_reasoning": ([True], "the reasoning parser always separates the reasoning"),
    "stream_reasoning": ([True], "the reasoning parser always streams the reasoning apart"),
    "verbosity": ([], "verbosity is not implemented"),
    "web_search_options": ([], "web search is not implemented"),
    "documents": ([], "documents for the chat template are not implemented"),
    "chat_template": (
        [],
        "per-request chat templates are not accepted (start the server with --chat-template)",
    ),
}

_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _fields_model(name: str, table: dict[str, tuple[list, str]]) -> type[BaseModel]:
    fields: dict[str, Any] = {field: (Any, None) for field in table}
    return create_model(name, __config__=_CONFIG, **fields)


CompletionUnsupportedFields = _fields_model("CompletionUnsupportedFields", {**COMMON, **COMPLETION_ONLY})
ChatUnsupportedFields = _fields_model("ChatUnsupportedFields", {**COMMON, **CHAT_ONLY})


def refuse_unsupported(body: BaseModel) -> None:
    """A 400 naming the first unsupported field that holds anything but null or its no-op value."""
    table = {**COMMON, **(CHAT_ONLY if isinstance(body, ChatUnsupportedFields) else COMPLETION_ONLY)}
    for name, (no_ops, why) in table.items():
        value = getattr(body, name)
        if value is not None and not any(same_json(value, no_op) for no_op in no_ops):
            raise APIError(400, f"{name} is not supported by this server: {why}", name)
