"""A chat request's messages to its prompt: the template, vLLM's `continue_final_message` and `echo`
(frontend process, HTTP server).

The template renders in the engine's sandbox (coreserve/frontend/engine/template_sandbox.py: a worker process under
a time limit, a text cap and a memory cap, killed when the request goes); tokenizing runs in a worker
thread, after a rendered text that cannot fit the context is refused untokenized, so that one long
conversation delays no other request's tokens.
"""

from __future__ import annotations

from coreserve.frontend.engine.chat_template import TEXT_PART_SEPARATOR
from coreserve.frontend.engine.template_sandbox import TemplateTooLong
from coreserve.frontend.server.common.errors import APIError
from coreserve.frontend.server.common.generation import PromptInput
from coreserve.frontend.server.common.inputs import tokenize
from coreserve.frontend.server.openai.harmony_fields import (
    check_effort_rendered,
    template_kwargs,
    with_thinking,
)
from coreserve.frontend.server.openai.schemas import ChatCompletionRequest
from coreserve.frontend.server.openai.tool_choice import template_tools

REPLY_ROLE = "assistant"


async def chat_prompt(server, body: ChatCompletionRequest) -> PromptInput:
    if body.continue_final_message and body.add_generation_prompt:
        message = "continue_final_message and add_generation_prompt cannot both be true"
        raise APIError(400, message, "continue_final_message")
    messages = with_thinking(server, [m.model_dump(exclude_none=True) for m in body.messages])
    text = await _render(server, messages, body)
    check_effort_rendered(body, text)
    token_ids = await tokenize(
        server, text, body.add_special_tokens, body.truncate_prompt_tokens, param="messages"
    )
    return PromptInput(text, token_ids)


async def render_messages(server, messages: list[dict], body) -> str:
    """The body's messages through the template (a chat's, a Responses' or /tokenize's body); a 400 naming
    `messages` for a malformed one, the template's own refusal (raise_exception) or a limit passed."""
    kwargs = template_kwargs(server, body)  # with a chat's reasoning_effort
    try:  # the server's one renderer, LLM.chat's too (coreserve/frontend/engine/chat_template.py)
        return await server.renderer.render_async(messages, body.add_generation_prompt, template_tools(body), kwargs)
    except TemplateTooLong as exc:  # the context's refusal where the length alone says it cannot fit
        server.prompt_bound.check_length(exc.num_chars, server.facts.max_model_len, "messages")
        raise APIError(400, str(exc), "messages") from exc
    except ValueError as exc:
        raise APIError(400, str(exc), "messages") from exc


async def _render(server, messages: list[dict], body: ChatCompletionRequest) -> str:
    text = await render_messages(server, messages, body)
    if not body.continue_final_message:
        return text
    final = message_text(messages[-1])
    end = text.rfind(final) if final else -1
    if end == -1:
        message = "continue_final_message: the chat template does not write the final message's content"
        raise APIError(400, message, "continue_final_message")
    return text[: end + len(final)]  # open-ended: whatever the template writes after the content is cut


def message_text(message: dict) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return TEXT_PART_SEPARATOR.join(part["text"] for part in content)


def echo_text(body: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the reply begins with the last message's content when that message is the
    reply's role (continuing it); otherwise there is nothing to echo."""
    if not body.echo:
        return ""
    last = body.messages[-1].model_dump(exclude_none=True)
    return message_text(last) if last.get("role") == REPLY_ROLE else ""
