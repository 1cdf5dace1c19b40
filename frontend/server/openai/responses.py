"""POST /v1/responses: OpenAI's Responses API as a thin layer over chat (frontend process, HTTP server).

The body becomes a chat request (instructions and input items to messages, flat function tools to
chat's, `text.format` to `response_format`, `max_output_tokens` to `max_tokens`) and runs as one;
its answer becomes the Response's output items, in OpenAI's order: reasoning (`--reasoning-parser`), the
message, the function calls. Streamed, the chat chunks become Responses events, ending in
`response.completed` (with status "incomplete" where the tokens ran out, as vLLM). Nothing is stored:
`previous_response_id`, `store: true` and `background` are refused by name. docs/serving.md.
"""

from __future__ import annotations

import itertools
import secrets
import time
from typing import Any, Literal

from pydantic import ConfigDict
from starlette.requests import Request
from starlette.responses import Response

from frontend.server.common.errors import APIError
from frontend.server.common.fields import Int64, StrictBody, Text
from frontend.server.common.logprob_json import JSONBytesResponse
from frontend.server.common.transport import sse_response, until_disconnected
from frontend.server.openai.chat import start_chat
from frontend.server.openai.schemas import ChatCompletionRequest

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
    reasoning: dict[str, Any] | None = None  # the reasoning is the model's own (--reasoning-parser)
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


async def create_response(request: Request, body: ResponsesRequest) -> Response:
    try:
        chat_body = chat_request(body)
    except (AttributeError, TypeError, KeyError) as exc:  # an item or part of the wrong shape
        raise APIError(400, f"input or text has an item of the wrong shape: {exc}", "input") from exc
    response = await start_chat(request.app.state.server, chat_body, prefix="resp")
    shape = ResponseShape(body, response.generation.request_id, response.server.answer_name(response.generation.params.lora))
    if body.stream:
        from frontend.server.common.inputs import start_checked

        await start_checked(response.generation, chat_body)
        return sse_response(shape.events(response.chunks()), response.generation.close)
    return await until_disconnected(request, _whole(shape, response))


