"""POST /v1/responses: OpenAI's Responses API as a thin layer over chat (frontend process, HTTP server).

The body becomes a chat request (instructions and input items to messages, flat function tools to
chat's, `text.format` to `response_format`, `max_output_tokens` to `max_tokens`) and runs as one;
its answer becomes the Response's output items, in OpenAI's order: reasoning (`--reasoning-parser`), the
message, the function calls. Streamed, the chat chunks become Responses events, ending in
`response.completed` (with status "incomplete" where the tokens ran out, as vLLM). `reasoning.effort` is
harmony's (gpt-oss; a 400 naming `reasoning` elsewhere). Nothing is stored (`store: true` is answered
`store: false`, as vLLM's without storage): `previous_response_id` and `background` are refused by name.
docs/serving.md.
"""

from __future__ import annotations

import itertools
import secrets
import time

from starlette.requests import Request
from starlette.responses import Response

from coreserve.frontend.server.common.errors import APIError
from coreserve.frontend.server.common.inputs import start_checked
from coreserve.frontend.server.common.logprob_json import JSONBytesResponse
from coreserve.frontend.server.common.transport import (
    CLIENT_CLOSED_REQUEST,
    ClientGone,
    sse_response,
    unless_disconnected,
    until_disconnected,
)
from coreserve.frontend.server.openai.chat import start_chat
from coreserve.frontend.server.openai.harmony_fields import check_reasoning_effort
from coreserve.frontend.server.openai.responses_input import ResponsesRequest, chat_request


async def create_response(request: Request, body: ResponsesRequest) -> Response:
    check_reasoning_effort(request.app.state.server, (body.reasoning or {}).get("effort"), "reasoning")
    try:
        chat_body = chat_request(body)
    except (AttributeError, TypeError, KeyError) as exc:  # an item or part of the wrong shape
        raise APIError(400, f"input or text has an item of the wrong shape: {exc}", "input") from exc
    try:  # a client gone while its template renders stops the render
        response = await unless_disconnected(request, start_chat(request.app.state.server, chat_body, prefix="resp"))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    shape = ResponseShape(body, response.generation.request_id, response.server.answer_name(response.generation.params.lora))
    if body.stream:
        await start_checked(response.generation, chat_body)
        return sse_response(shape.events(response.chunks()), response.generation.close)
    return await until_disconnected(request, _whole(shape, response))


async def _whole(shape: ResponseShape, response) -> Response:
    chat = await response.whole_body()
    return JSONBytesResponse(shape.response(chat["choices"][0], chat["usage"]))


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
        """Chat chunks to Responses events: each item opened, its deltas, and closed before the next opens."""
        yield self._event("response.created", response=self.envelope("in_progress", [], None))
        yield self._event("response.in_progress", response=self.envelope("in_progress", [], None))
        self.output: list[dict] = []
        self.open_item: dict | None = None  # the reasoning, message or call being written
        self.logprobs: list[dict] = []  # every generated token's, as the whole answer's message carries
        calls: dict[int, dict] = {}
        usage, finish = None, None
        async for chunk in chunks:
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta, finish = choice["delta"], choice.get("finish_reason") or finish
                logprobs = (choice.get("logprobs") or {}).get("content") or []
                self.logprobs += logprobs
                for kind, text in (("reasoning", delta.get("reasoning_content")), ("message", delta.get("content"))):
                    if text:
                        for event in self._text(kind, text, logprobs):
                            yield event
                for call in delta.get("tool_calls") or []:
                    if call["index"] not in calls:
                        for event in self._close("completed"):
                            yield event
                        function = call["function"]
                        calls[call["index"]] = self.open_item = _call_item(
                            _new_id("fc"), call["id"], function["name"], "", "in_progress")
                        self.output.append(self.open_item)
                        yield self._event("response.output_item.added", output_index=len(self.output) - 1,
                                          item=dict(self.open_item))
                    item = calls[call["index"]]
                    arguments = call["function"].get("arguments") or ""
                    if arguments:
                        item["arguments"] += arguments
                        yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self.output.index(item), delta=arguments)
        status = _status(finish)
        for event in self._close(status):
            yield event
        for item in self.output:
            if item["type"] == "message":
                item["content"][0]["logprobs"] = self.logprobs
        yield self._event("response.completed", response=self.envelope(status, self.output, usage))

    def _text(self, kind: str, text: str, logprobs: list[dict]):
        """A reasoning or message delta, in its item (opened here after closing another)."""
        events = []
        if self.open_item is None or self.open_item["type"] != kind:
            events += self._close("completed")
            self.open_item = {"type": kind, "id": _new_id("rs" if kind == "reasoning" else "msg"), "text": ""}
            self.output.append(self.open_item)
            index = len(self.output) - 1
            events.append(self._event("response.output_item.added", output_index=index, item=_opened(self.open_item)))
            events.append(self._event("response.content_part.added", output_index=index,
                                      item_id=self.open_item["id"], content_index=0, part=_part(kind, "")))
        self.open_item["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": logprobs}
        events.append(self._event(name, output_index=len(self.output) - 1, item_id=self.open_item["id"],
                                  content_index=0, delta=text, **extra))
        return events

    def _close(self, status: str) -> list[dict]:
        """The done events of the open item, which becomes its final form in the output."""
        item, self.open_item = self.open_item, None
        if item is None:
            return []
        index = self.output.index(item)
        if item["type"] == "function_call":
            item["status"] = "completed"
            return [
                self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"], name=item["name"]),
                self._event("response.output_item.done", output_index=index, item=dict(item)),
            ]
        kind, text = item["type"], item["text"]
        final = (_reasoning_item(item["id"], text, "completed") if kind == "reasoning"
                 else _message_item(item["id"], text, status, list(self.logprobs)))
        self.output[index] = final
        done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        extra = {} if kind == "reasoning" else {"logprobs": list(self.logprobs)}
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
