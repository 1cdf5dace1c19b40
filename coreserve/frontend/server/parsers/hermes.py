"""Hermes' tool calls, as Qwen2.5, Qwen3 and Hermes 2/3 write them (frontend process, HTTP server):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. As vLLM reads them: the content is the text before the first block (text between
and after the blocks is dropped); a block left open at the end is a call if its JSON is whole; and when
the first block is not a call, there are no calls and the whole text is the content. A block that is not
a call after calls (a second call cut short by max_tokens) ends the calls, which are kept: the streamed
calls cannot be taken back.
"""

from __future__ import annotations

import json

from coreserve.frontend.server.parsers.tool_calls import (
    CallFormat,
    Part,
    ToolCall,
    arguments_text,
    call_id,
    held_back,
)

START, END = "<tool_call>", "</tool_call>"


def scan(text: str, final: bool) -> list[Part]:
    first = text.find(START)
    if first == -1:
        return [text if final else text[: len(text) - held_back(text, START)]]
    parts: list[Part] = [text[:first]]
    pos = first
    while pos != -1:
        end = text.find(END, pos + len(START))
        if end == -1 and not final:
            return parts  # a block still open: decided when it closes
        body = text[pos + len(START) : end] if end != -1 else text[pos + len(START) :]
        call = _call(body)
        if call is None:
            if len(parts) > 1:
                return parts  # calls so far, then one that is not: the calls stand
            return [text] if final else parts  # the first is not a call: the whole text, once it has ended
        parts.append(call)
        pos = -1 if end == -1 else text.find(START, end + len(END))
    return parts


def _call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    arguments = arguments_text(obj["arguments"])
    return None if arguments is None else ToolCall(obj["name"], arguments)


FORMAT = CallFormat("hermes", scan, make_id=call_id)