async def _whole(shape: ResponseShape, response) -> Response:
    chat = await response.whole_body()
    return JSONBytesResponse(shape.response(chat["choices"][0], chat["usage"]))


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses body asks for; a 400 naming what it cannot."""
    if body.previous_response_id is not None or body.store:
        raise APIError(400, "responses are not stored: send the whole conversation in input", "previous_response_id"
                       if body.previous_response_id is not None else "store")
    if body.background:
        raise APIError(400, "background responses are not implemented", "background")
    if (body.reasoning or {}).get("effort") is not None:
        raise APIError(400, "reasoning.effort is not implemented: the model reasons as its template makes it",
                       "reasoning")
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


class ResponseShape:
    """A chat answer (whole, or its chunks) as a Response and its events."""

    def __init__(self, body: ResponsesRequest, request_id: str, model: str) -> None:
        self.body, self.model = body, model
        self.id = request_id
        self.created = int(time.time())
        self._sequence = itertools.count()

    def envelope(self, status: str, output: list[dict], usage: dict | None, finish: str | None = None) -> dict:
        incomplete = status == "incomplete"
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": status, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": body.reasoning, "store": False,
            "temperature": body.temperature, "top_p": body.top_p, "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "truncation": "disabled",
            "user": body.user, "usage": self._usage(usage),
        }

    def _usage(self, usage: dict | None) -> dict | None:
        if usage is None:
            return None
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return {
            "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }

    def response(self, choice: dict, usage: dict) -> dict:
        message, status = choice["message"], _status(choice["finish_reason"])
        output = []
        if message.get("reasoning_content"):
            output.append(_reasoning_item(_new_id("rs"), message["reasoning_content"], "completed"))
        if message.get("content"):
            logprobs = (choice.get("logprobs") or {}).get("content")
            output.append(_message_item(_new_id("msg"), message["content"], status, logprobs))
        for call in message.get("tool_calls") or []:
            output.append(_call_item(_new_id("fc"), call["id"], call["function"]["name"],
                                     call["function"]["arguments"], "completed"))
        return self.envelope(status, output, usage)

    def _event(self, kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(self._sequence), **fields}

    async def events(self, chunks):
        """Chat chunks to Responses events: each item opened, its deltas, closed before the next."""
        yield self._event("response.created", response=self.envelope("in_progress", [], None))
        yield self._event("response.in_progress", response=self.envelope("in_progress", [], None))
        output: list[dict] = []
        open_item: dict | None = None  # the reasoning or message item being written
        calls: dict[int, dict] = {}
        usage, finish = None, None
        every_logprob: list[dict] = []  # every generated token's, as the whole answer's message carries
        async for chunk in chunks:
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta, finish = choice["delta"], choice.get("finish_reason") or finish
                logprobs = (choice.get("logprobs") or {}).get("content") or []
                every_logprob += logprobs
                for kind, text in (("reasoning", delta.get("reasoning_content")), ("message", delta.get("content"))):
                    if not text:
                        continue
                    if open_item is None or open_item["type"] != kind:
                        for event in self._close(open_item, output, every_logprob):
                            yield event
                        open_item = self._open(kind, output)
                        yield self._event("response.output_item.added", output_index=len(output) - 1,
                                          item=_opened(open_item))
                        yield self._event("response.content_part.added", output_index=len(output) - 1,
                                          item_id=open_item["id"], content_index=0, part=_part(kind, ""))
                    open_item["text"] += text
                    name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                    extra = {} if kind == "reasoning" else {"logprobs": logprobs}
                    yield self._event(name, output_index=len(output) - 1, item_id=open_item["id"],
                                      content_index=0, delta=text, **extra)
                for call in delta.get("tool_calls") or []:
                    if call["index"] not in calls:
                        for event in self._close(open_item, output, every_logprob):
                            yield event
                        open_item = None
                        function = call["function"]
                        item = _call_item(_new_id("fc"), call["id"], function["name"], "", "in_progress")
                        calls[call["index"]] = item
                        output.append(item)
                        yield self._event("response.output_item.added", output_index=len(output) - 1, item=dict(item))
                    item = calls[call["index"]]
                    arguments = call["function"].get("arguments") or ""
                    if arguments:
                        item["arguments"] += arguments
                        yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=output.index(item), delta=arguments)
        for event in self._close(open_item, output, every_logprob):
            yield event
        for item in output:
            if item["type"] == "message":
                item["content"][0]["logprobs"] = every_logprob
        for item in calls.values():
            item["status"] = "completed"
            index = output.index(item)
            yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=item["arguments"], name=item["name"])
            yield self._event("response.output_item.done", output_index=index, item=dict(item))
        status = _status(finish)
        yield self._event("response.completed", response=self.envelope(status, output, usage))

    def _open(self, kind: str, output: list[dict]) -> dict:
        item = {"type": kind, "id": _new_id("rs" if kind == "reasoning" else "msg"), "text": ""}
        output.append(item)
        return item

    def _close(self, item: dict | None, output: list[dict], logprobs: list[dict]):
        """The done events of a reasoning or message item; the item becomes its final form in output."""
        if item is None:
            return []
        index = output.index(item)
        kind, text = item["type"], item["text"]
        final = (_reasoning_item(item["id"], text, "completed") if kind == "reasoning"
                 else _message_item(item["id"], text, "completed", list(logprobs)))
        output[index] = final
        done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        extra = {} if kind == "reasoning" else {"logprobs": list(logprobs)}
        return [
            self._event(done, output_index=index, item_id=item["id"], content_index=0, text=text, **extra),
            self._event("response.content_part.done", output_index=index, item_id=item["id"], content_index=0,
                        part=final["content"][0]),
            self._event("response.output_item.done", output_index=index, item=final),
        ]


def _opened(item: dict) -> dict:
    """A reasoning or message item as output_item.added announces it: empty, in progress."""
    if item["type"] == "reasoning":
        return {"type": "reasoning", "id": item["id"], "summary": [], "content": [], "status": "in_progress"}
    return {"type": "message", "id": item["id"], "role": "assistant", "status": "in_progress", "content": []}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str, logprobs: list | None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": [part]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
