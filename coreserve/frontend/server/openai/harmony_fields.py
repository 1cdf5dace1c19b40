"""What a server that reads harmony (gpt-oss: `--reasoning-parser openai_gptoss` or `--tool-call-parser
openai`) does with a chat request's own fields (frontend process, HTTP server; docs/serving.md, "gpt-oss's
harmony").

- `reasoning_effort` (`low`, `medium`, `high`; Responses' `reasoning.effort`) is the template's
  `reasoning_effort` variable, which gpt-oss's template writes into the system message as `Reasoning:
  high`; a template that does not write it is a 400 rather than an effort silently ignored.
- An assistant message's reasoning (`reasoning_content`, or vLLM's `reasoning`) is handed to the template
  as `thinking`, the name gpt-oss's template reads (it renders it before a call, as harmony asks).
- `required` and a named function hold the output by grammar to one harmony call message,
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` and arguments of the tool's
  schema, whitespace runs bounded (`<|call|>` is a stop token: one call a turn), read back by the
  `openai` format.
- harmony's built-in tools (the template's `builtin_tools`: browser, python) are refused by name.
"""

from __future__ import annotations

import json

from coreserve.frontend.server.common.errors import APIError
from coreserve.protocol.structured_outputs import StructuredOutputsParams

EFFORTS = ("low", "medium", "high")
# Whitespace in a call's JSON comes in runs of at most this many characters: no model can loop on it
# inside a call only the JSON's end lets it leave (a random one does); gpt-oss writes its JSON compact
MAX_WHITESPACE = 16


def speaks_harmony(server) -> bool:
    """Whether the server reads its replies as harmony (either flag names it)."""
    return getattr(server, "reasoning_parser", None) == "openai_gptoss" or (
        getattr(server, "tool_call_parser", None) == "openai"
    )


def check_reasoning_effort(server, effort: str | None, param: str) -> None:
    """A 400 naming `param` for an effort this server cannot give."""
    if effort is None:
        return
    if not speaks_harmony(server):
        message = f"{param} needs a server that reads harmony (gpt-oss: --reasoning-parser openai_gptoss)"
        raise APIError(400, message, param)
    if effort not in EFFORTS:
        raise APIError(400, f"{param}: {effort!r} is not one of harmony's efforts {', '.join(EFFORTS)}", param)


def template_kwargs(server, body) -> dict | None:
    """The body's `chat_template_kwargs` with its `reasoning_effort`; harmony's built-in tools refused."""
    kwargs = getattr(body, "chat_template_kwargs", None)
    if speaks_harmony(server) and (kwargs or {}).get("builtin_tools"):
        message = "chat_template_kwargs.builtin_tools: harmony's built-in browser and python tools are not served"
        raise APIError(400, message, "chat_template_kwargs")
    effort = getattr(body, "reasoning_effort", None)
    if effort is None:
        return kwargs
    if (kwargs or {}).get("reasoning_effort", effort) != effort:
        message = "reasoning_effort differs from chat_template_kwargs.reasoning_effort: set one"
        raise APIError(400, message, "reasoning_effort")
    return {**(kwargs or {}), "reasoning_effort": effort}


def check_effort_rendered(body, text: str) -> None:
    """The template wrote the effort (a custom one may not read the variable)."""
    effort = getattr(body, "reasoning_effort", None)
    if effort is not None and f"Reasoning: {effort}" not in text:
        message = f"reasoning_effort: the chat template does not write 'Reasoning: {effort}' into the prompt"
        raise APIError(400, message, "reasoning_effort")


def with_thinking(server, messages: list[dict]) -> list[dict]:
    """An assistant's reasoning under the name gpt-oss's template reads, on a harmony server."""
    if not speaks_harmony(server):
        return messages
    out = []
    for message in messages:
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if message.get("role") == "assistant" and reasoning and "thinking" not in message:
            message = {**message, "thinking": reasoning}
        out.append(message)
    return out


def call_grammar(functions: list[tuple[str, dict]]) -> StructuredOutputsParams:
    """One harmony call message to any of `functions` ((name, parameters schema) each), as EBNF: each
    header joined to its schema's grammar by xgrammar (imported here: call it off the event loop)."""
    import xgrammar

    variants = []
    for name, parameters in functions:
        if any(c.isspace() for c in name) or "<|" in name:
            raise APIError(400, f"tools: {name!r} cannot be named in a harmony header", "tools")
        header = f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
        try:
            arguments = xgrammar.Grammar.from_json_schema(json.dumps(parameters), max_whitespace_cnt=MAX_WHITESPACE)
        except (RuntimeError, ValueError) as exc:
            raise APIError(400, f"tools: the tools' schemas make no grammar: {exc}", "tools") from exc
        opening = xgrammar.Grammar.from_ebnf("root ::= " + json.dumps(header, ensure_ascii=False))
        variants.append(xgrammar.Grammar.concat(opening, arguments))
    grammar = variants[0] if len(variants) == 1 else xgrammar.Grammar.union(*variants)
    return StructuredOutputsParams(grammar=str(grammar))
