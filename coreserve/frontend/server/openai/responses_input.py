"""A Responses API body, and the chat request it asks for (frontend process, HTTP server): instructions
and input items to messages (an assistant's message, reasoning and calls in a row are one assistant
message; a call's output a tool message), flat function tools to chat's, `text.format` to
`response_format`, `max_output_tokens` to `max_tokens`. What it cannot be is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict

from coreserve.frontend.server.common.errors import APIError
from coreserve.frontend.server.common.fields import Int64, StrictBody, Text
from coreserve.frontend.server.openai.schemas import ChatCompletionRequest

LOGPROBS = "message.output_text.logprobs"


class ResponsesRequest(StrictBody):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    model: str | None = None
    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: Int64 | None = None
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # its effort: harmony's (--reasoning-parser openai_gptoss)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension, as on chat
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses body asks for; a 400 naming what it cannot."""
    if body.previous_response_id is not None:  # (store: true is answered store: false, as vLLM without storage)
        raise APIError(400, "responses are not stored: send the whole conversation in input", "previous_response_id")
    if body.background:
        raise APIError(400, "background responses are not implemented", "background")
    unknown = sorted(set(body.include or []) - {LOGPROBS, "reasoning.encrypted_content"})
    if unknown:
        raise APIError(400, f"include: {unknown[0]} is not supported", "include")
    fields: dict[str, Any] = {"model": body.model, "messages": messages_of(body), "stream": body.stream}
    if body.tools is not None:
        fields["tools"] = [_chat_tool(tool) for tool in body.tools]
    if isinstance(body.tool_choice, dict):
        if body.tool_choice.get("type") != "function" or not isinstance(body.tool_choice.get("name"), str):
            raise APIError(400, "tool_choice: only function tools are served", "tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice["name"]}}
    elif body.tool_choice is not None:
        fields["tool_choice"] = body.tool_choice
    names = {"parallel_tool_calls": "parallel_tool_calls", "max_output_tokens": "max_tokens",
             "temperature": "temperature", "top_p": "top_p", "user": "user",
             "chat_template_kwargs": "chat_template_kwargs"}
    fields.update({chat: getattr(body, name) for name, chat in names.items() if getattr(body, name) is not None})
    if (body.reasoning or {}).get("effort") is not None:  # checked by create_response, named `reasoning`
        fields["reasoning_effort"] = body.reasoning["effort"]
    if LOGPROBS in (body.include or []):
        fields["logprobs"], fields["top_logprobs"] = True, body.top_logprobs or 0
    if (body.text or {}).get("verbosity") is not None:
        raise APIError(400, "text.verbosity is not implemented", "text")
    text_format = (body.text or {}).get("format")
    if text_format is not None and text_format.get("type") != "text":
        if text_format.get("type") == "json_schema":
            schema = {k: text_format[k] for k in ("name", "description", "strict") if k in text_format}
            fields["response_format"] = {"type": "json_schema", "json_schema": {**schema, "schema": text_format.get("schema")}}
        else:
            fields["response_format"] = {"type": text_format.get("type")}
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValueError as exc:
        raise APIError(400, f"this request does not make a chat request: {exc}", "input") from exc


def _chat_tool(tool: dict) -> dict:
    if tool.get("type") != "function":
        raise APIError(400, f"tools: {tool.get('type')!r} tools are not served (function tools are)", "tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def messages_of(body: ResponsesRequest) -> list[dict]:
    """Instructions and input items as chat messages: an assistant's message, reasoning and calls in a
    row are one assistant message; a call's output is a tool message."""
    messages: list[dict] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for index, item in enumerate(body.input):
        kind = item.get("type", "message")
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message":
            role, text = item.get("role"), _text_of(index, item.get("content"))
            if role == "assistant" and last is not None and not last.get("content") and not last.get("tool_calls"):
                last["content"] = text  # after its reasoning
            else:
                messages.append({"role": role, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            messages.append({"role": "assistant", "content": "",
                             "reasoning_content": "".join(p.get("text", "") for p in parts)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if last is None:
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text_of(index, item.get("output"))})
        else:
            raise APIError(400, f"input[{index}]: items of type {kind!r} are not served", "input")
    return messages


def _text_of(index: int, content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in ("input_text", "output_text") for p in content
    ):
        return "".join(p.get("text", "") for p in content)
    raise APIError(400, f"input[{index}]: content must be text (input_text or output_text parts)", "input")
