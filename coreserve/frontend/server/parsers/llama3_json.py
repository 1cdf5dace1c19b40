"""Llama 3.1 to 3.3's JSON tool calls (frontend process, HTTP server): `{"name": ..., "parameters":
{...}}` (or "arguments"), after an optional `<|python_tag|>`, several separated by `;`.

As vLLM reads them: every object in the reply that is a call is one, and a reply with calls has no
content; one with none is all content. While streaming, a reply that begins with `{` or the tag is held
as calls; one that begins otherwise is sent as content up to its first `{` or tag, the rest held until
the end shows whether it held calls (the prose before them was sent: the one way a stream differs).
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

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def scan(text: str, final: bool) -> list[Part]:
    if final:
        calls = _all_calls(text)
        return calls if calls else [text]
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        return _leading_calls(text, len(text) - len(body) + len(PYTHON_TAG))
    if body.startswith("{"):
        return _leading_calls(text, len(text) - len(body))
    if PYTHON_TAG.startswith(body):
        return []
    opens = [at for at in (text.find("{"), text.find(PYTHON_TAG)) if at != -1]
    if opens:
        return [text[: min(opens)]]  # prose, then what may be calls
    return [text[: len(text) - held_back(text, PYTHON_TAG)]]


def _leading_calls(text: str, pos: int) -> list[Part]:
    """The whole calls at the start of a reply still being written (the rest waits for more text)."""
    calls: list[Part] = []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return calls
        call = _call(obj)
        if call is None:
            return calls
        calls.append(call)


def _all_calls(text: str) -> list[Part]:
    calls: list[Part] = []
    pos = text.find("{")
    while pos != -1:
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            pos = text.find("{", pos + 1)
            continue
        call = _call(obj)
        if call is not None:
            calls.append(call)
        pos = text.find("{", end)
    return calls


def _call(obj: object) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in ("arguments", "parameters"):
        if key in obj:
            arguments = arguments_text(obj[key])
            return None if arguments is None else ToolCall(obj["name"], arguments)
    return None


FORMAT = CallFormat("llama3_json", scan, make_id=call_id)
