"""A chat request's `tools` and `tool_choice` (frontend process, HTTP server): checked as vLLM checks
them, the tools handed to the chat template, and what each choice asks of the output.

- `none`: the template still sees the tools; the reply is text, not parsed.
- `auto` (the default when tools are given): the reply is parsed by the server's `--tool-call-parser`
  (needs `--enable-auto-tool-choice`); text without calls stays text.
- `required`: the output is held by the grammar to a JSON list of `{"name", "parameters"}` objects, one
  of the tools each, as vLLM builds it; `parallel_tool_calls: false` keeps the first call.
- a named function: the output is held to that function's parameters schema and is its arguments.

A server that reads harmony (gpt-oss) reads every reply through its `openai` format, and holds `required`
and a named function to one harmony call message instead (openai/harmony_fields.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from coreserve.frontend.server.common.errors import APIError
from coreserve.frontend.server.common.fields import StrictBody
from coreserve.frontend.server.openai.harmony_fields import speaks_harmony
from coreserve.frontend.server.parsers.splitter import TOOL_FORMATS
from coreserve.frontend.server.parsers.tool_calls import CallFormat
from coreserve.protocol.structured_outputs import StructuredOutputsParams


class FunctionDefinition(StrictBody):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the grammar holds `required` and named calls to the schema either way


class ChatTool(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tool choice asks of its output."""

    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None  # the named function
    fmt: CallFormat | None = None  # auto's parser; under harmony, every choice's
    parallel: bool = True
    grammar: StructuredOutputsParams | None = None  # required's and named's
    # harmony's required and named: the (name, parameters) a call may be, whose grammar is built off the
    # event loop (harmony_fields.call_grammar, by start_chat)
    harmony_calls: tuple[tuple[str, dict], ...] = ()


NO_TOOLS = ToolPlan("none")


def tool_plan(server, body) -> ToolPlan:
    """The request's plan; a 400 in vLLM's words for a choice that cannot be served."""
    tools, choice = body.tools, body.tool_choice
    if tools is not None and not tools:
        message = "`tools` must not be an empty array. Either provide at least one tool or omit the field."
        raise APIError(400, message, "tools")
    names = [tool.function.name for tool in tools or []]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise APIError(400, f"tools: more than one tool is named {twice[0]!r}", "tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise APIError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
    parallel = body.parallel_tool_calls is not False
    harmony = TOOL_FORMATS["openai"] if speaks_harmony(server) else None
    if choice == "none":
        return NO_TOOLS if harmony is None else ToolPlan("none", fmt=harmony)
    if choice == "auto":
        if not server.enable_auto_tool_choice or server.tool_call_parser is None:
            message = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
            raise APIError(400, message, "tool_choice")
        return ToolPlan("auto", fmt=TOOL_FORMATS[server.tool_call_parser], parallel=parallel)
    if choice == "required":
        if harmony is not None:
            calls = tuple((tool.function.name, tool.function.parameters or _EMPTY_OBJECT) for tool in tools)
            return ToolPlan("required", fmt=harmony, parallel=parallel, harmony_calls=calls)
        return ToolPlan("required", parallel=parallel, grammar=_grammar(_required_schema(tools)))
    functions = {tool.function.name: tool.function for tool in tools}
    if choice.function.name not in functions:
        message = "The tool specified in `tool_choice` does not match any of the specified `tools`"
        raise APIError(400, message, "tool_choice")
    name = choice.function.name
    parameters = functions[name].parameters or _EMPTY_OBJECT
    if harmony is not None:
        return ToolPlan("named", name=name, fmt=harmony, parallel=parallel, harmony_calls=((name, parameters),))
    return ToolPlan("named", name=name, parallel=parallel, grammar=_grammar(parameters))


_EMPTY_OBJECT = {"type": "object", "properties": {}}


def _required_schema(tools: list[ChatTool]) -> dict:
    """vLLM's schema for `required`: a list of one or more calls, each one tool's name and parameters;
    the tools' `$defs` (and draft-07's `definitions`) gathered at the top, where `#/$defs/...` references
    point. A reference by path into a tool's own schema (`#/properties/...`, `#`) does not survive the
    move: the grammar refuses it, a 400 naming `tools`."""
    gathered: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    variants = []
    for tool in tools:
        parameters = dict(tool.function.parameters or _EMPTY_OBJECT)
        for key, defs in gathered.items():
            for name, schema in (parameters.pop(key, None) or {}).items():
                if name in defs and defs[name] != schema:
                    message = f"Tool definition '{name}' has multiple schemas, which is not supported."
                    raise APIError(400, message, "tools")
                defs[name] = schema
        variants.append({
            "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    schema.update({key: defs for key, defs in gathered.items() if defs})
    return schema


def _grammar(schema: dict) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as exc:
        raise APIError(400, f"tools: {exc}", "tools") from exc


def template_tools(body) -> list[dict] | None:
    """The tools as the template reads them: OpenAI's `{"type": "function", "function": {...}}`."""
    if not body.tools:
        return None
    return [tool.model_dump(exclude_unset=True) for tool in body.tools]
