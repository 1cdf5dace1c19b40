"""Mistral's tool calls (frontend process, HTTP server): the content, then `[TOOL_CALLS]` and either a
JSON list of `{"name": ..., "arguments": {...}}` (tokenizers before v11) or `name{arguments}` (v11 on,
`[TOOL_CALLS]` before each). As vLLM reads them: the text before the first marker is the content, what
follows the calls is dropped, and a list that does not parse is looked for as `[{...}]` in the text
after the marker, else that text is the content. Calls carry Mistral's nine-character ids, which its
templates require.
"""

from __future__ import annotations

import json
import re

from coreserve.frontend.server.parsers.tool_calls import (
    CallFormat,
    Part,
    ToolCall,
    arguments_text,
    held_back,
    mistral_call_id,
)

MARKER = "[TOOL_CALLS]"
_DECODER = json.JSONDecoder()
_NAME = re.compile(r"[\w.\-]+")
_LIST = re.compile(r"\[\s*\{.*\}\s*\]", re.DOTALL)


def scan(text: str, final: bool) -> list[Part]:
    start = text.find(MARKER)
    if start == -1:
        return [text if final else text[: len(text) - held_back(text, MARKER)]]
    rest = text[start + len(MARKER) :]
    head = rest.lstrip()
    brace = head.find("{")
    if brace != -1 and _NAME.fullmatch(head[:brace].replace("[ARGS]", "").strip()):
        return [text[:start], *_named_calls(rest, final)]
    if not head.startswith("[") and not final:
        return [text[:start]]  # a name still being written, or no list yet
    try:
        items, _ = _DECODER.raw_decode(head)
    except ValueError:
        items = None
    if items is None and not final:
        return [text[:start]]
    if items is None:
        found = _LIST.search(head)
        try:
            items = json.loads(found.group(0)) if found else None
        except ValueError:
            items = None
    if not isinstance(items, list):
        return [text[:start], head.strip()]
    return [text[:start], *(c for c in map(_call, items) if c is not None)]


def _named_calls(rest: str, final: bool) -> list[Part]:
    """v11's `name{arguments}` calls, each after its own marker."""
    segments = rest.split(MARKER)
    calls: list[Part] = []
    for index, segment in enumerate(segments):
        is_last = index == len(segments) - 1
        brace = segment.find("{")
        if brace == -1:
            if is_last and not final:
                break
            continue  # a name without arguments: no call, as vLLM
        name = segment[:brace].replace("[ARGS]", "").strip()
        try:
            arguments, _ = _DECODER.raw_decode(segment, brace)
            text = arguments_text(arguments)
        except ValueError:
            if is_last and not final:
                break  # not whole yet
            text = None
        if text is None:
            text = segment[brace:].strip()  # as vLLM: the arguments as written
        calls.append(ToolCall(name, text))
    return calls


def _call(item: object) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = arguments_text(item.get("arguments", {}))
    return None if arguments is None else ToolCall(item["name"], arguments)


FORMAT = CallFormat("mistral", scan, make_id=mistral_call_id)
