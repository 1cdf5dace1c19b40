"""The tool-call formats by their vLLM names (`--tool-call-parser`; frontend process, HTTP server)."""

from __future__ import annotations

from frontend.server.parsers import hermes, llama3_json, mistral, pythonic
from frontend.server.parsers.tool_calls import CallFormat

TOOL_FORMATS: dict[str, CallFormat] = {
    fmt.name: fmt for fmt in (hermes.FORMAT, llama3_json.FORMAT, mistral.FORMAT, pythonic.FORMAT)
}
TOOL_PARSERS = tuple(TOOL_FORMATS)
