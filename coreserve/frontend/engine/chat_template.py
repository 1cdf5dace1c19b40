"""Chat messages to one prompt string through a Jinja chat template (frontend process).

Shared by the HTTP server's /v1/chat/completions, /v1/responses, /tokenize and `LLM.chat`: the template
is the caller's (a file given to `coreserve serve --chat-template`) or else the tokenizer's own; a model
without one cannot chat. It renders in the engine's TemplateSandbox, never in this process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

TEXT_PART_SEPARATOR = "\n"  # vLLM's "string" content format joins a message's text parts this way


# Names the template call itself takes: a request's own template variables cannot be these
RESERVED_TEMPLATE_NAMES = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
))


def chat_render_args(
    tokenizer,
    messages: Sequence[Mapping],
    chat_template: str | None,
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
    template_kwargs: Mapping | None = None,
) -> tuple[str, list[dict], list[dict] | None, dict, bool]:
    """`TemplateSandbox.render`'s arguments for `messages` (each {"role", "content"}, content a string or
    a list of {"type": "text", "text"} parts), with the `tools` ({"type": "function", "function": {...}}
    each) and the template's own variables (`enable_thinking`, ...) for templates that read them: what
    `apply_chat_template` hands its renderer (the template it picks, the tokenizer's special tokens
    beside the caller's variables), so that the sandbox's text is its text. Raises ValueError when
    neither a template nor the tokenizer's own is there, or when a message is malformed."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "this model has no chat template: start the server with --chat-template FILE "
            "(or pass chat_template) to use chat"
        )
    if not messages:
        raise ValueError("messages must hold at least one message")
    flat = [_flatten(i, message) for i, message in enumerate(messages)]
    extra = dict(template_kwargs or {})
    taken = sorted(RESERVED_TEMPLATE_NAMES & set(extra))
    if taken:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}")
    template = tokenizer.get_chat_template(template, tools)  # a name of one of several templates, too
    return template, flat, tools, {**tokenizer.special_tokens_map, **extra}, add_generation_prompt


def _flatten(index: int, message: Mapping) -> dict:
    """A message with its content as one string; other keys (name, ...) pass through to the template."""
    if "role" not in message:
        raise ValueError(f"messages[{index}] has no role")
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = TEXT_PART_SEPARATOR.join(_part_text(index, part) for part in content)
    flat = {**{k: v for k, v in message.items() if v is not None}, "content": text}
    return _decoded_calls(flat) if flat.get("role") == "assistant" and flat.get("tool_calls") else flat


def _decoded_calls(message: dict) -> dict:
    """An assistant's calls with their arguments as objects: OpenAI's messages carry them as JSON text,
    and templates read objects (`tool_call.arguments | tojson`), as vLLM hands them over."""
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except (ValueError, RecursionError):
                pass  # as written: a template that needs an object says so
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def _part_text(index: int, part: Mapping) -> str:
    if part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise ValueError(
            f"messages[{index}].content: only {{'type': 'text', 'text': ...}} parts are supported"
        )
    return part["text"]
