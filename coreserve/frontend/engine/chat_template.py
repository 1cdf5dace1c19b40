"""The one chat renderer: chat messages to one prompt string through a Jinja chat template, and that
string to its token ids (frontend process).

`ChatRenderer` is how every chat is rendered: the HTTP server's /v1/chat/completions, /v1/responses and
/tokenize (`render_async`) and `LLM.chat` (`render`), so one conversation gives one text either way. The
template is the caller's (a file given to `coreserve serve --chat-template`, or LLM.chat's argument) or
else the tokenizer's own; a model without one cannot chat. It renders in the engine's TemplateSandbox,
never in this process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coreserve.frontend.engine.template_sandbox import TemplateSandbox

TEXT_PART_SEPARATOR = "\n"  # vLLM's "string" content format joins a message's text parts this way


# Names the template call itself takes: a request's own template variables cannot be these
RESERVED_TEMPLATE_NAMES = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
))


class ChatRenderer:
    """A tokenizer's conversations through one template (`chat_template`, else the tokenizer's own) in
    the engine's sandbox. Each render's ValueError names what is wrong (no template, a malformed message,
    a reserved template variable, a limit the sandbox enforces)."""

    def __init__(self, tokenizer, templates: TemplateSandbox, chat_template: str | None = None) -> None:
        self.tokenizer, self.templates, self.chat_template = tokenizer, templates, chat_template

    @property
    def template(self) -> str | dict | None:
        """The template renders use: the given one, else the tokenizer's (a dict where it has several)."""
        if self.chat_template is not None:
            return self.chat_template
        return getattr(self.tokenizer, "chat_template", None)

    def render(
        self,
        messages: Sequence[Mapping],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: Mapping | None = None,
    ) -> str:
        return self.templates.render(*self._args(messages, add_generation_prompt, tools, template_kwargs))

    async def render_async(
        self,
        messages: Sequence[Mapping],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: Mapping | None = None,
    ) -> str:
        """`render` off the event loop; cancelling the awaiting task kills the render."""
        args = self._args(messages, add_generation_prompt, tools, template_kwargs)
        return await self.templates.render_async(*args)

    def _args(self, messages, add_generation_prompt, tools, template_kwargs) -> tuple:
        return chat_render_args(
            self.tokenizer, messages, self.chat_template, add_generation_prompt, tools, template_kwargs
        )

    def prompt_token_ids(self, text: str) -> list[int]:
        """A rendered chat's token ids for LLM.chat: special tokens added only where the template did not
        write the BOS itself (the server tokenizes under the request's add_special_tokens, vLLM's rule)."""
        bos = getattr(self.tokenizer, "bos_token", None)
        has_bos = bool(bos) and text.startswith(bos)
        return list(self.tokenizer(text, add_special_tokens=not has_bos).input_ids)


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
