"""Pythonic tool calls, as Llama 3.2 and 4 and several small models write them (frontend process, HTTP
server): the reply is one Python list of calls with keyword arguments,

    [get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]

optionally between `<|python_start|>` and `<|python_end|>`. The arguments are Python literals, written
back as JSON. A reply that is not such a list is content; the list is decided when the text ends.
"""

from __future__ import annotations

import ast
import json

from coreserve.frontend.server.parsers.tool_calls import CallFormat, Part, ToolCall, call_id

START, END = "<|python_start|>", "<|python_end|>"


def scan(text: str, final: bool) -> list[Part]:
    body = text.strip()
    if not final:
        opens = body.startswith(("[", START)) or START.startswith(body)
        return [] if opens else [text]
    if body.startswith(START):
        body = body[len(START) :].removesuffix(END).strip()
    calls = _calls(body) if body.startswith("[") else None
    return [text] if calls is None else calls


def _calls(body: str) -> list[Part] | None:
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    if not all(isinstance(node, ast.Call) and _name(node.func) for node in tree.elts):
        return None
    calls: list[Part] = []
    for node in tree.elts:
        if node.args or any(kw.arg is None for kw in node.keywords):
            continue  # positional or ** arguments: no call (as vLLM, the others stay)
        try:
            arguments = {kw.arg: _literal(kw.value) for kw in node.keywords}
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError):
            continue  # not a JSON value (bytes, 1e999)
        calls.append(ToolCall(_name(node.func), text))
    return calls or None


def _name(func: ast.expr) -> str:
    """A called name, dotted names included (`tools.search`); "" for anything else."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and _name(func.value):
        return f"{_name(func.value)}.{func.attr}"
    return ""


_JSON_NAMES = {"null": None, "true": True, "false": False}


def _literal(node: ast.expr) -> object:
    """A Python literal (JSON's null, true and false too) as a JSON value."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    value = ast.literal_eval(node)
    if isinstance(value, (bytes, complex, set)):
        raise ValueError("not a JSON value")
    return value


FORMAT = CallFormat("pythonic", scan, make_id=call_id)
