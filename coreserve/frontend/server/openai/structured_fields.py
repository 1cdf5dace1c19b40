"""The request fields that ask for structured output, on completions and chat (frontend process, HTTP).

OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's `structured_outputs` object and
vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` all become one
`StructuredOutputsParams`; asking for two at once is a 400 naming the second, and a grammar that does
not parse (coreserve/frontend/engine/structured_outputs.py) a 400 naming the field that held it.
docs/structured_outputs.md.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from coreserve.frontend.engine.structured_outputs import check_structured_outputs
from coreserve.frontend.server.common.errors import APIError
from coreserve.protocol.structured_outputs import StructuredOutputsParams

_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class _Fields(BaseModel):
    model_config = _CONFIG


class JsonSchemaFormat(_Fields):
    name: str | None = None  # OpenAI requires it; it changes nothing here
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(_Fields):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Fields):
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(_Fields):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


async def parse_grammar_off_the_loop(body: StructuredFields) -> None:
    """The body's grammar parsed on a worker thread before the handler builds its SamplingParams, whose
    own check then finds it cached: the first grammar imports xgrammar (and torch, 1.4 s here, ~3 s
    elsewhere) and a large schema takes a while to parse, and every other client waited on the event
    loop meanwhile. A malformed body is the same 400 either way."""
    if any(getattr(body, name) is not None for name in StructuredFields.model_fields):
        await asyncio.to_thread(structured_outputs_of, body)


def structured_outputs_of(body: StructuredFields) -> StructuredOutputsParams | None:
    """The body's one structured-output request, or None; a 400 naming the field when it is malformed
    or a second one is set."""
    asked: list[tuple[str, dict]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs json_schema", "response_format")
        asked.append(("response_format", {"json": fmt.json_schema.json_schema}))
    if body.structured_outputs is not None:
        fields = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        asked.append(("structured_outputs", fields))
    for name, kind in _GUIDED.items():
        if getattr(body, name) is not None:
            asked.append((name, {kind: getattr(body, name)}))
    if not asked:
        return None
    if len(asked) > 1:
        name = asked[1][0]
        raise APIError(400, f"{name} cannot be combined with {asked[0][0]}: ask for one output format", name)
    name, fields = asked[0]
    try:
        params = StructuredOutputsParams(**fields)
        check_structured_outputs(params)  # here, to name the body's field; the engine's check is cached
        return params
    except ValueError as exc:
        raise APIError(400, f"{name}: {exc}", name) from exc
